"""Sandboxed agent rollouts with a scripted policy (deterministic tool calls, the real tiny
policy's token ids and log-probs): tools run in bubblewrap, the tests give the reward, every turn
goes to the trainer in its context, and a context over budget is compacted by a trained summary.

    .venv/bin/python -m pytest tests/training/rewards/test_agent_rollouts.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from feedback.models import Trajectory
from feedback.services import feedback_ingest
from inference.engines import make_engine
from inference.scripted import ScriptedEngine
from training.rewards.agents import (
    SAMPLE_TASKS,
    SUMMARY_REQUEST,
    AgentReward,
    agent_reward,
    judged_text,
    run_agent_rollouts,
    scripted_agent,
)
from training.rewards.services import agent_reward_of, reward_spec_current, reward_spec_update
from training.rl.config import RLConfig
from training.rl.trainer import Batch, compute_logprobs
from training.runs.turns import samples_from


@pytest.fixture(scope="module")
def scripted(dense_dir):
    engine = ScriptedEngine(make_engine("torch", dense_dir, version=1, max_model_len=2048), scripted_agent)
    yield engine
    engine.close()


def _assert_every_turn_scored_as_served(dense_dir, tokenizer, trajectory):
    policy = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32).eval()
    turns = samples_from(trajectory, 0.0, tokenizer)
    for turn in turns:
        batch = Batch.from_samples([turn], pad_id=0, advantages=torch.zeros(1))
        ours = compute_logprobs(policy, batch, RLConfig(batch_invariant=True))[0][batch.completion_mask[0]]
        assert torch.equal(ours, torch.tensor(turn.behaviour_logprobs))
    return turns


def test_g_scripted_rollouts_per_task_fix_the_code_in_the_sandbox_and_are_trained_turn_by_turn(
    creds, scripted, dense_dir
):
    events = run_agent_rollouts(scripted, SAMPLE_TASKS, G=2, max_turns=6, summary_budget=4096)
    assert len(events) == 4 and len({e["group"] for e in events}) == 2
    for e in events:
        assert e["agent"] == {"reward": 1.0, "tests_share": 1.0, "components": {"tests": 1.0},
                              "passed": e["agent"]["passed"], "failed": 0, "turns": 4, "tool_calls": 3, "summaries": 0}
        assert [s["role"] for s in e["steps"]] == ["assistant", "tool"] * 3 + ["assistant"]
        assert json.loads(e["steps"][5]["content"])["failed"] == 0  # run_tests, in the sandbox, after the fix
        assert e["steps"][-1]["reward"] == 1.0
    assert [r.status for r in feedback_ingest(creds.project, events)] == ["accepted"] * 4

    trajectory = Trajectory.objects.prefetch_related("steps").get(external_id=events[0]["id"])
    turns = _assert_every_turn_scored_as_served(dense_dir, scripted.tokenizer, trajectory)
    assert len(turns) == 4 and [t.reward for t in turns] == [1.0] * 4  # the tests' outcome to every turn


def test_a_context_over_budget_is_replaced_by_a_trained_summary_turn(creds, scripted, dense_dir):
    tokenizer = scripted.tokenizer
    from training.rewards.agents import TOOLS, _prompt

    first = tokenizer.apply_chat_template([{"role": "user", "content": _prompt(SAMPLE_TASKS[0])}], tools=TOOLS,
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
    (event,) = run_agent_rollouts(scripted, SAMPLE_TASKS[:1], G=1, max_turns=4, max_tokens=64,
                                  summary_budget=len(first) + 64 + 8)
    roles = [(s["role"], s.get("summary", False)) for s in event["steps"]]
    assert roles == [("assistant", False), ("tool", False), ("user", False), ("assistant", True), ("assistant", False)]
    assert event["agent"]["summaries"] == 1 and event["steps"][2]["content"] == SUMMARY_REQUEST
    after = tokenizer.decode(event["steps"][4]["prompt_token_ids"])
    assert "Summary: I read the file." in after and "<|im_start|>tool" not in after  # earlier turns replaced
    assert [r.status for r in feedback_ingest(creds.project, [event])] == ["accepted"]
    trajectory = Trajectory.objects.prefetch_related("steps").get()
    turns = _assert_every_turn_scored_as_served(dense_dir, tokenizer, trajectory)
    assert len(turns) == 3  # the summary is a trained turn


def test_the_reward_is_the_tests_weight_times_their_pass_share_plus_the_judges_weighted_aspects():
    # 2.0 x 3/4 of the tests + 0.1 x style 0.8; concision unscored (its judge failed): left out, not 0
    total, parts = agent_reward(0.75, 2.0, {"style": 0.8, "concision": None}, [("style", 0.1), ("concision", 0.1)])
    assert parts == {"tests": 1.5, "aspect:style": pytest.approx(0.08)} and total == pytest.approx(1.58)
    assert AgentReward(tests_weight=0.5).score(0.5, "anything", "fix it") == (0.25, {"tests": 0.25})
    task = SAMPLE_TASKS[0]
    assert judged_text(task, {**task.files, "calc.py": "fixed\n"}, "done") == "fixed\n"  # the changed code
    assert judged_text(task, dict(task.files), "done") == "done"  # nothing changed: its answer


def test_scripted_rollouts_are_rewarded_by_the_tests_and_the_projects_judge(creds, scripted):
    # The default spec's rule judge reads the fix "def add(a, b):\n    return a + b\n": style 1 (short
    # lines, snake_case), concision 1 (31 characters, no repeated line), each weighted 0.1.
    reward = agent_reward_of(reward_spec_current(creds.project), tests_weight=2.0)
    (event,) = run_agent_rollouts(scripted, SAMPLE_TASKS[:1], G=1, max_turns=6, summary_budget=4096, reward=reward)
    agent = event["agent"]
    assert agent["tests_share"] == 1.0
    assert agent["components"] == {"tests": 2.0, "aspect:style": 0.1, "aspect:concision": 0.1}
    assert agent["reward"] == pytest.approx(2.2) and event["steps"][-1]["reward"] == pytest.approx(2.2)
    # a spec without a judge: the tests alone
    spec = reward_spec_update(creds.project, judge={}, aspects=[])
    (event,) = run_agent_rollouts(scripted, SAMPLE_TASKS[1:], G=1, max_turns=6, summary_budget=4096,
                                  reward=agent_reward_of(spec))
    assert event["agent"]["components"] == {"tests": 1.0} and event["agent"]["reward"] == 1.0
