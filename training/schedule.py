"""The beat schedule of the training loop (django-celery-beat rows, editable in the admin)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django_celery_beat.models import IntervalSchedule

from core.errors import BadRequest
from feedback.models import Project
from training.rl.config import RLConfig, agent_config, group_config


def training_schedule_install(
    projects: Iterable[Project] | None = None, rewards_every_s: int = 30, train_check_every_s: int = 60,
    min_new: int = 64, every_minutes: float = 60.0, *, steps: int | None = None, batch_size: int | None = None,
    rl: dict[str, Any] | None = None, group: dict[str, Any] | None = None, epochs: float | None = None,
    agent: dict[str, Any] | None = None, outbox_every_s: int = 10, sweep_every_s: int = 60,
) -> list[Any]:
    """Creates or updates the beat entries (django-celery-beat, editable in the admin) per project:
    rewards every `rewards_every_s`, the train check every `train_check_every_s`. Idempotent.

    `steps`, `batch_size` and `rl` (RLConfig overrides) are stored in the train entry's kwargs for
    every run it starts; left out (None), the runs use the defaults. `group` ({"prompts", "G",
    "max_tokens"}) turns on group rollouts scored by the users' reward model; `epochs` sets each
    run's length in passes over its data instead of `steps`."""
    import json

    train_kwargs: dict[str, Any] = {"min_new": min_new, "every_minutes": every_minutes}
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if value is not None:
            if int(value) < 1:
                raise BadRequest(f"{name} must be >= 1", "Give a positive number.")
            train_kwargs[name] = int(value)
    if rl is not None:
        try:
            RLConfig.from_dict(dict(rl))
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"invalid RL overrides: {exc}", "Use RLConfig field names and valid values.") from exc
        train_kwargs["rl"] = dict(rl)
    if group is not None:
        try:
            train_kwargs["group"] = group_config(group)
        except ValueError as exc:
            raise BadRequest(str(exc), 'E.g. {"prompts": 64, "G": 8, "max_tokens": 16}.') from exc
    if agent is not None:
        try:
            train_kwargs["agent"] = agent_config(agent)
        except ValueError as exc:
            raise BadRequest(str(exc), 'E.g. {"tasks": 2, "G": 4}.') from exc
    if epochs is not None:
        if not 0 < float(epochs) <= 16:
            raise BadRequest(f"epochs must be in (0, 16], got {epochs!r}", "Give the passes over a run's data, e.g. 2.")
        train_kwargs["epochs"] = float(epochs)

    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    def every(seconds: int) -> IntervalSchedule:
        return IntervalSchedule.objects.get_or_create(every=seconds, period=IntervalSchedule.SECONDS)[0]

    out = []
    for project in projects if projects is not None else Project.objects.all():
        entries = [
            (f"flywheel rewards {project.slug}", "training.tasks.rewards_compute_pending", every(rewards_every_s), {}),
            (f"flywheel train {project.slug}", "training.tasks.train_maybe", every(train_check_every_s),
             train_kwargs),
        ]
        for name, task, interval, kwargs in entries:
            entry, _ = PeriodicTask.objects.update_or_create(
                name=name, defaults={"task": task, "interval": interval, "args": json.dumps([project.pk]),
                                     "kwargs": json.dumps(kwargs), "enabled": True},
            )
            out.append(entry)
    shared = [
        ("flywheel canaries", "training.tasks.gate_canaries_check", every(60)),
        # The self-healing pipeline: undelivered hand-offs, then stuck work (training/runs/sweep.py).
        ("flywheel outbox", "core.tasks.outbox_deliver", every(outbox_every_s)),
        ("flywheel sweeper", "training.tasks.pipeline_sweep", every(sweep_every_s)),
        # Raw events past each project's retention (feedback/userdata/services.py retention_sweep).
        ("flywheel retention", "feedback.tasks.retention_sweep_all", every(3600)),
    ]
    for name, task, interval in shared:
        entry, _ = PeriodicTask.objects.update_or_create(
            name=name, defaults={"task": task, "interval": interval, "args": "[]", "kwargs": "{}", "enabled": True},
        )
        out.append(entry)
    return out
