"""A served completion, followed into the trainer: recomputed log-probs equal the behaviour
log-probs on the same weights (bitwise on the torch engine, <= 1e-5 on vLLM in fp32).

The completions go through the serving endpoints' own code (`/v1/completions` with a raw prompt,
`/v1/chat/completions` with messages), the recorder's events through `feedback_ingest`, and the
stored rows through the trainer's data path (`training.runs.turns.samples_from`), every turn of a
conversation in the context it was sampled in. A completion scored
in another context than the one it was sampled in shows here as a large difference.

    .venv/bin/python -m pytest tests/training/runs/test_served_data_path.py -q
"""

from __future__ import annotations

import pytest
import torch
from django.test import override_settings
from transformers import AutoModelForCausalLM, AutoTokenizer

from feedback.models import Trajectory
from feedback.services import feedback_ingest
from inference import serving
from inference.engines import EngineFactory
from training.rl.config import RLConfig
from training.rl.trainer import Batch, compute_logprobs
from training.runs.turns import sample_from, samples_from
from training.versions.services import policy_folder, policy_register

RAW = "def parse_args(argv"
CHAT = [{"role": "user", "content": "for key, value in"}]


@pytest.fixture(params=["torch", "vllm"])
def served(request, creds, dense_dir, ckpt_settings):
    # The inference tests' dense policy (vLLM's CPU attention needs a head size the tiniest lacks).
    production = policy_register(creds.project, dense_dir, state="production")
    folder = policy_folder(production)
    engines = EngineFactory(request.param, {"max_model_len": 128})
    events: list[dict] = []
    recorder = serving.Recorder(write=events.extend)
    server = serving.PolicyServer("acme", engines(folder, production.number), recorder, max_model_len=128,
                                  engines=engines)
    serving.SERVER = server
    with override_settings(ROOT_URLCONF="inference.urls"):
        yield request.param, server, events, folder
    serving.SERVER = None
    server.close()


def _ask(client, path: str, body: dict, key: str) -> dict:
    response = client.post(path, body, content_type="application/json", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.content
    return response.json()


def test_served_completions_are_scored_by_the_trainer_in_the_context_they_were_sampled(client, creds, served):
    kind, server, events, folder = served
    model = "acme"
    _ask(client, "/v1/completions", {"model": model, "prompt": RAW, "max_tokens": 8, "n": 3, "seed": 1}, creds.api_key)
    _ask(client, "/v1/chat/completions", {"model": model, "messages": CHAT, "max_tokens": 8, "n": 3, "seed": 2}, creds.api_key)
    server.recorder.close()
    assert [r.status for r in feedback_ingest(creds.project, events)] == ["accepted"] * 6

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    policy = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    raw_ids = tokenizer.encode(RAW, add_special_tokens=False)
    trajectories = Trajectory.objects.filter(project=creds.project).prefetch_related("steps")
    assert trajectories.count() == 6
    for trajectory in trajectories:
        sample = sample_from(trajectory, 0.0, tokenizer)
        assert sample is not None and sample.behaviour_logprobs is not None
        if trajectory.prompt == [{"role": "user", "content": RAW}]:
            assert sample.prompt_ids == raw_ids  # sampled on the raw prompt, not a chat rendering
        _assert_scored_as_served(kind, policy, sample)


def _assert_scored_as_served(kind: str, policy, sample) -> None:
    batch = Batch.from_samples([sample], pad_id=0, advantages=torch.zeros(1))
    ours = compute_logprobs(policy, batch, RLConfig(batch_invariant=True))[0][batch.completion_mask[0]]
    behaviour = torch.tensor(sample.behaviour_logprobs)
    if kind == "torch":
        assert torch.equal(ours, behaviour), (ours - behaviour).abs().max()
    else:
        assert (ours - behaviour).abs().max() <= 1e-5


def test_every_turn_of_a_served_conversation_is_scored_in_the_context_it_was_sampled_in(client, creds, served):
    kind, server, events, folder = served
    messages = list(CHAT)
    for turn, follow_up in enumerate(["and then?", "thanks"]):
        answer = _ask(client, "/v1/chat/completions", {"model": "acme", "messages": messages, "max_tokens": 6,
                                                        "seed": 5 + turn}, creds.api_key)
        messages += [answer["choices"][0]["message"], {"role": "user", "content": follow_up}]
    server.recorder.close()
    served_steps = [e["steps"][0] for e in events]
    conversation = {**events[0], "id": "conversation-1",
                    "steps": [served_steps[0], {"role": "user", "content": "and then?"}, served_steps[1]]}
    assert [r.status for r in feedback_ingest(creds.project, [conversation])] == ["accepted"]

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    policy = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    first, second = samples_from(Trajectory.objects.prefetch_related("steps").get(), 0.0, tokenizer)
    assert second.prompt_ids == served_steps[1]["prompt_token_ids"]  # the second request's own context
    assert len(second.prompt_ids) > len(first.prompt_ids) + len(first.completion_ids)  # the first turn is in it
    for sample in (first, second):
        _assert_scored_as_served(kind, policy, sample)


def test_a_served_conversation_compacted_by_a_summary_is_scored_in_the_contexts_it_was_sampled_in(
        client, creds, served):
    kind, server, events, folder = served
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    messages, meta = list(CHAT), {"conversation_id": "c-1"}
    first = _ask(client, "/v1/chat/completions", {"model": "acme", "messages": messages, "max_tokens": 6,
                                                  "seed": 5, "metadata": meta}, creds.api_key)
    messages += [first["choices"][0]["message"], {"role": "user", "content": "and then?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    server.summary_budget = serving.summary_budget_of(len(prompt) + 6 - 1, server.max_model_len)  # this turn passes it
    second = _ask(client, "/v1/chat/completions", {"model": "acme", "messages": messages, "max_tokens": 6, "seed": 6,
                                                   "metadata": {**meta, "conversation_end": True}}, creds.api_key)
    assert second["flywheel"]["compaction"]["summarized_now"] is True
    server.recorder.close()
    (event,) = events
    steps = event["steps"]
    assert [s["role"] for s in steps] == ["assistant", "user", "assistant", "user", "assistant"] and steps[2]["summary"]
    compacted = [CHAT[0], {"role": "assistant", "content": steps[2]["content"]}, messages[-1]]
    assert steps[4]["prompt_token_ids"] == tokenizer.apply_chat_template(
        compacted, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert [r.status for r in feedback_ingest(creds.project, events)] == ["accepted"]

    policy = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    turns = samples_from(Trajectory.objects.prefetch_related("steps").get(), 0.0, tokenizer)
    assert [t.prompt_ids for t in turns] == [s["prompt_token_ids"] for s in steps[::2]]  # the summary is a turn
    for sample in turns:
        _assert_scored_as_served(kind, policy, sample)
