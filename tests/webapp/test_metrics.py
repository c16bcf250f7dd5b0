"""GET /metrics on the web app and on the serving process: the names move when work happens, and
only a loopback caller or a bearer of FLYWHEEL_METRICS_TOKEN may read them."""

from __future__ import annotations

import json
import re

import pytest
from django.test import override_settings

from inference import serving
from inference.engines import make_engine
from tests.factories import feedback, trajectory
from training.management.commands.serve_policy import recorder_for
from training.models import PolicyVersion, Reward, RewardSpec, TrainingRun, TrainingStep

pytestmark = pytest.mark.django_db


def _value(text: str, name: str, **labels: str) -> float:
    """The sample `name{labels}` (labels matched as a subset), 0 when absent."""
    for line in text.splitlines():
        match = re.fullmatch(r"([a-z_:]+)(?:\{(.*)\})? (\S+)", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


def _scrape(client, **headers) -> str:
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    return response.content.decode()


def test_the_web_apps_names_move_when_work_happens(client, creds, post_events):
    before = _scrape(client)
    route = {"route": "api/v1/events", "method": "POST", "status": "202"}
    assert post_events({"events": [trajectory("t-1"), feedback("f-1", "t-1"), {"type": "nope", "id": "x"}]}
                       ).status_code == 202
    v1 = PolicyVersion.objects.create(project=creds.project, number=1, state="production")
    PolicyVersion.objects.create(project=creds.project, number=2, state="awaiting_approval", parent=v1)
    spec, _ = RewardSpec.objects.get_or_create(project=creds.project, version=1)
    Reward.objects.create(trajectory=creds.project.trajectories.get(), spec=spec, total=0.75)
    run = TrainingRun.objects.create(project=creds.project, base_version=v1, state="running")
    TrainingStep.objects.create(run=run, step=3, loss=0, kl_ref=0, entropy=0, clip_fraction=0, mismatch_kl=0,
                                grad_norm=0, reward_mean=0.5, tokens_per_s=1234.5, dropped_stale=2)
    after = _scrape(client)

    for status, n in (("accepted", 2), ("rejected", 1)):
        grew = _value(after, "flywheel_ingest_events_total", status=status) - _value(
            before, "flywheel_ingest_events_total", status=status)
        assert grew == n
    assert _value(after, "flywheel_http_request_duration_seconds_count", **route) == _value(
        before, "flywheel_http_request_duration_seconds_count", **route) + 1
    slug = creds.project.slug
    assert _value(after, "flywheel_policy_versions", project=slug, state="production") == 1
    assert _value(after, "flywheel_policy_versions", project=slug, state="awaiting_approval") == 1
    assert _value(after, "flywheel_reward_mean", project=slug, version="1") == 0.75
    assert _value(after, "flywheel_training_step", project=slug) == 3
    assert _value(after, "flywheel_training_tokens_per_second", project=slug) == 1234.5
    assert _value(after, "flywheel_training_trajectories_dropped_stale_total", project=slug) == 2
    assert _value(after, "flywheel_broker_up") == 1
    assert "flywheel_queue_depth{queue=\"train\"}" in after


def test_the_queue_depth_counts_waiting_tasks(client, settings):
    import redis

    from webapp.metrics import queue_depths

    prefix = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", {}).get("global_keyprefix", "")
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    key = f"{prefix}gate"
    before = queue_depths()["gate"]
    broker.rpush(key, b"{}", b"{}")
    try:
        assert queue_depths()["gate"] == before + 2
        assert _value(_scrape(client), "flywheel_queue_depth", queue="gate") == before + 2
    finally:
        broker.ltrim(key, 0, -3) if before else broker.delete(key)


@pytest.mark.django_db(transaction=True)  # the recorder's writer closes stale connections, as in serve_policy
def test_the_serving_process_counts_tokens_versions_and_recorded_trajectories(client, creds, dense_dir):
    engine = make_engine("torch", dense_dir, version=1, max_model_len=64)
    recorder = recorder_for(creds.project)
    serving.SERVER = serving.PolicyServer(creds.project.slug, engine, recorder=recorder, max_model_len=64)
    try:
        with override_settings(ROOT_URLCONF="inference.urls"):
            before = _scrape(client)
            body = {"model": creds.project.slug, "messages": [{"role": "user", "content": "def f"}],
                    "max_tokens": 5, "n": 2, "seed": 1}
            response = client.post("/v1/chat/completions", json.dumps(body), content_type="application/json",
                                   headers={"Authorization": f"Bearer {creds.api_key}"})
            assert response.status_code == 200, response.content
            assert recorder.flush() == 2
            after = _scrape(client)
    finally:
        serving.SERVER = None
    tokens = sum(response.json()["usage"][k] for k in ("completion_tokens",))
    assert _value(after, "flywheel_serving_generated_tokens_total", version="1") - _value(
        before, "flywheel_serving_generated_tokens_total", version="1") == tokens > 0
    assert _value(after, "flywheel_serving_time_to_first_token_seconds_count") == _value(
        before, "flywheel_serving_time_to_first_token_seconds_count") + 1
    assert _value(after, "flywheel_serving_trajectories_recorded_total") == _value(
        before, "flywheel_serving_trajectories_recorded_total") + 2
    assert _value(after, "flywheel_serving_policy_version", role="production") == 1
    assert _value(after, "flywheel_http_request_duration_seconds_count", route="v1/chat/completions") >= 1


def test_metrics_are_refused_to_remote_and_proxied_callers(client):
    remote = client.get("/metrics", REMOTE_ADDR="203.0.113.9")
    assert remote.status_code == 403 and "FLYWHEEL_METRICS_TOKEN" in remote.json()["error"]["fix"]
    proxied = client.get("/metrics", HTTP_X_FORWARDED_FOR="203.0.113.9")
    assert proxied.status_code == 403


@pytest.mark.parametrize("header", ["X-Real-IP", "X-Forwarded-Host", "Forwarded", "True-Client-IP", "Via"])
def test_a_loopback_request_a_proxy_forwarded_is_no_local_scrape(client, header):
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 200
    response = client.get("/metrics", REMOTE_ADDR="127.0.0.1", headers={header: "203.0.113.9"})
    assert response.status_code == 403 and response.json()["error"]["fix"]


@override_settings(FLYWHEEL_METRICS_TOKEN="scrape-me")
def test_with_a_token_set_only_its_bearers_may_scrape(client):
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    ok = client.get("/metrics", REMOTE_ADDR="203.0.113.9", HTTP_AUTHORIZATION="Bearer scrape-me")
    assert ok.status_code == 200 and b"flywheel_ingest_events_total" in ok.content
