"""Agent tasks as a project's training data: registered with `manage.py agent_tasks`, a run's
`agent` config (checked with clear errors), a run that plays G rollouts per task with its own
weights through the torch engine and trains on every turn, and the gate's pure agent row.

    .venv/bin/python -m pytest tests/training/runs/test_agent_training.py -q
"""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from core.errors import BadRequest
from training.gate.config import GateThresholds
from training.gate.runner import agent_row
from training.models import AgentTask, TrainingStep
from training.rewards.agents import SAMPLE_TASKS
from training.rewards.selectors import agent_tasks
from training.rewards.services import agent_task_add, reward_spec_update
from training.runs.services import train_policy, training_run_start
from training.runs.settings import RunSettings


def _folder(root, name, files):
    folder = root / name
    folder.mkdir()
    for path, text in files.items():
        (folder / path).write_text(text)
    return folder


def test_the_command_registers_task_folders_and_refuses_one_without_asserts(creds, tmp_path):
    good = _folder(tmp_path, "square", {"sq.py": "def square(x):\n    return x\n",
                                        "test_task.py": "assert square(3) == 9\n",
                                        "INSTRUCTION.txt": "Fix square in sq.py.\n"})
    out = io.StringIO()
    call_command("agent_tasks", "--project", creds.project.slug, "--add", str(good), "--samples", stdout=out)
    assert [t.name for t in agent_tasks(creds.project)] == ["add", "double", "square"]
    square = AgentTask.objects.get(project=creds.project, name="square")
    assert square.files == {"sq.py": "def square(x):\n    return x\n", "test_task.py": "assert square(3) == 9\n"}
    assert square.instruction == "Fix square in sq.py." and square.tests == "test_task.py"

    bad = _folder(tmp_path, "empty", {"code.py": "x = 1\n", "test_task.py": "print('no asserts')\n"})
    with pytest.raises(CommandError, match="no `assert` line in its tests file 'test_task.py'"):
        call_command("agent_tasks", "--project", creds.project.slug, "--add", str(bad))
    with pytest.raises(BadRequest, match=r"file names \['../x.py'\] are not plain names"):
        agent_task_add(creds.project, "escape", {"../x.py": "", "test_task.py": "assert True\n"})
    call_command("agent_tasks", "--project", creds.project.slug, "--remove", "square", stdout=out)
    assert [t.name for t in agent_tasks(creds.project)] == ["add", "double"]


def test_a_runs_agent_config_is_checked_with_errors_that_say_how_to_fix_it(creds, production):
    with pytest.raises(BadRequest, match="has no agent tasks to roll out") as exc:
        training_run_start(creds.project, RunSettings(agent={"tasks": 2}), enqueue=False)
    assert "manage.py agent_tasks" in exc.value.fix
    agent_task_add(creds.project, "add", dict(SAMPLE_TASKS[0].files), instruction=SAMPLE_TASKS[0].instruction)
    for agent, message in [({"G": 4}, "agent must be an object with `tasks`"),
                           ({"tasks": 2, "turns": 3}, "agent must be an object with `tasks`"),
                           ({"tasks": 2, "G": 1}, r"agent.G must be an integer in \[2, 64\], got 1"),
                           ({"tasks": 2, "tests_weight": "1"}, r"agent.tests_weight must be a number in \[0, 100\]")]:
        with pytest.raises(BadRequest, match=message):
            training_run_start(creds.project, RunSettings(agent=agent), enqueue=False)
    # the command says the same, as a one-line error with the fix (no traceback)
    with pytest.raises(CommandError, match=r"agent.G must be an integer in \[2, 64\], got 1\. "):
        call_command("train_now", "--project", creds.project.slug, "--agent", '{"tasks": 2, "G": 1}')
    run, _ = training_run_start(creds.project, RunSettings(agent={"tasks": 2, "tests_weight": 2}), enqueue=False)
    assert run.settings["agent"] == {"tasks": 2, "G": 4, "max_turns": 6, "max_tokens": 96, "summary_budget": 1024,
                                   "tests_weight": 2.0}


@pytest.fixture
def dense_production(creds, dense_dir, ckpt_settings):
    """The session's dense tiny policy (512 positions: an agent prompt with its tools fits) in production."""
    from training.versions.services import policy_register

    return policy_register(creds.project, dense_dir, state="production", config={"kind": "dense"})


def test_a_run_with_agent_tasks_plays_g_rollouts_per_task_with_its_weights_and_trains_on_every_turn(
    creds, dense_production
):
    reward_spec_update(creds.project, judge={}, aspects=[])  # the tests alone: rewards in [0, 1]
    for task in SAMPLE_TASKS:
        agent_task_add(creds.project, task.name, dict(task.files), instruction=task.instruction)
    agent = {"tasks": 2, "G": 2, "max_turns": 2, "max_tokens": 16}
    run, _ = training_run_start(creds.project, RunSettings(steps=1, batch_size=8, agent=agent), enqueue=False)
    run = train_policy(run.pk)  # no live trajectory at all: the agent rollouts are the run's data
    assert run.state == "succeeded", run.error
    c = run.result
    assert c["agent_rollouts"] == 4 and sorted(c["agent_tasks"]) == ["add", "double"]
    assert c["agent_turns"] >= 4 and c["agent_samples"] == c["agent_turns"] == c["samples"]
    assert c["trajectories"] == 4 and c["agent_dropped"] == 0
    assert 0.0 <= c["agent_tests_pass_mean"] <= 1.0 and c["agent_reward_mean"] == c["agent_tests_pass_mean"]
    assert {"agent_tool_calls", "agent_summaries"} <= set(c)
    # every turn was sampled by these very weights and is scored in its recorded context
    assert c["fresh_samples"] == c["samples"] and c["fresh_mismatch_kl"] < 1e-6
    assert TrainingStep.objects.filter(run=run).count() == 1 and run.candidate is not None


def test_the_gates_agent_row_is_informational_unless_the_policy_sets_a_tolerance():
    cand, prod = {"agent:add": [1.0, 0.5], "agent:double": [0.0, 0.0]}, {"agent:add": [1.0, 1.0], "agent:double": [0.5, 0.5]}
    row = agent_row(cand, prod, GateThresholds())  # candidate (0.75 + 0) / 2 vs production (1 + 0.5) / 2
    assert row.name == "agent_tests" and row.value == pytest.approx(-0.375) and row.passed
    assert "informational" in row.detail and "candidate 0.375 vs production 0.750" in row.detail
    strict = agent_row(cand, prod, GateThresholds(agent_tolerance=0.1))
    assert not strict.passed and strict.threshold == -0.1 and strict.interval[0] < -0.1
    assert agent_row(prod, prod, GateThresholds(agent_tolerance=0.0)).passed  # no regression at all
