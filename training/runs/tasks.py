"""Celery tasks of training runs (queues `train` and `rollouts`; names are a wire contract, see
training/tasks.py). They take ids, load, call one service."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.conf import settings

from core.workers import WorkerRef
from feedback.models import Project
from training.runs import rollouts, services, sweep
from training.runs.settings import RunSettings, Schedule


@shared_task(name="training.tasks.train_policy", bind=True, time_limit=settings.FLYWHEEL_TRAIN_TIME_LIMIT_S,
             soft_time_limit=max(settings.FLYWHEEL_TRAIN_TIME_LIMIT_S - 60, 1))
def train_policy_task(self: Any, run_id: int) -> str:
    worker = WorkerRef.here("celery", node=self.request.hostname or "", task_id=self.request.id or "")
    return services.train_policy(run_id, worker).state


@shared_task(name="training.tasks.train_maybe")
def train_maybe(project_id: int, **schedule: Any) -> int | None:
    """Beat: `schedule` is the train entry's kwargs, `Schedule.to_dict()` (flat: min_new,
    every_minutes and the run settings; training/schedule.py writes them)."""
    run = services.train_maybe(Project.objects.get(pk=project_id), Schedule.from_dict(schedule))
    return run.pk if run is not None else None


@shared_task(name="training.tasks.rollout_and_train", time_limit=settings.FLYWHEEL_TRAIN_TIME_LIMIT_S,
             soft_time_limit=max(settings.FLYWHEEL_TRAIN_TIME_LIMIT_S - 60, 1))
def rollout_and_train_task(project_id: int, prompts: list[Any], G: int = 16, steps: int = 1,
                           max_tokens: int = 24, seed: int = 0) -> int:
    """Rollouts here (queue rollouts); the training itself is queued for the train workers."""
    run, _ = rollouts.rollout_and_train(Project.objects.get(pk=project_id), prompts, G, settings=RunSettings(steps=steps),
                                        max_tokens=max_tokens, seed=seed, inline=False)
    return run.pk


@shared_task(name=sweep.PIPELINE_SWEEP, ignore_result=True)
def pipeline_sweep_task() -> dict[str, int]:
    """Beat: requeue or fail work stuck in an intermediate state (training/runs/sweep.py)."""
    return sweep.pipeline_sweep().counts()
