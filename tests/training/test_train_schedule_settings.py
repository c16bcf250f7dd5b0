"""Per-run training settings through the beat: train_maybe's steps, batch size and RLConfig
overrides reach the run, and training_schedule_install stores them in the train entry's kwargs.

    .venv/bin/python -m pytest tests/training/test_train_schedule_settings.py -q
"""

from __future__ import annotations

import json

import pytest

from core.errors import BadRequest
from tests.training.test_services import ingest_live, later, plain_spec
from training import tasks
from training.models import TrainingRun
from training.rewards.services import rewards_compute_pending
from training.runs.services import DEFAULT_BATCH_SIZE, DEFAULT_TRAIN_STEPS, train_maybe
from training.schedule import training_schedule_install


def test_train_maybe_passes_steps_batch_size_and_rl_overrides_to_the_run(creds, production, tokenizer,
                                                                          django_capture_on_commit_callbacks):
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 4)
    rewards_compute_pending(creds.project, now=later(1))
    with django_capture_on_commit_callbacks(execute=False):
        run = train_maybe(creds.project, min_new=4, every_minutes=60, steps=7, batch_size=3,
                                   rl={"lr": 1e-3})
    assert run is not None
    assert run.config["steps"] == 7 and run.config["batch_size"] == 3
    assert run.config["rl"]["lr"] == 1e-3


def test_train_maybe_defaults_are_unchanged(creds, production, tokenizer, django_capture_on_commit_callbacks):
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 4)
    rewards_compute_pending(creds.project, now=later(1))
    with django_capture_on_commit_callbacks(execute=False):
        run = train_maybe(creds.project, min_new=4, every_minutes=60)
    assert run.config["steps"] == DEFAULT_TRAIN_STEPS
    assert run.config["batch_size"] == DEFAULT_BATCH_SIZE
    assert run.config["rl"]["lr"] == 1e-5


def test_the_train_task_takes_the_stored_kwargs(creds, production, tokenizer, django_capture_on_commit_callbacks):
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 4)
    rewards_compute_pending(creds.project, now=later(1))
    training_schedule_install([creds.project], min_new=4, every_minutes=60, steps=5, batch_size=2,
                                       rl={"lr": 2e-4})
    from django_celery_beat.models import PeriodicTask

    entry = PeriodicTask.objects.get(name=f"flywheel train {creds.project.slug}")
    kwargs = json.loads(entry.kwargs)
    assert kwargs == {"min_new": 4, "every_minutes": 60, "steps": 5, "batch_size": 2, "rl": {"lr": 2e-4}}
    with django_capture_on_commit_callbacks(execute=False):
        run_id = tasks.train_maybe.run(creds.project.pk, **kwargs)
    run = TrainingRun.objects.get(pk=run_id)
    assert (run.config["steps"], run.config["batch_size"], run.config["rl"]["lr"]) == (5, 2, 2e-4)


def test_the_schedule_leaves_run_settings_out_unless_given(creds):
    from django_celery_beat.models import PeriodicTask

    training_schedule_install([creds.project], min_new=8, every_minutes=5)
    entry = PeriodicTask.objects.get(name=f"flywheel train {creds.project.slug}")
    assert json.loads(entry.kwargs) == {"min_new": 8, "every_minutes": 5}


def test_the_schedule_carries_agent_rollouts_to_every_run_it_starts(creds, production, tokenizer,
                                                                    django_capture_on_commit_callbacks):
    from training.rewards.agents import SAMPLE_TASKS
    from training.rewards.services import agent_task_add

    task = SAMPLE_TASKS[0]
    agent_task_add(creds.project, task.name, dict(task.files), instruction=task.instruction)
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 4)
    rewards_compute_pending(creds.project, now=later(1))
    training_schedule_install([creds.project], min_new=4, every_minutes=60, agent={"tasks": 1, "G": 2})
    from django_celery_beat.models import PeriodicTask

    kwargs = json.loads(PeriodicTask.objects.get(name=f"flywheel train {creds.project.slug}").kwargs)
    assert kwargs["agent"]["tasks"] == 1 and kwargs["agent"]["G"] == 2
    with django_capture_on_commit_callbacks(execute=False):
        run_id = tasks.train_maybe.run(creds.project.pk, **kwargs)
    assert TrainingRun.objects.get(pk=run_id).config["agent"] == kwargs["agent"]


@pytest.mark.parametrize("bad", [{"steps": 0}, {"batch_size": -1}, {"rl": {"lr": 0}}, {"rl": {"no_such_knob": 1}},
                                 {"agent": {"G": 4}}, {"agent": {"tasks": 0}}])
def test_the_schedule_refuses_invalid_run_settings(creds, bad):
    with pytest.raises(BadRequest):
        training_schedule_install([creds.project], **bad)
