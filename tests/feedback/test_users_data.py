"""Users' data through the API and beat: the data policy, the opt-out list, the subject access
export (JSON Lines) and retention in bounded batches.

    .venv/bin/python -m pytest tests/feedback/test_users_data.py -q
"""

from __future__ import annotations

import json
from datetime import timedelta

from django.utils import timezone

from feedback.models import ConsentOptOut, FeedbackEvent, Step, Trajectory
from feedback.services import api_key_create, feedback_ingest, user_hash_of
from feedback.userdata.services import data_policy_set, retention_sweep
from tests.factories import feedback, member, trajectory


def admin_key(creds, alice) -> dict[str, str]:
    key = api_key_create(creds.project, ["admin"], name="privacy", owner=member(alice, creds.project, "admin"))
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def test_the_opt_out_list_is_set_through_the_api_by_an_admin_only(creds, alice, bob, client):
    body = {"user": "u-42", "opted_out": True}
    denied = client.post("/api/v1/consent/opt-outs", body, content_type="application/json",
                         HTTP_AUTHORIZATION=f"Bearer {creds.api_key}")
    assert denied.status_code == 403 and "admin" in denied.json()["error"]["fix"]
    client.force_login(member(bob, creds.project, "viewer"))
    viewer = client.post(f"/api/v1/consent/opt-outs?project={creds.project.slug}", body,
                         content_type="application/json")
    assert viewer.status_code == 403 and not ConsentOptOut.objects.exists()
    ok = client.post("/api/v1/consent/opt-outs", body, content_type="application/json", **admin_key(creds, alice))
    assert ok.json() == {"opted_out": True, "was_opted_out": False}
    assert ConsentOptOut.objects.get().user_hash == user_hash_of(creds.project, "u-42")
    back = client.post("/api/v1/consent/opt-outs", {"user": "u-42", "opted_out": False},
                       content_type="application/json", **admin_key(creds, alice))
    assert back.json() == {"opted_out": False, "was_opted_out": True} and not ConsentOptOut.objects.exists()
    empty = client.post("/api/v1/consent/opt-outs", {}, content_type="application/json", **admin_key(creds, alice))
    assert empty.status_code == 400


def test_the_data_policy_is_validated_before_anything_is_saved(creds, alice, client):
    headers = admin_key(creds, alice)
    bad = client.patch("/api/v1/data-policy", {"retention_days": 30, "custom_patterns": [
        {"name": "ticket", "pattern": "(a+)+b"}]}, content_type="application/json", **headers)
    assert bad.status_code == 400 and "Write a sequence" in bad.json()["error"]["fix"]
    assert client.get("/api/v1/data-policy", **headers).json()["retention_days"] is None
    ok = client.patch("/api/v1/data-policy", {"retention_days": 30, "consent_default": "no_train",
                                              "redactors": ["email"], "erasure_policy": "retrain"},
                      content_type="application/json", **headers)
    assert ok.status_code == 200 and ok.json()["erasure_policy"] == "retrain"
    shown = client.get("/api/v1/data-policy", **headers).json()
    assert (shown["retention_days"], shown["consent_default"], shown["redactors"]) == (30, "no_train", ["email"])


def test_a_subject_access_export_holds_the_users_trajectories_and_feedback_on_anyones(creds, alice, client):
    feedback_ingest(creds.project, [
        trajectory("t-1", user="u-7", prompt="mine"), trajectory("t-2", user="u-8", prompt="theirs"),
        feedback("fb-1", "t-1", user="u-7"), feedback("fb-2", "t-2", user="u-7", signal="reject"),
        feedback("fb-3", "t-2", user="u-8"),
    ])
    answer = client.get("/api/v1/users/u-7/export", **admin_key(creds, alice))
    assert answer.status_code == 200 and answer["Content-Type"] == "application/jsonl"
    rows = [json.loads(line) for line in b"".join(answer.streaming_content).decode().splitlines()]
    assert [(r["type"], r.get("id")) for r in rows] == [("user", None), ("trajectory", "t-1"), ("feedback", "fb-1"),
                                                         ("feedback", "fb-2")]
    assert rows[1]["prompt"] == [{"role": "user", "content": "mine"}] and rows[1]["steps"][0]["token_ids"]
    assert client.get("/api/v1/users/u-7/export", HTTP_AUTHORIZATION=f"Bearer {creds.api_key}").status_code == 403


def test_retention_deletes_old_raw_events_in_bounded_batches_and_keeps_new_ones(creds):
    feedback_ingest(creds.project, [trajectory(f"t-{i}") for i in range(5)]
                    + [feedback(f"fb-{i}", f"t-{i}") for i in range(5)])
    old = timezone.now() - timedelta(days=40)
    Trajectory.objects.filter(external_id__in=["t-0", "t-1", "t-2"]).update(received_at=old)
    FeedbackEvent.objects.filter(event_id__in=["fb-0", "fb-1"]).update(received_at=old)
    assert retention_sweep(creds.project) == {"feedback": 0, "trajectories": 0}  # no retention set: kept
    data_policy_set(creds.project, retention_days=30)
    first = retention_sweep(creds.project, batch=2, max_batches=1)
    assert first == {"feedback": 2, "trajectories": 0}  # one bounded statement a call
    rest = retention_sweep(creds.project, batch=2, max_batches=10)
    assert rest == {"feedback": 0, "trajectories": 3}
    assert sorted(Trajectory.objects.values_list("external_id", flat=True)) == ["t-3", "t-4"]
    assert Step.objects.count() == 2 and FeedbackEvent.objects.count() == 2
