"""A real Celery worker process runs the project's tasks against the test database."""

from __future__ import annotations

import pytest

from feedback.models import FeedbackEvent, Trajectory
from feedback.services import feedback_ingest
from feedback.tasks import feedback_link_orphans_all
from tests.factories import feedback, trajectory

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_worker_links_orphaned_feedback(celery_worker_process, creds):
    feedback_ingest(creds.project, [feedback("fb-1", "t-1")])
    # A trajectory written behind the ingest path's back (as a restore from backup would).
    feedback_ingest(creds.project, [trajectory("t-1")])
    FeedbackEvent.objects.update(trajectory=None)
    assert feedback_link_orphans_all.delay().get(timeout=60) == 1
    assert FeedbackEvent.objects.get().trajectory == Trajectory.objects.get()
