"""Celery tasks of the gate (queue `gate`: names start with `training.tasks.gate_`).

Discovered through training/tasks.py, which imports this module (`import training.gate.tasks`).
"""

from __future__ import annotations

from celery import shared_task


@shared_task(name="training.tasks.gate_run", acks_late=True)
def gate_run_task(version_id: int, actor: str = "system:gate", suite: str = "default") -> dict:
    """Evaluate a candidate; returns {"report": id, "passed": bool}. Not retried: a failed gate
    puts the version back to `candidate` (audited) so it can be gated again on purpose."""
    from training.promotion import gate_run

    report = gate_run(version_id, actor=actor, suite=suite)
    return {"report": report.id, "passed": report.passed}


@shared_task(name="training.tasks.gate_canaries_check")
def gate_canaries_check_task() -> dict[int, str]:
    """Periodic (django-celery-beat): apply the stopping rule to every running canary."""
    from training.promotion import canaries_decide_all

    return canaries_decide_all()


def gate_run_enqueue(version_id: int, actor: str = "system:gate") -> None:
    """Enqueue the gate after the current transaction commits (the version row must be visible)."""
    from django.db import transaction

    transaction.on_commit(lambda: gate_run_task.delay(version_id, actor))
