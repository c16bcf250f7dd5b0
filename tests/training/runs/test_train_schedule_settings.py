"""Per-run training settings through the beat: a Schedule's run settings (steps, batch size,
RLConfig overrides, agent rollouts) reach the run, and training_schedule_install stores them in the
train entry's kwargs, which the train task reads back.

    .venv/bin/python -m pytest tests/training/runs/test_train_schedule_settings.py -q
"""

from __future__ import annotations

import json

import pytest

from core.errors import BadRequest
from tests.training.test_services import ingest_live, later, plain_spec
from training import tasks
from training.models import TrainingRun
from training.rewards.services import rewards_compute_pending
from training.rl.config import RLConfig
from training.runs.services import train_maybe
from training.runs.settings import RunSettings, Schedule
from training.schedule import training_schedule_install


def test_train_maybe_passes_steps_batch_size_and_rl_overrides_to_the_run(creds, production, tokenizer,
                                                                          django_capture_on_commit_callbacks):
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 4)
    rewards_compute_pending(creds.project, now=later(1))
    with django_capture_on_commit_callbacks(execute=False):
        run = train_maybe(creds.project, Schedule(min_new=4, every_minutes=60,
                                                  run=RunSettings(steps=7, batch_size=3, rl=RLConfig(lr=1e-3))))
    assert run is not None
    assert run.settings["steps"] == 7 and run.settings["batch_size"] == 3
    assert run.settings["rl"]["lr"] == 1e-3


def test_a_run_the_beat_starts_without_settings_is_asked_for_the_defaults(
    creds, production, tokenizer, django_capture_on_commit_callbacks
):
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 4)
    rewards_compute_pending(creds.project, now=later(1))
    with django_capture_on_commit_callbacks(execute=False):
        run = train_maybe(creds.project, Schedule(min_new=4, every_minutes=60))
    assert (run.settings["steps"], run.settings["batch_size"], run.settings["seed"]) == (4, 32, 0)
    assert run.settings["rl"]["lr"] == 1e-5 and run.settings["group"] is None and run.settings["agent"] is None
    assert run.data_until is not None and run.data_since is None and run.spec_id is not None


def test_the_train_task_takes_the_stored_kwargs(creds, production, tokenizer, django_capture_on_commit_callbacks):
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 4)
    rewards_compute_pending(creds.project, now=later(1))
    training_schedule_install([creds.project], Schedule(min_new=4, every_minutes=60,
                                                        run=RunSettings(steps=5, batch_size=2, rl=RLConfig(lr=2e-4))))
    from django_celery_beat.models import PeriodicTask

    entry = PeriodicTask.objects.get(name=f"flywheel train {creds.project.slug}")
    kwargs = json.loads(entry.kwargs)
    assert kwargs == {"min_new": 4, "every_minutes": 60, "steps": 5, "batch_size": 2, "rl": {"lr": 2e-4}}
    with django_capture_on_commit_callbacks(execute=False):
        run_id = tasks.train_maybe.run(creds.project.pk, **kwargs)
    run = TrainingRun.objects.get(pk=run_id)
    assert (run.settings["steps"], run.settings["batch_size"], run.settings["rl"]["lr"]) == (5, 2, 2e-4)


def test_the_schedule_leaves_run_settings_out_unless_given(creds):
    from django_celery_beat.models import PeriodicTask

    training_schedule_install([creds.project], Schedule(min_new=8, every_minutes=5))
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
    training_schedule_install([creds.project], Schedule(min_new=4, every_minutes=60,
                                                        run=RunSettings(agent={"tasks": 1, "G": 2})))
    from django_celery_beat.models import PeriodicTask

    kwargs = json.loads(PeriodicTask.objects.get(name=f"flywheel train {creds.project.slug}").kwargs)
    assert kwargs["agent"]["tasks"] == 1 and kwargs["agent"]["G"] == 2
    with django_capture_on_commit_callbacks(execute=False):
        run_id = tasks.train_maybe.run(creds.project.pk, **kwargs)
    assert TrainingRun.objects.get(pk=run_id).settings["agent"] == kwargs["agent"]


