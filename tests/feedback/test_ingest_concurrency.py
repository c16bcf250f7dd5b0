"""Concurrent deliveries on real PostgreSQL: exactly once, linked in any order, 503 on a stuck write."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, connections

from feedback.models import FeedbackEvent, Project, Trajectory
from feedback.services import feedback_ingest
from tests.factories import feedback, trajectory

pytestmark = pytest.mark.django_db(transaction=True)


def _run_together(*jobs):
    barrier = threading.Barrier(len(jobs))
    out: list = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i, job):
        try:
            barrier.wait()
            out[i] = job()
        except BaseException as exc:  # noqa: BLE001 - re-raised below in the test thread
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def test_concurrent_duplicate_deliveries_store_each_event_once(creds):
    events = [trajectory(f"t-{i}") for i in range(50)] + [feedback(f"f-{i}", f"t-{i}") for i in range(50)]
    project = Project.objects.get(pk=creds.project.pk)
    results = _run_together(*[lambda: feedback_ingest(project, events) for _ in range(4)])
    assert Trajectory.objects.count() == 50 and FeedbackEvent.objects.count() == 50
    for index in range(len(events)):
        statuses = sorted(r[index].status for r in results)
        assert statuses == ["accepted", "duplicate", "duplicate", "duplicate"], (index, statuses)
    assert FeedbackEvent.objects.filter(trajectory__isnull=True).count() == 0


def test_feedback_and_its_trajectory_in_concurrent_requests_are_always_linked(creds):
    project = Project.objects.get(pk=creds.project.pk)
    for round_ in range(15):
        ids = [f"r{round_}-t{i}" for i in range(20)]
        _run_together(
            lambda ids=ids: feedback_ingest(project, [feedback(f"fb-{t}", t) for t in ids]),
            lambda ids=ids: feedback_ingest(project, [trajectory(t) for t in ids]),
        )
    assert FeedbackEvent.objects.count() == 300
    assert FeedbackEvent.objects.filter(trajectory__isnull=True).count() == 0


def test_a_write_stuck_behind_a_lock_answers_503_and_stores_nothing(client, creds, settings):
    from tests.factories import as_django_headers, sign

    settings.INGEST_STATEMENT_TIMEOUT_MS = 300
    import json

    body = json.dumps({"events": [trajectory(), feedback()]}).encode()
    locked, release = threading.Event(), threading.Event()

    def hold_lock():
        with connections["default"].cursor() as cur:
            cur.execute("BEGIN")
            cur.execute("LOCK TABLE feedback_trajectory IN ACCESS EXCLUSIVE MODE")
            locked.set()
            release.wait(30)
            cur.execute("ROLLBACK")
        connections.close_all()

    holder = threading.Thread(target=hold_lock)
    holder.start()
    assert locked.wait(10)
    try:
        headers = {**sign(creds.webhook_secret, body), "flywheel-project": creds.project.slug}
        response = client.generic("POST", "/api/v1/events", body, content_type="application/json",
                                  **as_django_headers(headers))
    finally:
        release.set()
        holder.join(30)
    assert response.status_code == 503, response.content
    assert response["Retry-After"] == "5"
    assert "retry" in response.json()["error"]["fix"].lower()
    connection.close()
    assert Trajectory.objects.count() == 0 and FeedbackEvent.objects.count() == 0
    # The retry with the same webhook-id lands: the failed attempt recorded no delivery.
    retry = client.generic("POST", "/api/v1/events", body, content_type="application/json",
                           **as_django_headers(headers))
    assert retry.status_code == 202 and retry.json()["accepted"] == 2
