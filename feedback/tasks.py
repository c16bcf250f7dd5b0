"""Celery tasks of the feedback app (queue `ingest`)."""

from __future__ import annotations

from celery import shared_task

from feedback.models import Project
from feedback.services import feedback_link_orphans, webhook_deliveries_prune
from feedback.userdata.services import retention_sweep


@shared_task(name="feedback.tasks.feedback_link_orphans_all")
def feedback_link_orphans_all() -> int:
    """Safety net for feedback whose trajectory landed later (the ingest path links it at once)."""
    return sum(feedback_link_orphans(project) for project in Project.objects.all())


@shared_task(name="feedback.tasks.retention_sweep_all")
def retention_sweep_all() -> dict[str, int]:
    """Deletes raw events past each project's retention, and webhook-ids past DELIVERY_KEEP, in
    bounded batches (the next tick goes on)."""
    totals = {"feedback": 0, "trajectories": 0}
    for project in Project.objects.filter(data_policy__retention_days__isnull=False):
        for key, n in retention_sweep(project).items():
            totals[key] += n
    totals["deliveries"] = webhook_deliveries_prune()
    return totals
