"""Training tasks in a real Celery worker process: a worker killed with SIGKILL mid-run leaves a
failed run and no candidate, and the next run proceeds.

    .venv/bin/python -m pytest tests/training/test_tasks.py -q
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest

from tests.processes import start_celery_worker, subprocess_env, wait_until
from tests.training.test_services import ingest_live, later, plain_spec
from training.models import PolicyVersion, TrainingRun, TrainingStep
from training.rewards.services import rewards_compute_pending
from training.runs.services import WorkerRef, train_policy, training_run_start
from training.runs.settings import RunSettings

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def worker_on_own_queue(django_db_setup, checkpoint_root):
    """(process, queue): a Celery worker of its own (function-scoped, so killing it harms no other
    test), consuming a queue no other worker reads."""
    queue = f"train-test-{uuid.uuid4().hex[:8]}"
    proc, log = start_celery_worker(queue, f"killme-{uuid.uuid4().hex[:6]}@%h", "test-celery-worker-kill.log",
                                    subprocess_env(FLYWHEEL_CHECKPOINT_DIR=str(checkpoint_root)), seconds=90)
    yield proc, queue
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    log.close()


def test_a_worker_killed_mid_run_fails_the_run_registers_nothing_and_the_next_run_proceeds(
    creds, production, tokenizer, worker_on_own_queue
):
    from training.tasks import train_policy_task

    proc, queue = worker_on_own_queue
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 8)
    rewards_compute_pending(creds.project, now=later(1))
    doomed, _ = training_run_start(creds.project, RunSettings(steps=100_000, batch_size=2), enqueue=False)
    train_policy_task.apply_async(args=[doomed.pk], queue=queue)

    wait_until(lambda: TrainingStep.objects.filter(run=doomed).exists(), timeout=120, what="the first optimiser step")
    doomed.refresh_from_db()
    assert doomed.state == "running"
    assert WorkerRef.parse(doomed.worker).pid == proc.pid  # the process we are about to kill
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    nxt, created = training_run_start(creds.project, RunSettings(steps=2, batch_size=4), enqueue=False)
    doomed.refresh_from_db()
    assert created
    assert doomed.state == "failed" and "worker lost" in doomed.error and doomed.candidate is None
    assert doomed.finished_at is not None
    assert not PolicyVersion.objects.filter(state="candidate").exists()

    nxt = train_policy(nxt.pk)
    assert nxt.state == "succeeded", nxt.error
    assert list(PolicyVersion.objects.filter(state="candidate")) == [nxt.candidate]
    assert TrainingRun.objects.get(pk=doomed.pk).state == "failed"  # the late finish cannot revive it
