"""Celery tasks of the feedback app (queue `ingest`)."""

from __future__ import annotations

from celery import shared_task

from feedback.models import Project
from feedback.services import feedback_link_orphans


@shared_task(name="feedback.tasks.feedback_link_orphans_all")
def feedback_link_orphans_all() -> int:
    """Safety net for feedback whose trajectory landed later (the ingest path links it at once)."""
    return sum(feedback_link_orphans(project) for project in Project.objects.all())
