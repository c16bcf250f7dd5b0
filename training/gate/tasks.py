"""Celery tasks of the gate (queue `gate`).

Task names are a wire contract (beat rows and queued messages carry them), so they keep the
`training.tasks.gate_*` names the routes in settings.CELERY_TASK_ROUTES match. Workers discover
this module through training/tasks.py.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.conf import settings

from core.errors import Conflict
from core.tasks import enqueue_after_commit
from core.workers import WorkerRef
from training.gate.services import gate_run

GATE_RUN = "training.tasks.gate_run"


@shared_task(name=GATE_RUN, bind=True, acks_late=True, time_limit=settings.FLYWHEEL_GATE_TIME_LIMIT_S,
             soft_time_limit=max(settings.FLYWHEEL_GATE_TIME_LIMIT_S - 60, 1))
def gate_run_task(self: Any, version_id: int, actor: str = "system:gate", suite: str = "default") -> dict:
    """Evaluate a candidate; returns {"report": id, "passed": bool}. Not retried: a failed gate
    puts the version back to `candidate` (audited) so it can be gated again on purpose. A second
    delivery of the same message (a worker lost, the sweeper's requeue) finds the version taken
    and leaves it."""
    worker = WorkerRef.here("celery", node=self.request.hostname or "", task_id=self.request.id or "")
    try:
        report = gate_run(version_id, actor=actor, suite=suite, worker=worker)
    except Conflict as exc:
        return {"skipped": exc.message}
    return {"report": report.id, "passed": report.passed}


def gate_run_enqueue(version_id: int, actor: str = "system:gate") -> None:
    """Enqueue the gate after the current transaction commits (the version row must be visible)."""
    enqueue_after_commit(GATE_RUN, version_id, actor)
