"""POST /api/v1/events: the ingest contract, every bad input, idempotency and ordering."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from feedback.models import FeedbackEvent, Step, Trajectory, WebhookDelivery
from tests.factories import feedback, sign, trajectory

pytestmark = pytest.mark.django_db


def _error(response) -> dict:
    body = response.json()
    assert set(body["error"]) >= {"code", "message", "fix"}, body
    assert body["error"]["message"] and body["error"]["fix"], body
    return body["error"]


def _nothing_stored() -> None:
    assert Trajectory.objects.count() == 0
    assert FeedbackEvent.objects.count() == 0


def test_it_stores_a_signed_batch_and_answers_each_event(post_events, creds):
    response = post_events([trajectory(), feedback()])
    assert response.status_code == 202, response.content
    body = response.json()
    assert [r["status"] for r in body["results"]] == ["accepted", "accepted"]
    assert body["accepted"] == 2
    t = Trajectory.objects.get(project=creds.project, external_id="traj-1")
    assert t.policy_version == 1 and t.task == "tab-completion"
    step = Step.objects.get(trajectory=t)
    assert step.token_ids == [17, 92, 5] and step.logprobs == [-0.1, -0.7, -0.2]
    event = FeedbackEvent.objects.get(event_id="fb-1")
    assert event.trajectory_id == t.id and event.signal == "accept"
    assert event.user_hash and event.user_hash != "u-42"


def test_feedback_before_its_trajectory_is_kept_and_linked_later(post_events):
    assert post_events([feedback()]).json()["results"][0]["status"] == "accepted"
    assert FeedbackEvent.objects.get().trajectory_id is None
    assert post_events([trajectory()]).status_code == 202
    assert FeedbackEvent.objects.get().trajectory.external_id == "traj-1"


def test_a_resent_event_is_a_duplicate_and_stored_once(post_events):
    post_events([trajectory(), feedback()])
    body = post_events([trajectory(), feedback()]).json()
    assert [r["status"] for r in body["results"]] == ["duplicate", "duplicate"]
    assert Trajectory.objects.count() == 1 and FeedbackEvent.objects.count() == 1


def test_the_same_id_twice_in_one_batch_is_stored_once(post_events):
    body = post_events([feedback("fb-1"), feedback("fb-1", signal="reject")]).json()
    assert [r["status"] for r in body["results"]] == ["accepted", "duplicate"]
    assert FeedbackEvent.objects.get().signal == "accept"


def test_a_replayed_webhook_id_is_answered_as_duplicate(post_events, creds):
    body = json.dumps({"events": [feedback()]}).encode()
    headers = sign(creds.webhook_secret, body, msg_id="msg_replay")
    assert post_events(None, raw=body, headers=headers).json()["accepted"] == 1
    again = post_events(None, raw=body, headers=headers)
    assert again.status_code == 202
    assert again.json()["results"][0]["status"] == "duplicate"
    assert "webhook-id" in again.json()["results"][0]["reason"]
    assert FeedbackEvent.objects.count() == 1 and WebhookDelivery.objects.count() == 1


def test_webhook_ids_are_forgotten_after_a_week_and_a_late_retry_still_stores_nothing_twice(post_events, creds):
    from datetime import timedelta

    from django.utils import timezone

    from feedback.services import DELIVERY_KEEP
    from feedback.tasks import retention_sweep_all

    body = json.dumps({"events": [feedback()]}).encode()
    assert post_events(None, raw=body, headers=sign(creds.webhook_secret, body, msg_id="msg_old")).status_code == 202
    recent = json.dumps({"events": [feedback("fb-2")]}).encode()
    assert post_events(None, raw=recent, headers=sign(creds.webhook_secret, recent, msg_id="msg_recent")).status_code == 202
    WebhookDelivery.objects.filter(webhook_id="msg_old").update(received_at=timezone.now() - DELIVERY_KEEP
                                                                - timedelta(minutes=1))
    assert retention_sweep_all()["deliveries"] == 1
    assert list(WebhookDelivery.objects.values_list("webhook_id", flat=True)) == ["msg_recent"]
    assert retention_sweep_all()["deliveries"] == 0  # the oldest is recent: nothing more to forget
    # The sender retries the old message (a new timestamp, the same id): each event is a duplicate by its own id.
    again = post_events(None, raw=body, headers=sign(creds.webhook_secret, body, msg_id="msg_old"))
    assert [r["status"] for r in again.json()["results"]] == ["duplicate"]
    assert "stored before" in again.json()["results"][0]["reason"]
    assert FeedbackEvent.objects.count() == 2


def test_a_bearer_key_with_ingest_scope_is_accepted(client, creds):
    response = client.post("/api/v1/events", {"events": [feedback()]}, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {creds.api_key}")
    assert response.status_code == 202
    assert FeedbackEvent.objects.count() == 1


def test_extra_fields_are_kept_not_refused(post_events):
    post_events([trajectory(experiment="b"), feedback(client_version="1.2")])
    assert Trajectory.objects.get().extra == {"experiment": "b"}
    assert FeedbackEvent.objects.get().extra == {"client_version": "1.2"}


# --- authentication -------------------------------------------------------------------------------


def test_it_refuses_a_wrong_secret(post_events):
    response = post_events([feedback()], secret="whsec_" + "A" * 32)
    assert response.status_code == 401
    assert "signature" in _error(response)["message"]
    _nothing_stored()


def test_it_refuses_a_tampered_body(post_events, creds):
    body = json.dumps({"events": [feedback()]}).encode()
    headers = sign(creds.webhook_secret, body)
    response = post_events(None, raw=body.replace(b"accept", b"reject"), headers=headers)
    assert response.status_code == 401
    _nothing_stored()


@pytest.mark.parametrize("offset,word", [(-6, "past"), (6, "future")])
def test_it_refuses_a_timestamp_six_minutes_off(post_events, creds, offset, word):
    body = json.dumps({"events": [feedback()]}).encode()
    headers = sign(creds.webhook_secret, body, at=datetime.now(tz=UTC) + timedelta(minutes=offset))
    response = post_events(None, raw=body, headers=headers)
    assert response.status_code == 401
    assert word in _error(response)["message"]
    _nothing_stored()


def test_it_refuses_missing_signature_headers(post_events, creds):
    body = json.dumps({"events": [feedback()]}).encode()
    headers = sign(creds.webhook_secret, body)
    del headers["webhook-timestamp"]
    response = post_events(None, raw=body, headers=headers)
    assert response.status_code == 401
    assert "webhook-timestamp" in _error(response)["message"]


def test_it_refuses_an_unsigned_request_without_a_key(client):
    response = client.post("/api/v1/events", {"events": [feedback()]}, content_type="application/json")
    assert response.status_code == 401
    assert "Bearer" in _error(response)["fix"]


def test_it_refuses_a_revoked_key(client, creds):
    from feedback.services import api_key_revoke

    api_key_revoke(creds.api_key[:11])
    response = client.post("/api/v1/events", {"events": [feedback()]}, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {creds.api_key}")
    assert response.status_code == 401
    assert "revoked" in _error(response)["message"]
    _nothing_stored()


def test_it_refuses_a_key_without_ingest_scope(client, creds):
    from feedback.services import api_key_create

    read_only = api_key_create(creds.project, ["read"])
    response = client.post("/api/v1/events", {"events": [feedback()]}, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {read_only}")
    assert response.status_code == 403
    assert "ingest" in _error(response)["message"]
    _nothing_stored()


def test_both_secrets_verify_during_rotation_and_the_old_one_ends(post_events, creds):
    from django.utils import timezone

    from feedback.models import WebhookSecret
    from feedback.services import webhook_secret_rotate

    new = webhook_secret_rotate(creds.project)
    assert post_events([feedback("fb-old")], secret=creds.webhook_secret).status_code == 202
    assert post_events([feedback("fb-new")], secret=new.secret).status_code == 202
    WebhookSecret.objects.filter(project=creds.project).exclude(pk=new.pk).update(expires_at=timezone.now())
    assert post_events([feedback("fb-late")], secret=creds.webhook_secret).status_code == 401


def test_a_signed_request_is_verified_with_one_query_that_also_brings_the_data_policy(creds, django_assert_num_queries):
    from feedback.auth import webhook_principal
    from feedback.services import data_policy_of, webhook_secret_rotate

    new = webhook_secret_rotate(creds.project)  # two active secrets: both come with the project
    body = json.dumps({"events": [feedback("fb-1")]})
    for secret in (creds.webhook_secret, new.secret):
        with django_assert_num_queries(1):
            principal = webhook_principal(creds.project.slug, body, sign(secret, body))
            assert principal.project == creds.project and data_policy_of(principal.project).pk is None


# --- the batch --------------------------------------------------------------------------------------


def test_it_refuses_a_body_that_is_not_json(post_events):
    response = post_events(None, raw=b"{not json")
    assert response.status_code == 400
    assert "JSON" in _error(response)["message"]


@pytest.mark.parametrize("payload", [{"events": {"a": 1}}, {"events": "x"}, {"evts": []}, [1, 2]])
def test_it_refuses_a_body_that_is_not_a_batch(post_events, payload):
    response = post_events(None, raw=json.dumps(payload).encode())
    assert response.status_code == 400
    assert "events" in _error(response)["fix"]


def test_it_refuses_1001_events(post_events):
    response = post_events([feedback(f"fb-{i}") for i in range(1001)])
    assert response.status_code == 413
    assert "1000" in _error(response)["message"]
    _nothing_stored()


def test_it_refuses_a_6_mib_body(post_events):
    big = [trajectory(f"t-{i}", steps=[{"role": "assistant", "content": "x" * 60_000}]) for i in range(105)]
    response = post_events(big)
    assert response.status_code == 413
    assert "5 MiB" in _error(response)["message"] or "bytes" in _error(response)["message"]
    _nothing_stored()


def test_it_answers_429_over_the_project_rate_and_stores_nothing(post_events, creds, one_rate_window):
    creds.project.rate_limit_per_minute = 3
    creds.project.save()
    assert post_events([feedback("a"), feedback("b")]).status_code == 202
    response = post_events([feedback("c"), feedback("d")])
    assert response.status_code == 429
    assert int(response["Retry-After"]) >= 1
    assert FeedbackEvent.objects.count() == 2


def test_batches_far_from_the_rate_wait_on_no_redis_round_trip(post_events, creds, settings, one_rate_window,
                                                                monkeypatch):
    import redis

    from core.cache import shared_cache
    from feedback import ratelimit

    probe = redis.Redis.from_url(settings.CACHES["default"]["LOCATION"])

    def counted() -> int:
        stats = probe.info("commandstats")
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("eval", "incrby"))

    try:
        assert post_events([feedback("first")]).status_code == 202  # the counter is new here: Redis counts it
        settle = ratelimit.RATES.settle
        monkeypatch.setattr(ratelimit.RATES, "settle", lambda: None)  # the background settle held: requests only
        before = counted()
        assert [post_events([feedback(f"f-{i}"), feedback(f"g-{i}")]).status_code for i in range(5)] == [202] * 5
        assert counted() == before  # was a round trip a batch
        settle()  # the ten reach the shared counter within a settle
        assert shared_cache().get(ratelimit._bucket(f"ingest:{creds.project.id}")) == 11
    finally:
        probe.close()


# --- one bad event among good ones -----------------------------------------------------------------


BAD_EVENTS = {
    "no id": ({"type": "feedback", "trajectory_id": "t", "signal": "accept"}, "'id' is missing"),
    "unknown type": ({"type": "thumbs", "id": "x"}, "unknown type"),
    "unknown signal": (feedback("x", signal="meh"), "unknown signal"),
    "mismatched lengths": (
        trajectory("x", steps=[{"role": "assistant", "content": "a", "token_ids": [1, 2], "logprobs": [-1.0]}]),
        "2 token_ids but 1 logprobs",
    ),
    "NaN value": (feedback("x", value=float("nan")), "finite"),
    "inf logprob": (
        trajectory("x", steps=[{"role": "assistant", "content": "a", "token_ids": [1], "logprobs": [float("-inf")]}]),
        "finite",
    ),
    "10,000-char id": (feedback("x" * 10_000), "at most 255"),
    "10,000-char trajectory id": (feedback("x", trajectory_id="t" * 10_000), "at most 255"),
    "not an object": ("just a string", "JSON object"),
    "bad timestamp": (feedback("x", occurred_at="yesterday"), "ISO 8601"),
    "NUL in content": (trajectory("x", steps=[{"role": "assistant", "content": "a\x00b"}]), "NUL"),
    "negative token id": (trajectory("x", steps=[{"role": "assistant", "content": "a", "token_ids": [-1]}]), "token_ids"),
}


@pytest.mark.parametrize("name", list(BAD_EVENTS))
def test_a_bad_event_is_rejected_alone_with_a_reason(post_events, name):
    bad, reason = BAD_EVENTS[name]
    raw = json.dumps({"events": [feedback("good"), bad]}).encode()  # NaN/Infinity are written as JSON literals
    body = post_events(None, raw=raw).json()
    assert body["results"][0]["status"] == "accepted"
    assert body["results"][1]["status"] == "rejected"
    assert reason in body["results"][1]["reason"], body["results"][1]["reason"]
    assert FeedbackEvent.objects.count() == 1 and Trajectory.objects.count() == 0


def test_feedback_naming_another_projects_trajectory_is_answered_like_an_unknown_one(post_events, other_creds):
    post_events([trajectory("theirs")], secret=other_creds.webhook_secret, project=other_creds.project.slug)
    theirs = post_events([feedback("fb-x", trajectory_id="theirs")]).json()
    nobodys = post_events([feedback("fb-y", trajectory_id="nobody-has-this")]).json()
    strip = [{k: v for k, v in r.items() if k != "id"} for r in theirs["results"] + nobodys["results"]]
    assert strip[0] == strip[1] and theirs["accepted"] == nobodys["accepted"] == 1
    # Stored in this project, never linked to the other project's trajectory.
    stored = FeedbackEvent.objects.get(event_id="fb-x")
    assert stored.project.slug == "acme" and stored.trajectory is None


def test_the_same_ids_in_two_projects_are_two_rows(post_events, other_creds):
    post_events([trajectory("t"), feedback("f", trajectory_id="t")])
    post_events([trajectory("t"), feedback("f", trajectory_id="t")], secret=other_creds.webhook_secret,
                project=other_creds.project.slug)
    assert Trajectory.objects.count() == 2 and FeedbackEvent.objects.count() == 2
    assert all(f.trajectory.project_id == f.project_id for f in FeedbackEvent.objects.all())


def test_feedback_still_lands_when_redis_is_down(post_events, settings):
    from tests.processes import free_port

    # A real connection to a port nobody listens on: the rate counter is unreachable.
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                                   "LOCATION": f"redis://127.0.0.1:{free_port()}/0"}}
    response = post_events([feedback()])
    assert response.status_code == 202 and response.json()["accepted"] == 1
    assert FeedbackEvent.objects.count() == 1
