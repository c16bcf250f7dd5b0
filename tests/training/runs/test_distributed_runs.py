"""A training run on 2 processes (FLYWHEEL_TRAIN_NPROC=2): its steps under torchrun with FSDP2,
its candidate registered like any run's; a rank that dies fails the run and the next proceeds.

    .venv/bin/python -m pytest tests/training/runs/test_distributed_runs.py -q
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
from safetensors.torch import load_file

from tests.processes import wait_until
from tests.training.test_services import ingest_live, later, plain_spec
from training.models import PolicyVersion, TrainingStep
from training.rewards.services import rewards_compute_pending
from training.rl.precision import resolve_precision
from training.runs.services import train_policy, training_run_start
from training.runs.settings import RunSettings
from training.versions.services import policy_folder

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def two_processes(settings, ckpt_settings):
    settings.FLYWHEEL_TRAIN_NPROC = 2
    settings.FLYWHEEL_TRAIN_COLLECTIVE_TIMEOUT_S = 20
    return settings


def _rewarded(creds, tokenizer, n: int = 8) -> None:
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, n)
    rewards_compute_pending(creds.project, now=later(1))


def test_a_run_on_two_processes_trains_under_torchrun_and_registers_its_candidate(
    creds, production, tokenizer, two_processes
):
    _rewarded(creds, tokenizer)
    # "auto": the ranks compute in what it resolves to here (bf16 on a CPU with AVX-512 BF16)
    run, _ = training_run_start(creds.project, RunSettings(steps=2, batch_size=4, precision="auto"), enqueue=False)
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    assert run.result["precision"] == resolve_precision("auto")
    assert TrainingStep.objects.filter(run=run).count() == 2
    assert all(s.loss is not None and s.tokens_per_s > 0 for s in TrainingStep.objects.filter(run=run))
    base = load_file(policy_folder(production) / "model.safetensors")
    trained = load_file(policy_folder(run.candidate) / "model.safetensors")
    assert max(float((trained[k] - base[k]).abs().max()) for k in base) > 0  # the ranks' update came back
    assert not (two_processes.FLYWHEEL_CHECKPOINT_DIR / "torchrun" / f"run-{run.pk}").exists()


def test_a_rank_that_dies_fails_the_run_registers_nothing_and_the_next_run_proceeds(
    creds, production, tokenizer, two_processes
):
    _rewarded(creds, tokenizer)
    doomed, _ = training_run_start(creds.project, RunSettings(steps=2000, batch_size=2), enqueue=False)
    job = two_processes.FLYWHEEL_CHECKPOINT_DIR / "torchrun" / f"run-{doomed.pk}" / "take-0"

    def kill_rank_1() -> None:
        wait_until(lambda: (job / "rank-1.pid").exists() and (job / "metrics.jsonl").exists(), timeout=300,
                   every=0.05, what="rank 1 started and a step finished")
        os.kill(int((job / "rank-1.pid").read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    doomed = train_policy(doomed.pk)
    killer.join()
    assert doomed.state == "failed" and "DistributedRunFailed" in doomed.error and doomed.candidate is None
    assert not PolicyVersion.objects.filter(state="candidate").exists()

    two_processes.FLYWHEEL_TRAIN_NPROC = 1
    nxt, created = training_run_start(creds.project, RunSettings(steps=2, batch_size=4), enqueue=False)
    assert created
    assert train_policy(nxt.pk).state == "succeeded"
