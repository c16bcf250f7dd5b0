"""feedback_ingest's batch write (one JSON parameter per table): exactly once, all or nothing,
values stored as sent."""

from __future__ import annotations

import pytest
from django.db import OperationalError

from feedback.models import FeedbackEvent, Project, Step, Trajectory
from feedback.services import feedback_ingest
from tests.factories import feedback, trajectory

pytestmark = pytest.mark.django_db


def _batch(prefix: str, n: int) -> list[dict]:
    return [e for i in range(n) for e in (trajectory(f"{prefix}-t{i}"), feedback(f"{prefix}-f{i}", f"{prefix}-t{i}"))]


def _stored() -> tuple[int, int, int]:
    return Trajectory.objects.count(), Step.objects.count(), FeedbackEvent.objects.count()


def test_a_replayed_batch_is_answered_duplicate_and_stores_nothing_twice(creds):
    project = Project.objects.get(pk=creds.project.pk)
    first = feedback_ingest(project, _batch("a", 5))
    mixed = feedback_ingest(project, _batch("a", 5)[4:] + _batch("b", 2))
    assert {r.status for r in first} == {"accepted"}
    assert [r.status for r in mixed] == ["duplicate"] * 6 + ["accepted"] * 4
    assert all(r.reason == "an event with this id was stored before" for r in mixed[:6])
    assert _stored() == (7, 7, 7)  # a replayed trajectory gets no second set of steps
    assert FeedbackEvent.objects.filter(trajectory__isnull=True).count() == 0


def test_a_crash_mid_batch_stores_nothing_and_the_retry_stores_everything_once(creds, monkeypatch):
    import feedback.services as services

    def crash(*args, **kwargs):  # the connection dies after the trajectories' statement ran
        raise OperationalError("server closed the connection unexpectedly")

    project = Project.objects.get(pk=creds.project.pk)
    monkeypatch.setattr(services, "_insert_feedback", crash)
    with pytest.raises(OperationalError):
        feedback_ingest(project, _batch("c", 4))
    assert _stored() == (0, 0, 0)  # the trajectories inserted before the crash were rolled back
    monkeypatch.undo()
    retried = feedback_ingest(project, _batch("c", 4))
    assert {r.status for r in retried} == {"accepted"} and _stored() == (4, 4, 4)


def test_values_are_stored_as_sent_and_absent_ones_as_sql_null(creds):
    project = Project.objects.get(pk=creds.project.pk)
    step = {"role": "assistant", "content": "é \\ \" ' \n", "token_ids": [0, 4194303], "logprobs": [-0.0, -1e4],
            "reward": 0.125, "note": {"k": [1, None]}}
    feedback_ingest(project, [trajectory("t-1", steps=[step, {"role": "tool", "content": ""}], tags=["x"],
                                         policy_version=None),
                              feedback("f-1", "t-1", value=3, aspect_labels={"style": 0.5}), feedback("f-2", "t-1")])
    first, second = Step.objects.order_by("index")
    assert (first.content, first.token_ids, first.logprobs, first.reward, first.extra) == (
        "é \\ \" ' \n", [0, 4194303], [-0.0, -1e4], 0.125, {"note": {"k": [1, None]}})
    assert Step.objects.filter(pk=second.pk, token_ids__isnull=True, logprobs__isnull=True, routing__isnull=True,
                               tool_calls__isnull=True, reward__isnull=True).exists()
    t = Trajectory.objects.get()
    assert (t.tags, t.policy_version, t.prompt[0]["content"]) == (["x"], None, "def add(a, b):")
    assert FeedbackEvent.objects.get(event_id="f-1").aspect_labels == {"style": 0.5}
    assert FeedbackEvent.objects.filter(event_id="f-2", aspect_labels__isnull=True, value__isnull=True).exists()


@pytest.mark.django_db(transaction=True)
def test_a_row_the_database_refuses_costs_only_its_event_and_the_delivery_is_recorded_once(creds, monkeypatch, caplog):
    """parse_event leaves nothing for the database to refuse; should it refuse a row all the same,
    the batch is rolled back whole and stored again event by event: the others land, that event is
    rejected with the database's reason, and the webhook-id is recorded once."""
    from django.db import DataError

    import feedback.services as services
    from feedback.models import WebhookDelivery

    real = services._insert_trajectories

    def refuse(project, trajectories, now):
        if any(t.external_id == "r-t1" for t in trajectories):
            real(project, trajectories, now)  # the batch's statement ran, then the database refused
            raise DataError("value out of range for the planted row")
        return real(project, trajectories, now)

    monkeypatch.setattr(services, "_insert_trajectories", refuse)
    project = Project.objects.get(pk=creds.project.pk)
    with caplog.at_level("ERROR", logger="feedback.services"):
        results = feedback_ingest(project, _batch("r", 3), webhook_id="msg_refused_once")
    assert [(r.id, r.status) for r in results] == [
        ("r-t0", "accepted"), ("r-f0", "accepted"), ("r-t1", "rejected"), ("r-f1", "accepted"),
        ("r-t2", "accepted"), ("r-f2", "accepted")]
    assert "the database refused this event (value out of range for the planted row)" in results[2].reason
    assert sorted(Trajectory.objects.values_list("external_id", flat=True)) == ["r-t0", "r-t2"]
    assert Step.objects.count() == 2 and FeedbackEvent.objects.count() == 3  # r-f1 kept, waits for its trajectory
    assert WebhookDelivery.objects.filter(webhook_id="msg_refused_once").count() == 1
    assert "event by event" in caplog.text
