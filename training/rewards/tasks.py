"""Celery tasks of rewards (queue `rewards`; names are a wire contract, see training/tasks.py)."""

from __future__ import annotations

from celery import shared_task

from feedback.models import Project
from training.rewards import services


@shared_task(name="training.tasks.rewards_compute_pending")
def rewards_compute_pending(project_id: int) -> int:
    """Beat's reward task (every 30 s a project): passes until the queue is empty or 20 s passed."""
    return services.rewards_drain(Project.objects.get(pk=project_id))
