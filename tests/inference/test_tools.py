"""Tool calls through the serving endpoint and conversations linked into one trajectory.

The answers come from a scripted policy (inference/scripted.py: scripted text, the real tiny
policy's token ids and log-probs), so the tool-call plumbing is exercised deterministically; the
recorded conversation then goes through ingest and the trainer's data path, and every turn's
recomputed log-probs equal the served ones bit for bit.

    .venv/bin/python -m pytest tests/inference/test_tools.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from django.test import override_settings
from transformers import AutoModelForCausalLM

from feedback.models import Trajectory
from feedback.services import feedback_ingest
from inference import serving
from inference.engines import make_engine
from inference.scripted import ScriptedEngine
from inference.tools import INVALID, parse_tool_calls
from training.rl.config import RLConfig
from training.rl.trainer import Batch, compute_logprobs
from training.runs.turns import samples_from

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
READ = '<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>'


@pytest.mark.parametrize(("text", "reason", "calls"), [
    ("plain answer", "stop", None),
    ("let me look " + READ, "tool_calls", [("read_file", '{"path": "a.py"}')]),
    (READ + READ, "tool_calls", [("read_file", '{"path": "a.py"}')] * 2),
    ("<tool_call>{not json</tool_call>", INVALID, None),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', INVALID, None),  # not offered
    ('<tool_call>{"name": "read_file", "arguments": {}}', INVALID, None),  # unclosed
    ('<tool_call>{"name": "read_file", "arguments": "a.py"}</tool_call>', INVALID, None),  # arguments not an object
])
def test_tool_call_markup_parses_into_openai_tool_calls_or_an_invalid_finish_reason(text, reason, calls):
    answer = parse_tool_calls(text, "stop", TOOLS, "abc")
    assert answer.finish_reason == reason
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in answer.tool_calls or []] or None
    assert got == calls
    if calls:
        assert [c["id"] for c in answer.tool_calls] == [f"call_abc_{k}" for k in range(len(calls))]
        assert answer.content == text[: text.index("<tool_call>")]
    else:
        assert answer.content == text  # the client sees what the policy wrote


def test_without_tools_offered_markup_is_plain_text():
    assert parse_tool_calls(READ, "length", [], "abc").finish_reason == "length"


def _script(prompt: str) -> str:
    """Reads a.py first; then answers; asked again, writes a broken call."""
    if "again" in prompt:
        return "<tool_call>{oops</tool_call>"
    return "Fixed: f returns 1." if "<|im_start|>tool" in prompt else "Reading it. " + READ


@pytest.fixture
def scripted(creds, dense_dir):
    engine = ScriptedEngine(make_engine("torch", dense_dir, version=1, max_model_len=512), _script)
    events: list[dict] = []
    server = serving.PolicyServer("acme", engine, serving.Recorder(write=events.extend), max_model_len=512)
    serving.SERVER = server
    with override_settings(ROOT_URLCONF="inference.urls"):
        yield server, events
    serving.SERVER = None
    server.close()


def _chat(client, key, **body):
    response = client.post("/v1/chat/completions", json.dumps({"model": "acme", "max_tokens": 64, **body}),
                           content_type="application/json", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.content
    return response.json()


def test_a_tool_using_conversation_is_one_trajectory_trained_turn_by_turn_in_its_contexts(client, creds, scripted,
                                                                                          dense_dir):
    server, events = scripted
    messages = [{"role": "user", "content": "fix a.py"}]
    first = _chat(client, creds.api_key, messages=messages, tools=TOOLS, metadata={"conversation_id": "c-1"})
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Reading it. "
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "read_file", "arguments": '{"path": "a.py"}'}
    assert first["conversation_id"] == "c-1"

    messages += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "def f(): return 0"}]
    second = _chat(client, creds.api_key, messages=messages, tools=TOOLS, previous_response_id=first["id"])
    assert second["choices"][0]["finish_reason"] == "stop"
    assert second["choices"][0]["message"]["content"] == "Fixed: f returns 1."

    messages += [second["choices"][0]["message"], {"role": "user", "content": "again"}]
    third = _chat(client, creds.api_key, messages=messages, tools=TOOLS,
                  metadata={"conversation_id": "c-1", "conversation_end": True})
    assert third["choices"][0]["finish_reason"] == INVALID  # a parse failure is an answer, not a 500
    assert third["choices"][0]["message"]["content"] == "<tool_call>{oops</tool_call>"
    assert {r["choices"][0]["trajectory_id"] for r in (first, second, third)} == {choice["trajectory_id"]}

    server.recorder.flush()
    (event,) = events  # the three turns, recorded once as one trajectory
    assert event["id"] == choice["trajectory_id"] and event["prompt"] == [{"role": "user", "content": "fix a.py"}]
    assert [s["role"] for s in event["steps"]] == ["assistant", "tool", "assistant", "user", "assistant"]
    assert event["steps"][0]["tool_calls"] == [call] and event["steps"][1]["tool_call_id"] == call["id"]
    assert event["steps"][4]["finish_reason"] == INVALID
    assert [r.status for r in feedback_ingest(creds.project, events)] == ["accepted"]

    policy = AutoModelForCausalLM.from_pretrained(str(dense_dir), dtype=torch.float32).eval()
    turns = samples_from(Trajectory.objects.prefetch_related("steps").get(), 1.0, server.engine.tokenizer)
    assert len(turns) == 3 and "<tools>" in server.engine.tokenizer.decode(turns[0].prompt_ids)
    for turn, step in zip(turns, event["steps"][::2], strict=True):
        assert turn.prompt_ids == step["prompt_token_ids"] and turn.completion_ids == step["token_ids"]
        batch = Batch.from_samples([turn], pad_id=0, advantages=torch.zeros(1))
        ours = compute_logprobs(policy, batch, RLConfig(batch_invariant=True))[0][batch.completion_mask[0]]
        assert torch.equal(ours, torch.tensor(turn.behaviour_logprobs))  # every turn, bitwise


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"previous_response_id": "chatcmpl-nope"}, 404, "previous_response_id"),
    ({"metadata": {"conversation_id": "c-2"}, "n": 2}, 400, "'n' must be 1"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "tools[0]"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400, "only assistant"),
])
def test_bad_tool_or_conversation_requests_get_4xx_with_a_fix(client, creds, scripted, body, status, words):
    payload = {"model": "acme", "messages": [{"role": "user", "content": "hi"}], **body}
    response = client.post("/v1/chat/completions", json.dumps(payload), content_type="application/json",
                           headers={"Authorization": f"Bearer {creds.api_key}"})
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert words.lower() in error["message"].lower() + error["fix"].lower() and error["fix"]
