"""Celery tasks of promotion (queue `gate`; names are a wire contract, see training/gate/tasks.py)."""

from __future__ import annotations

from celery import shared_task

from training.promotion.services import canaries_decide_all


@shared_task(name="training.tasks.gate_canaries_check")
def gate_canaries_check_task() -> dict[int, str]:
    """Periodic (django-celery-beat): apply the stopping rule to every running canary."""
    return canaries_decide_all()
