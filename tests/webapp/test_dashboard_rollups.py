"""Rollups: counts equal the raw rows, a refresh is idempotent, late rows are picked up."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db.models import Sum

from feedback.models import FeedbackEvent, Trajectory
from tests.factories import feedback, trajectory
from webapp.models import AgreementRollup, FeedbackHourly, RubricRollup, TrajectoryHourly
from webapp.rollups import rollups_rebuild, rollups_refresh

pytestmark = pytest.mark.django_db


def _table() -> list[tuple]:
    return sorted(FeedbackHourly.objects.values_list("project_id", "policy_version", "hour", "signal", "n"))


def test_seed_load_fills_the_rollups_to_match_raw_rows(creds):
    call_command("seed_load", events=500, trajectories=60, project=creds.project.slug, run_steps=10, stdout=None)
    assert FeedbackHourly.objects.aggregate(n=Sum("n"))["n"] == FeedbackEvent.objects.count() == 500
    assert TrajectoryHourly.objects.aggregate(n=Sum("trajectories"))["n"] == Trajectory.objects.count() == 60
    assert RubricRollup.objects.filter(tag="", source="judge").aggregate(n=Sum("n"))["n"] > 0
    assert AgreementRollup.objects.filter(tag="").aggregate(n=Sum("pairs"))["n"] > 0


def test_a_refresh_is_idempotent(creds):
    call_command("seed_load", events=300, trajectories=40, project=creds.project.slug, run_steps=10, stdout=None)
    before = _table()
    rollups_refresh()
    rollups_refresh()
    assert _table() == before
    rollups_rebuild()
    assert _table() == before


def test_new_feedback_and_a_late_trajectory_are_picked_up(creds, post_events):
    post_events([feedback("fb-early", "t-late", signal="accept")])
    rollups_refresh()
    assert FeedbackHourly.objects.get(signal="accept").policy_version is None
    post_events([trajectory("t-late", policy_version=3), feedback("fb-2", "t-late", signal="reject")])
    rollups_refresh()
    rows = {(r.policy_version, r.signal): r.n for r in FeedbackHourly.objects.all()}
    assert rows == {(3, "accept"): 1, (3, "reject"): 1}
    assert TrajectoryHourly.objects.get().trajectories == 1


def test_the_celery_task_runs_the_refresh(creds, post_events):
    from webapp.tasks import rollups_refresh as task

    post_events([trajectory("t-1"), feedback("fb-1", "t-1")])
    assert task.apply().get()["feedback_hours"] == 1
    assert FeedbackHourly.objects.get().n == 1


def test_a_project_whose_labels_overflow_is_quarantined_and_the_other_projects_refresh(
    creds, other_creds, post_events, client, alice
):
    from feedback.models import Quarantine

    post_events([trajectory("t-1"), feedback("fb-1", "t-1", aspect_labels={"style": 0.5})])
    post_events([trajectory("t-1"), feedback("fb-1", "t-1", aspect_labels={"style": 0.5})],
                secret=other_creds.webhook_secret, project=other_creds.project.slug)
    # A label stored before ingest checked the scale: its rubric bin (score * 10) overflows.
    FeedbackEvent.objects.filter(project=creds.project).update(aspect_labels={"style": 1e308})

    assert rollups_refresh()["projects_failed"] == 1
    assert FeedbackHourly.objects.get(project=other_creds.project).n == 1
    assert RubricRollup.objects.filter(project=other_creds.project, source="human").exists()
    assert not FeedbackHourly.objects.filter(project=creds.project).exists()
    quarantined = Quarantine.objects.get()
    assert (quarantined.project, quarantined.kind) == (creds.project, "rollup")
    assert "out of range" in quarantined.error and quarantined.detail["feedback_hours"]

    client.force_login(alice)
    page = client.get(f"/p/{creds.project.slug}/").content.decode()
    assert 'data-quarantine="rollup"' in page and "out of range" in page


def test_a_rebuild_after_a_bulk_load_plans_on_the_loaded_tables_statistics(creds):
    from django.db import connection

    def estimated(table: str) -> float:
        with connection.cursor() as cur:
            cur.execute("SELECT reltuples FROM pg_class WHERE relname = %s", [table])
            return cur.fetchone()[0]

    call_command("seed_load", events=3000, trajectories=500, project=creds.project.slug, run_steps=10, stdout=None)
    # seed_load rebuilds right after its inserts, before autovacuum could have seen them; the
    # rebuild analysed the tables it reads (the load's own rows count, though not yet committed)
    assert estimated("feedback_trajectory") >= 500 and estimated("feedback_feedbackevent") >= 3000
