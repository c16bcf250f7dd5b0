"""Agent trajectories in the trainer: every assistant turn is a sample scored in the context it
was sampled in, user/tool text is context only, rewards reach turns by reward-to-go, turns sent
as text are re-tokenised and flagged, and a turn the policy cannot take quarantines its trajectory.

    .venv/bin/python -m pytest tests/training/runs/test_turns.py -q
"""

from __future__ import annotations

from feedback.models import Quarantine, Trajectory
from feedback.services import feedback_ingest
from tests.factories import feedback, trajectory
from tests.training.test_services import later, plain_spec
from training.rewards.services import rewards_compute_pending
from training.runs.services import train_policy, training_run_start
from training.runs.settings import RunSettings
from training.runs.turns import samples_from

CALL = [{"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"p": 1}'}}]


def agent(ident: str, bad_id: int | None = None) -> dict:
    """user -> assistant (tool call) -> tool -> assistant (+0.5) -> user (-0.25) -> assistant (text only)."""
    return trajectory(ident, task="agent", prompt=[{"role": "user", "content": "fix"}], steps=[
        {"role": "assistant", "content": "", "tool_calls": CALL, "token_ids": [10, 11], "logprobs": [-0.5, -0.25],
         "prompt_token_ids": [1, 2, 3]},
        {"role": "tool", "content": "ok", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "done", "token_ids": [12, bad_id or 13], "logprobs": [-1.0, -2.0],
         "prompt_token_ids": [1, 2, 3, 10, 11, 4, 5], "reward": 0.5},
        {"role": "user", "content": "sure?", "reward": -0.25},
        {"role": "assistant", "content": " yes"},
    ])


def test_every_assistant_turn_is_a_sample_in_the_context_it_was_sampled_in(creds, tokenizer):
    feedback_ingest(creds.project, [agent("a-1")])
    t = Trajectory.objects.prefetch_related("steps").get()
    first, second, third = samples_from(t, 1.0, tokenizer)

    assert (first.prompt_ids, first.completion_ids, first.behaviour_logprobs) == ([1, 2, 3], [10, 11], [-0.5, -0.25])
    assert (second.prompt_ids, second.completion_ids) == ([1, 2, 3, 10, 11, 4, 5], [12, 13])  # as the engine was fed
    # the outcome (1.0) to every turn, plus the step rewards from the turn on
    assert [s.reward for s in (first, second, third)] == [1.25, 1.25, 1.0]
    assert {s.episode for s in (first, second, third)} == {f"trajectory-{t.pk}"}
    assert [s.episode_return for s in (first, second, third)] == [1.25] * 3
    assert [s.turn for s in (first, second, third)] == [0, 1, 2]
    assert not first.retokenised and not second.retokenised

    # the text-only turn: the chat template renders its context (tool call and tool result
    # included) and the turn; no behaviour log-probs
    assert third.retokenised and third.behaviour_logprobs is None
    context = tokenizer.decode(third.prompt_ids)
    assert context.startswith("<|im_start|>user\nfix<|im_end|>\n")
    assert "<|im_start|>tool\nok<|im_end|>" in context and "<tool_call>" in context and context.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(third.completion_ids) == " yes<|im_end|>\n"


def test_a_multi_turn_run_trains_every_turn_and_quarantines_a_trajectory_with_one_bad_turn(creds, production):
    plain_spec(creds.project, settle_seconds=0)
    events = [agent(f"a-{i}", bad_id=500 if i == 0 else None) for i in range(4)]  # vocabulary: 384 ids
    events += [feedback(f"fb-{i}", f"a-{i}", signal="accept") for i in range(4)]
    feedback_ingest(creds.project, events)
    rewards_compute_pending(creds.project, now=later(1))

    run, _ = training_run_start(creds.project, RunSettings(steps=2, batch_size=4), enqueue=False)
    run = train_policy(run.pk)
    assert run.state == "succeeded", (run.error, list(Quarantine.objects.values_list("error", flat=True)))
    assert run.result["trajectories"] == 3 and run.result["samples"] == 9  # three turns each
    assert run.result["retokenised"] == 3  # the text-only turn of each: trained with mu = pi_old
    assert run.result["behaviour_unknown"] == 0
    errors = dict(Quarantine.objects.filter(kind="training").values_list("item", "error"))
    assert list(errors) == ["trajectory a-0"], errors
    item, error = next(iter(errors.items()))
    assert item == "trajectory a-0" and "token id 500 is outside the policy's vocabulary" in error


def test_after_a_summary_turn_a_re_rendered_context_starts_from_the_summary(creds, tokenizer):
    feedback_ingest(creds.project, [trajectory("s-1", prompt=[{"role": "user", "content": "task"}], steps=[
        {"role": "assistant", "content": "early"},
        {"role": "user", "content": "summarize"},
        {"role": "assistant", "content": "gist", "summary": True},
        {"role": "assistant", "content": "late"},
    ])])
    turns = samples_from(Trajectory.objects.prefetch_related("steps").get(), 0.0, tokenizer)
    assert len(turns) == 3 and all(t.retokenised for t in turns)  # the summary is trained like any turn
    summary_context, late_context = (tokenizer.decode(t.prompt_ids) for t in turns[1:])
    assert "early" in summary_context and "summarize" in summary_context
    assert late_context == ("<|im_start|>user\ntask<|im_end|>\n<|im_start|>assistant\ngist<|im_end|>\n"
                            "<|im_start|>assistant\n")
