"""The serving endpoints' limits: per-key and per-project rates (429 + Retry-After, counted in the
suite's real Redis, as every replica counts), served completions counted against the project's
ingest rate, conversation slots taken only by answered requests, conversations bound to the key
that opened them, and a bounded recorder that sheds with a metric.

    .venv/bin/python -m pytest tests/inference/test_serving_limits.py -q
"""

from __future__ import annotations

import json
import types

import pytest
from django.test import override_settings
from prometheus_client import REGISTRY

from feedback.services import api_key_create
from inference import conversations, serving
from inference.engines import make_engine
from inference.scripted import ScriptedEngine

pytestmark = pytest.mark.django_db
CHAT = {"model": "acme", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def engine(dense_dir):
    return ScriptedEngine(make_engine("torch", dense_dir, version=1, max_model_len=256), lambda prompt: "ok")


@pytest.fixture
def server(engine, creds, monkeypatch):
    # One fixed minute: a window boundary inside a test would reset the counters it checks.
    monkeypatch.setattr("feedback.ratelimit.time", types.SimpleNamespace(time=lambda: 1_800_000_000.0 + creds.project.id * 120))
    events: list[dict] = []
    server = serving.PolicyServer("acme", engine, serving.Recorder(write=events.extend), max_model_len=256)
    serving.SERVER = server
    with override_settings(ROOT_URLCONF="inference.urls"):
        yield server
    serving.SERVER = None
    server.close()


def _chat(client, key: str, path: str = "/v1/chat/completions", **body):
    return client.post(path, json.dumps({**CHAT, **body}), content_type="application/json",
                       headers={"Authorization": f"Bearer {key}"})


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_key_over_its_rate_gets_429_with_retry_after_and_another_key_goes_on(client, creds, server, settings, one_rate_window):
    settings.FLYWHEEL_SERVE_RATE_PER_KEY = 3
    other = api_key_create(creds.project, ["serve"], name="other-client")
    assert [_chat(client, creds.api_key).status_code for _ in range(3)] == [200] * 3
    refused = _chat(client, creds.api_key)
    assert refused.status_code == 429 and 0 < int(refused["Retry-After"]) <= 60
    assert "this API key" in refused.json()["error"]["message"] and refused.json()["error"]["fix"]
    assert _chat(client, other, "/v1/completions", prompt="x").status_code == 200


def test_a_project_over_its_serving_rate_gets_429_whatever_the_key(client, creds, server, settings, one_rate_window):
    settings.FLYWHEEL_SERVE_RATE_PER_PROJECT = 2
    keys = [api_key_create(creds.project, ["serve"], name=f"client-{i}") for i in range(3)]
    assert [_chat(client, k).status_code for k in keys] == [200, 200, 429]


def test_served_completions_count_against_the_projects_ingest_rate(client, creds, server, post_events, one_rate_window):
    from tests.factories import feedback

    creds.project.rate_limit_per_minute = 3
    creds.project.save()
    assert _chat(client, creds.api_key, n=2).status_code == 200
    refused = _chat(client, creds.api_key, n=2)
    assert refused.status_code == 429 and "ingest rate" in refused.json()["error"]["fix"]
    # The webhook is counted in the same budget.
    with override_settings(ROOT_URLCONF="webapp.urls"):
        assert post_events([feedback("f-1")]).status_code == 429


def test_refused_requests_take_no_conversation_slot(client, creds, server, monkeypatch, settings, one_rate_window):
    monkeypatch.setattr(conversations, "MAX_OPEN", 2)
    registry = conversations.conversations_for(server)
    for i in range(5):  # each refused after its conversation was looked up
        assert _chat(client, creds.api_key, n=2, metadata={"conversation_id": f"bad-{i}"}).status_code == 400
    assert registry.open_count() == 0
    for i in range(2):
        assert _chat(client, creds.api_key, metadata={"conversation_id": f"ok-{i}"}).status_code == 200
    full = _chat(client, creds.api_key, metadata={"conversation_id": "third"})
    assert full.status_code == 429 and full["Retry-After"] and registry.open_count() == 2
    registry.close()
    settings.FLYWHEEL_SERVE_RATE_PER_KEY = 8  # 8 requests so far: the next is over the key's rate
    assert _chat(client, creds.api_key, metadata={"conversation_id": "over-rate"}).status_code == 429
    assert registry.open_count() == 0


def test_a_conversation_is_continued_only_by_the_key_that_opened_it(client, creds, server):
    other = api_key_create(creds.project, ["serve"], name="another-client")
    first = _chat(client, creds.api_key, metadata={"conversation_id": "c-1"}).json()
    stolen = _chat(client, other, previous_response_id=first["id"])
    made_up = _chat(client, other, previous_response_id="chatcmpl-made-up")
    assert stolen.status_code == made_up.status_code == 404 and stolen.json() == made_up.json()
    # The same conversation id under another key is another conversation.
    theirs = _chat(client, other, metadata={"conversation_id": "c-1"}).json()
    assert theirs["choices"][0]["trajectory_id"] != first["choices"][0]["trajectory_id"]
    ours = _chat(client, creds.api_key, previous_response_id=first["id"]).json()
    assert ours["choices"][0]["trajectory_id"] == first["choices"][0]["trajectory_id"]


def test_a_full_recorder_refuses_new_completions_with_503_and_counts_them(client, creds, server):
    server.recorder.max_pending = 1
    assert _chat(client, creds.api_key, "/v1/completions", prompt="x").status_code == 200
    before = _metric("flywheel_serving_recorder_shed_total", how="refused")
    refused = _chat(client, creds.api_key, "/v1/completions", prompt="x")
    assert refused.status_code == 503 and refused["Retry-After"]
    assert _metric("flywheel_serving_recorder_shed_total", how="refused") == before + 1
    assert server.recorder.pending() == 1


def test_the_recorder_queue_is_bounded_and_sheds_with_a_metric():
    recorder = serving.Recorder(write=lambda events: None, max_pending=2)
    before = _metric("flywheel_serving_recorder_shed_total", how="dropped")
    recorder.put([{"id": f"t-{i}"} for i in range(5)])
    assert recorder.pending() == 2 and recorder.full()
    assert _metric("flywheel_serving_recorder_shed_total", how="dropped") == before + 3


def test_requests_far_from_their_limits_wait_on_no_redis_round_trip(client, creds, server, settings, one_rate_window):
    import redis

    from core.cache import shared_cache
    from feedback import ratelimit

    probe = redis.Redis.from_url(settings.CACHES["default"]["LOCATION"])

    def evals() -> int:
        return int(probe.info("commandstats").get("cmdstat_eval", {}).get("calls", 0))

    try:
        assert _chat(client, creds.api_key).status_code == 200  # the key's counters are new here: Redis counts it
        before = evals()
        assert [_chat(client, creds.api_key).status_code for _ in range(5)] == [200] * 5
        assert evals() == before
        ratelimit.RATES.settle()  # the five reach the shared counter within a settle
        assert shared_cache().get(ratelimit._bucket(f"serve-project:{creds.project.id}")) == 6
    finally:
        probe.close()
