"""The beat schedule of the training loop (django-celery-beat rows, editable in the admin)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from django_celery_beat.models import IntervalSchedule, PeriodicTask

from feedback.models import Project
from training.runs.services import run_settings_check
from training.runs.settings import Schedule

# Beat entries shared by every project: (name, task, seconds between runs).
CANARIES = ("flywheel canaries", "training.tasks.gate_canaries_check")
# The self-healing pipeline: undelivered hand-offs, then stuck work (training/runs/sweep.py).
OUTBOX = ("flywheel outbox", "core.tasks.outbox_deliver")
SWEEPER = ("flywheel sweeper", "training.tasks.pipeline_sweep")
# Raw events past each project's retention (feedback/userdata/services.py retention_sweep).
RETENTION = ("flywheel retention", "feedback.tasks.retention_sweep_all")
TRAIN_CHECK_EVERY_S = 60


def training_schedule_install(
    projects: Iterable[Project] | None = None, schedule: Schedule | None = None, *, rewards_every_s: int = 30,
    train_check_every_s: int = TRAIN_CHECK_EVERY_S, outbox_every_s: int = 10, sweep_every_s: int = 60,
) -> list[PeriodicTask]:
    """Creates or updates the beat entries (django-celery-beat, editable in the admin) per project:
    rewards every `rewards_every_s`, the train check every `train_check_every_s` with `schedule`
    (when a run starts and the settings of every run it starts; the defaults when None) stored in
    the entry's kwargs. Idempotent."""
    train_kwargs = (schedule or Schedule()).to_dict()
    out = []
    for project in projects if projects is not None else Project.objects.all():
        out.append(_entry(f"flywheel rewards {project.slug}", "training.tasks.rewards_compute_pending",
                          rewards_every_s, [project.pk], {}))
        out.append(_entry(f"flywheel train {project.slug}", "training.tasks.train_maybe",
                          train_check_every_s, [project.pk], train_kwargs))
    for (name, task), seconds in ((CANARIES, 60), (OUTBOX, outbox_every_s), (SWEEPER, sweep_every_s), (RETENTION, 3600)):
        out.append(_entry(name, task, seconds, [], {}))
    return out


def _entry(name: str, task: str, seconds: int, args: list[Any], kwargs: dict[str, Any]) -> PeriodicTask:
    interval = IntervalSchedule.objects.get_or_create(every=seconds, period=IntervalSchedule.SECONDS)[0]
    entry, _ = PeriodicTask.objects.update_or_create(
        name=name, defaults={"task": task, "interval": interval, "args": json.dumps(args),
                             "kwargs": json.dumps(kwargs), "enabled": True},
    )
    return entry


def training_config_set(project: Project, data: Mapping[str, Any]) -> Schedule:
    """The project's training config (when its runs start, what each is asked to do: a Schedule's
    flat JSON, the adapter included) validated in full, then installed as its train beat entry.
    SettingsInvalid (400) lists every problem with its fix; a LoRA's targets are checked against
    the project's policy (`training.runs.services.run_settings_check`)."""
    schedule = Schedule.from_dict(data)
    run_settings_check(project, schedule.run)
    _entry(f"flywheel train {project.slug}", "training.tasks.train_maybe", TRAIN_CHECK_EVERY_S, [project.pk],
           schedule.to_dict())
    return schedule


def training_config_get(project: Project) -> Schedule:
    """The project's training config as its train beat entry holds it (the defaults without one)."""
    entry = PeriodicTask.objects.filter(name=f"flywheel train {project.slug}").first()
    return Schedule.from_dict(json.loads(entry.kwargs)) if entry is not None else Schedule()
