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
