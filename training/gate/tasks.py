"""Celery tasks of the gate (queue `gate`).

Task names are a wire contract (beat rows and queued messages carry them), so they keep the
`training.tasks.gate_*` names the routes in settings.CELERY_TASK_ROUTES match. Workers discover
this module through training/tasks.py.
"""

from __future__ import annotations

from celery import shared_task

from core.tasks import enqueue_after_commit
from training.gate.services import gate_run

GATE_RUN = "training.tasks.gate_run"


@shared_task(name=GATE_RUN, acks_late=True)
def gate_run_task(version_id: int, actor: str = "system:gate", suite: str = "default") -> dict:
    """Evaluate a candidate; returns {"report": id, "passed": bool}. Not retried: a failed gate
    puts the version back to `candidate` (audited) so it can be gated again on purpose."""
    report = gate_run(version_id, actor=actor, suite=suite)
    return {"report": report.id, "passed": report.passed}


def gate_run_enqueue(version_id: int, actor: str = "system:gate") -> None:
    """Enqueue the gate after the current transaction commits (the version row must be visible)."""
    enqueue_after_commit(GATE_RUN, version_id, actor)
