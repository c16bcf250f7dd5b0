"""Self-summarization through the serving endpoint: a conversation over the summary budget is
compacted by a summary the policy writes, the turn is answered in the compacted context, and every
turn (the summary included) is trained in exactly the context it was sampled in.

The answers come from a scripted policy (inference/scripted.py: scripted text, the real tiny
policy's token ids and log-probs), so the budget is crossed at a known turn.

    .venv/bin/python -m pytest tests/inference/test_summaries.py -q
"""

from __future__ import annotations

import json
from io import StringIO

import pytest
import torch
from django.core.management import CommandError, call_command
from django.test import override_settings
from transformers import AutoModelForCausalLM

from feedback.models import Trajectory
from feedback.services import feedback_ingest
from inference import serving
from inference.conversations import SUMMARY_REQUEST
from inference.engines import make_engine
from inference.scripted import ScriptedEngine
from inference.serving import ServingError
from tests.factories import feedback
from tests.training.test_services import later, plain_spec
from training.rewards.services import rewards_compute_pending
from training.rl.config import RLConfig
from training.rl.trainer import Batch, compute_logprobs
from training.runs.turns import context_messages, samples_from

MAX_TOKENS = 48
SUMMARY = "Summary: two questions about f, both answered."
USERS = ["What does f do in a.py?", "And g?", "So what is left?", "Thanks, and h?"]


def _script(prompt: str) -> str:
    """Asked for a summary, gives one; otherwise a long answer numbered by the assistant turns so far."""
    if prompt.endswith(SUMMARY_REQUEST + "<|im_end|>\n<|im_start|>assistant\n"):
        return SUMMARY
    return f"Answer {prompt.count('<|im_start|>assistant')}: " + "f returns the sum of its two arguments. " * 3


def _ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def _third_turn(tokenizer) -> list[dict]:
    """The client's history at the third request (the scripted answers are known in advance)."""
    messages = [{"role": "user", "content": USERS[0]}]
    for user in USERS[1:3]:
        messages += [{"role": "assistant", "content": _script(tokenizer.decode(_ids(tokenizer, messages)))},
                     {"role": "user", "content": user}]
    return messages


@pytest.fixture
def make_server(creds, dense_dir):
    """make_server(budget) -> (server, recorded events); budget "third": the third turn crosses it."""
    made = []

    def make(budget):
        engine = ScriptedEngine(make_engine("torch", dense_dir, version=1, max_model_len=512), _script)
        if budget == "third":
            budget = len(_ids(engine.tokenizer, _third_turn(engine.tokenizer))) + MAX_TOKENS - 1
        events: list[dict] = []
        server = serving.PolicyServer("acme", engine, serving.Recorder(write=events.extend), max_model_len=512,
                                      summary_budget=budget)
        serving.SERVER = server
        made.append(server)
        return server, events

    with override_settings(ROOT_URLCONF="inference.urls"):
        yield make
    serving.SERVER = None
    for server in made:
        server.close()


def _post(client, key, **body):
    return client.post("/v1/chat/completions", json.dumps({"model": "acme", "max_tokens": MAX_TOKENS, **body}),
                       content_type="application/json", headers={"Authorization": f"Bearer {key}"})


def _chat(client, key, **body):
    response = _post(client, key, **body)
    assert response.status_code == 200, response.content
    return response.json()


def _converse(client, key, turns: int = 4) -> tuple[list[dict], list[dict]]:
    """The client's side: full history every turn, conversation_id; the last turn ends it."""
    messages, answers = [], []
    for k, user in enumerate(USERS[:turns]):
        messages.append({"role": "user", "content": user})
        meta = {"conversation_id": "c-sum", **({"conversation_end": True} if k == turns - 1 else {})}
        answers.append(_chat(client, key, messages=messages, metadata=meta))
        messages.append(answers[-1]["choices"][0]["message"])
    return messages, answers


def _assert_bitwise(policy, turns) -> None:
    for turn in turns:
        batch = Batch.from_samples([turn], pad_id=0, advantages=torch.zeros(1))
        ours = compute_logprobs(policy, batch, RLConfig(batch_invariant=True))[0][batch.completion_mask[0]]
        assert torch.equal(ours, torch.tensor(turn.behaviour_logprobs))


