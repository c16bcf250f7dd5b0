"""Reads of training runs and their steps."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Max, QuerySet

from feedback.models import Project
from training.models import TrainingRun, TrainingStep

ACTIVE_RUN_STATES = ("queued", "running")


def training_run_list(project: Project) -> QuerySet[TrainingRun]:
    return TrainingRun.objects.filter(project=project).select_related("base_version", "candidate").order_by(
        "-created_at"
    )


def training_run_active(project: Project) -> TrainingRun | None:
    return TrainingRun.objects.filter(project=project, state__in=ACTIVE_RUN_STATES).order_by("created_at").first()


def training_run_last(project: Project, states: tuple[str, ...] = ("succeeded",)) -> TrainingRun | None:
    return TrainingRun.objects.filter(project=project, state__in=states).order_by("-created_at").first()


def training_step_list(run: TrainingRun) -> QuerySet[TrainingStep]:
    return TrainingStep.objects.filter(run=run).order_by("step")


def training_run_heartbeat(run: TrainingRun) -> datetime:
    """The newest sign of life of a run: its last step row, else its start (or creation)."""
    last_step = TrainingStep.objects.filter(run=run).aggregate(at=Max("created_at"))["at"]
    return last_step or run.started_at or run.created_at