@pytest.mark.parametrize(("bad", "message", "fix"), [
    ({"steps": 0}, "steps must be >= 1", "positive number of optimiser steps"),
    ({"batch_size": -1}, "batch_size must be >= 1", "positive batch size"),
    ({"steps": "many"}, "steps must be a number, got 'many'", "positive number of optimiser steps"),
    ({"rl": {"lr": 0}}, "invalid RL overrides: invalid RLConfig: lr must be > 0", "RLConfig field names"),
    ({"rl": {"no_such_knob": 1}}, r"unknown RLConfig keys: \['no_such_knob'\]", "RLConfig field names"),
    ({"agent": {"G": 4}}, "agent must be an object with `tasks`", '{"tasks": 8'),
    ({"agent": {"tasks": 0}}, r"agent.tasks must be an integer in \[1, 256\], got 0", '{"tasks": 8'),
    ({"group": {"G": 1}}, r"group.G must be an integer in \[2, 128\], got 1", '{"prompts": 64'),
    ({"epochs": 17}, r"epochs must be in \(0, 16\], got 17.0", "passes over a run's data"),
    ({"min_new": 0}, "invalid schedule: min_new must be >= 1", "new rewarded trajectories"),
    ({"every_minutes": -1}, "invalid schedule: every_minutes must be >= 0", "minutes after which"),
    ({"stpes": 4}, r"unknown keys \['stpes'\]", "Leave out the unknown keys"),
])
def test_invalid_settings_are_refused_with_what_was_wrong_and_how_to_fix_it(bad, message, fix):
    with pytest.raises(BadRequest, match=message) as exc:
        Schedule.from_dict(bad)
    assert fix in exc.value.fix


def test_every_problem_is_reported_at_once():
    with pytest.raises(BadRequest) as exc:
        RunSettings.from_dict({"steps": 0, "batch_size": 0, "group": {"G": 1}})
    assert exc.value.problems == ["steps must be >= 1", "batch_size must be >= 1",
                                  "group.G must be an integer in [2, 128], got 1"]


@pytest.mark.parametrize("schedule", [Schedule(), Schedule(min_new=3, every_minutes=0.5, run=RunSettings(
    steps=2, batch_size=5, seed=9, epochs=1.5, rl=RLConfig(lr=3e-4, kl_to="production", kl_stop=2.0),
    group={"prompts": 4, "G": 4, "rounds": 2}, agent={"tasks": 2}, max_samples=100, trajectory_ids=(3, 1)))])
def test_settings_survive_their_json_round_trip(schedule):
    wire = json.loads(json.dumps(schedule.to_dict()))
    assert Schedule.from_dict(wire) == schedule
    stored = json.loads(json.dumps(schedule.run.to_dict()))
    assert RunSettings.from_dict(stored) == schedule.run
    assert stored["rl"] == schedule.run.rl.to_dict()  # a run records every knob, not only the changed ones


def test_a_beat_entry_keeps_only_the_settings_that_differ_from_the_defaults():
    schedule = Schedule(min_new=5, run=RunSettings(steps=2, rl=RLConfig(lr=2e-3)))
    assert schedule.to_dict() == {"min_new": 5, "every_minutes": 60.0, "steps": 2, "rl": {"lr": 2e-3}}


def test_the_demo_preset_is_a_valid_schedule_with_its_measured_recipe():
    from training.runs.settings import PRESETS

    demo = PRESETS["demo"]
    assert demo.problems() == []
    assert (demo.min_new, demo.run.rounds, demo.run.rl.kl_stop, demo.run.rl.length_stop) == (100, 8, 2.5, 1.6)
    assert Schedule.from_dict(json.loads(json.dumps(demo.to_dict()))) == demo


def test_the_train_task_reads_a_beat_entry_written_before_run_settings_had_a_type(
    creds, production, tokenizer, django_capture_on_commit_callbacks
):
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 4)
    rewards_compute_pending(creds.project, now=later(1))
    old = {"min_new": 4, "every_minutes": 60.0, "steps": 3, "batch_size": 2, "rl": {"lr": 2e-4},
           "group": None, "epochs": None, "agent": None}  # the loose kwargs of the old entry
    with django_capture_on_commit_callbacks(execute=False):
        run = TrainingRun.objects.get(pk=tasks.train_maybe.run(creds.project.pk, **old))
    assert (run.settings["steps"], run.settings["batch_size"], run.settings["rl"]["lr"]) == (3, 2, 2e-4)