def test_a_conversation_over_the_budget_is_answered_after_a_summary_and_trained_in_that_context(
        client, creds, bob, make_server, dense_dir):
    server, events = make_server("third")
    tokenizer = server.engine.tokenizer
    messages, answers = _converse(client, creds.api_key)
    assert all("flywheel" not in a for a in answers[:2])  # under the budget: as before
    third, fourth = answers[2]["flywheel"]["compaction"], answers[3]["flywheel"]["compaction"]
    assert third == {"summarized_now": True, "summary": SUMMARY, "messages_summarized": 3, "kept_from": 4,
                     "summary_tokens": len(tokenizer.encode(SUMMARY)) + 1}
    assert fourth == {"summarized_now": False, "summary": SUMMARY, "messages_summarized": 3, "kept_from": 4}
    assert len({a["choices"][0]["trajectory_id"] for a in answers}) == 1  # the summary is no trajectory of its own

    server.recorder.flush()
    (event,) = events
    steps = event["steps"]
    assert [s["role"] for s in steps] == ["assistant", "user", "assistant", "user", "assistant", "user", "assistant",
                                          "user", "assistant"]
    assert steps[3]["content"] == SUMMARY_REQUEST and steps[4]["content"] == SUMMARY and steps[4]["summary"] is True
    assert steps[4]["policy_version"] == 1 and len(steps[4]["logprobs"]) == len(steps[4]["token_ids"])
    summarized = [messages[0], {"role": "assistant", "content": SUMMARY}]
    # What each turn was fed: the summary request in the full history; then the first request's
    # message, the summary, and the client's messages since the last answer before the summary.
    assert steps[4]["prompt_token_ids"] == _ids(tokenizer, [*messages[:4], {"role": "user", "content": SUMMARY_REQUEST}])
    assert steps[6]["prompt_token_ids"] == _ids(tokenizer, [*summarized, messages[4]])
    assert steps[8]["prompt_token_ids"] == _ids(tokenizer, [*summarized, *messages[4:7]])
    assert messages[1]["content"] not in tokenizer.decode(steps[6]["prompt_token_ids"])
    assert answers[2]["usage"]["prompt_tokens"] == len(steps[6]["prompt_token_ids"])
    assert len(steps[6]["prompt_token_ids"]) + MAX_TOKENS <= server.summary_budget

    assert [r.status for r in feedback_ingest(creds.project, events)] == ["accepted"]
    trajectory = Trajectory.objects.prefetch_related("steps").get()
    turns = samples_from(trajectory, 1.0, tokenizer)
    assert len(turns) == 5  # four answers and the summary, each in its recorded context
    for turn, step in zip(turns, steps[::2], strict=True):
        assert turn.prompt_ids == step["prompt_token_ids"] and turn.completion_ids == step["token_ids"]
    stored = list(trajectory.steps.all())
    for i in (4, 6, 8):  # the trainer's re-rendering of a text-only trajectory follows the same rule
        assert _ids(tokenizer, context_messages(trajectory, stored, i)) == steps[i]["prompt_token_ids"]
    _assert_bitwise(AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32).eval(), turns)

    plain_spec(creds.project, settle_seconds=0)  # the replay marks the compaction once the turns have credit
    feedback_ingest(creds.project, [feedback("fb-1", event["id"], signal="accept")])
    rewards_compute_pending(creds.project, now=later(1))
    client.force_login(bob)
    with override_settings(ROOT_URLCONF="webapp.urls"):
        page = client.get(f"/p/{creds.project.slug}/rollouts/{trajectory.pk}/")
    assert page.status_code == 200
    assert [bool(v.turn and v.turn["summary"]) for v in page.context["steps"]] == [i == 4 for i in range(9)]
    assert page.content.decode().count('data-compacted="4"') == 1


@pytest.mark.parametrize("budget", [0, 511], ids=["off", "under"])
def test_a_conversation_within_the_budget_or_with_summaries_off_is_unchanged(client, creds, make_server, budget):
    server, events = make_server(budget)
    messages, answers = _converse(client, creds.api_key)
    assert all("flywheel" not in a for a in answers)
    server.recorder.flush()
    (event,) = events
    assert not any(s.get("summary") or s["content"] == SUMMARY_REQUEST for s in event["steps"])
    assert event["steps"][-1]["prompt_token_ids"] == _ids(server.engine.tokenizer, messages[:-1])  # the full history


def test_a_compacted_conversation_needs_the_full_history(client, creds, make_server):
    make_server("third")
    messages = []
    for user in USERS[:3]:
        messages.append({"role": "user", "content": user})
        answer = _chat(client, creds.api_key, messages=messages, metadata={"conversation_id": "c-open"})
        messages.append(answer["choices"][0]["message"])
    assert answer["flywheel"]["compaction"]["summarized_now"]
    response = _post(client, creds.api_key, messages=[messages[0], {"role": "user", "content": "hm"}],
                     metadata={"conversation_id": "c-open"})
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert "compacted" in error["message"] and "full history" in error["fix"]


@pytest.mark.parametrize("budget", [-1, 512, 4096, 1.5, True, "384"])
def test_a_bad_summary_budget_is_refused_with_the_fix(dense_dir, budget):
    engine = make_engine("torch", dense_dir, version=1, max_model_len=512)
    with pytest.raises(ServingError) as raised:
        serving.PolicyServer("acme", engine, None, max_model_len=512, summary_budget=budget)
    engine.close()
    assert "0 (off) or 1 to 511 tokens" in raised.value.message and "--summary-budget 384" in raised.value.fix


@pytest.mark.parametrize("argv", [["--summary-budget", "-5"], ["--summary-budget", "512"],
                                  ["--summary-budget", "300", "--max-model-len", "256"]])
def test_serve_policy_refuses_a_bad_summary_budget_before_starting(creds, argv):
    with pytest.raises(CommandError, match=r"--summary-budget: the summary budget must be 0 \(off\)"):
        call_command("serve_policy", "--project", "acme", *argv, stdout=StringIO())
