"""The self-healing pipeline: real Celery workers killed with SIGKILL in each intermediate state,
the sweeper (training/runs/sweep.py) requeues or fails the work with an audit row, and the
transactional outbox (core/outbox.py) keeps a hand-off made while the broker was down.

    .venv/bin/python -m pytest tests/training/runs/test_self_healing.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from core.models import OutboxMessage
from core.outbox import outbox_deliver
from tests.processes import ROOT, free_port, start_celery_worker, subprocess_env, wait_until
from tests.training.rewards.test_judges import endpoint  # noqa: F401 - the fixture
from tests.training.test_services import ingest_live, later, plain_spec
from training.gate.tasks import GATE_RUN
from training.models import AuditLog, EvalSuite, GateReport, PolicyVersion, TrainingRun, TrainingStep
from training.rewards.services import rewards_compute_pending
from training.runs.services import training_run_start
from training.runs.settings import RunSettings
from training.runs.sweep import TRAIN_POLICY, pipeline_sweep

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def doomed_worker(django_db_setup, checkpoint_root):
    """(process, queue): a Celery worker of its own on a queue no other worker reads, beating
    every 0.3 s; the test kills it."""
    queue = f"doomed-{uuid.uuid4().hex[:8]}"
    env = subprocess_env(FLYWHEEL_CHECKPOINT_DIR=str(checkpoint_root), FLYWHEEL_TRAIN_HEARTBEAT_EVERY_S="0.3")
    proc, log = start_celery_worker(queue, f"doomed-{uuid.uuid4().hex[:6]}@%h", "test-celery-worker-doomed.log", env)
    yield proc, queue
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    log.close()


def kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def audit_actions(target: str) -> list[str]:
    return list(AuditLog.objects.filter(target=target).order_by("at", "id").values_list("action", flat=True))


def test_a_run_beats_while_it_trains_and_the_sweeper_fails_it_once_its_worker_is_killed(
    creds, production, tokenizer, doomed_worker
):
    from training.tasks import train_policy_task

    proc, queue = doomed_worker
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 8)
    rewards_compute_pending(creds.project, now=later(1))
    run, _ = training_run_start(creds.project, RunSettings(steps=100_000, batch_size=2), enqueue=False)
    train_policy_task.apply_async(args=[run.pk], queue=queue)
    wait_until(lambda: TrainingStep.objects.filter(run=run).exists(), timeout=120, what="the first optimiser step")
    first = TrainingRun.objects.get(pk=run.pk).heartbeat_at
    wait_until(lambda: TrainingRun.objects.get(pk=run.pk).heartbeat_at > first, timeout=120, what="a heartbeat")
    assert pipeline_sweep().counts()["runs_failed"] == 0  # alive and beating: left alone

    kill(proc)
    report = pipeline_sweep()
    run.refresh_from_db()
    assert report.runs_failed == [run.pk]
    assert run.state == "failed" and "is gone" in run.error and run.candidate is None
    assert audit_actions(f"training_run:{run.pk}") == ["run_lost"]
    assert pipeline_sweep().counts()["runs_failed"] == 0  # once


def test_a_gate_whose_worker_is_killed_goes_back_to_the_queue_and_completes(
    creds, production, tiny_policy_dir, doomed_worker, celery_worker_process, endpoint,  # noqa: F811 - the fixture
):
    from training.gate.tasks import gate_run_task

    proc, queue = doomed_worker
    # The gate judges through an endpoint that holds every request until released: the kill lands
    # mid-gate however fast the machine (a whole tiny gate takes 0.2 s here).
    released = threading.Event()
    held = endpoint((200, json.dumps({"scores": {"concision": {"score": 1.0, "rationale": "short"}}})), hold=released)
    judge = {"kind": "model", "base_url": held.url, "model": "judge", "aspects": {"concision": "short"},
             "timeout_s": 600, "retries": 0}
    EvalSuite.objects.create(project=creds.project, version=1, prompts=[{"id": f"p{i}", "prompt": p} for i, p in
                                                                         enumerate(["def add(a, b):", "import os"])],
                             checks=[], judge=judge, aspects=[{"name": "concision", "weight": 1.0}], n_samples=2,
                             max_tokens=8)
    candidate = PolicyVersion.objects.create(project=creds.project, number=2, parent=production, state="candidate",
                                             checkpoint_path=str(tiny_policy_dir))
    gate_run_task.apply_async(args=[candidate.pk], queue=queue)
    wait_until(lambda: PolicyVersion.objects.get(pk=candidate.pk).state == "gated", timeout=120, what="the gate's claim")
    wait_until(lambda: held.requests, timeout=120, what="the gate judging (held)")  # mid-gate, deterministically
    kill(proc)
    released.set()

    report = pipeline_sweep()
    assert report.gates_requeued == [candidate.pk]
    assert OutboxMessage.objects.filter(task=GATE_RUN, args=[candidate.pk, "system:gate"]).exists()
    # The session's worker takes the requeued gate from the queue and finishes it.
    wait_until(lambda: GateReport.objects.filter(version=candidate).exists(), timeout=300, what="the gate report")
    candidate.refresh_from_db()
    assert candidate.state in ("awaiting_approval", "rejected")
    assert audit_actions(f"policy_version:{candidate.pk}")[:3] == ["gate_start", "gate_lost", "gate_start"]


def _run_with_candidate(creds, tiny_policy_dir) -> PolicyVersion:
    # No production version: the gate passes such a candidate at once ("a person approves the first").
    base = PolicyVersion.objects.create(project=creds.project, number=1, state="retired",
                                        checkpoint_path=str(tiny_policy_dir))
    candidate = PolicyVersion.objects.create(project=creds.project, number=2, parent=base, state="candidate",
                                             checkpoint_path=str(tiny_policy_dir))
    TrainingRun.objects.create(project=creds.project, base_version=base, candidate=candidate, state="succeeded")
    return candidate


def test_a_candidate_whose_gate_message_was_lost_is_gated_again(creds, tiny_policy_dir, celery_worker_process):
    # Its message was lost (Redis restarted empty): nothing in the queue, nothing pending.
    candidate = _run_with_candidate(creds, tiny_policy_dir)
    assert pipeline_sweep().candidates_requeued == []  # not waiting long enough yet
    report = pipeline_sweep(now=timezone.now() + timedelta(seconds=301))
    assert report.candidates_requeued == [candidate.pk]
    assert audit_actions(f"policy_version:{candidate.pk}") == ["gate_requeue"]
    wait_until(lambda: PolicyVersion.objects.get(pk=candidate.pk).state == "awaiting_approval", timeout=120,
             what="the requeued gate")


def test_the_sweeper_leaves_a_flagged_runs_candidate_ungated(creds, tiny_policy_dir):
    candidate = _run_with_candidate(creds, tiny_policy_dir)
    TrainingRun.objects.filter(candidate=candidate).update(result={"flag": "flagged: train/inference mismatch KL"})
    assert pipeline_sweep(now=timezone.now() + timedelta(seconds=301)).candidates_requeued == []
    assert audit_actions(f"policy_version:{candidate.pk}") == []


def test_a_hand_off_made_while_the_broker_is_down_waits_in_the_outbox_and_is_delivered_later(
    creds, tiny_policy_dir, celery_worker_process
):
    candidate = _run_with_candidate(creds, tiny_policy_dir)
    dead_broker = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
    code = ("import django; django.setup()\n"
            "from django.db import transaction\n"
            "from training.gate.tasks import gate_run_enqueue\n"
            f"with transaction.atomic(): gate_run_enqueue({candidate.pk})\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(REDIS_URL=dead_broker),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]  # the commit stood; the send failed quietly

    message = OutboxMessage.objects.get(task=GATE_RUN)
    assert message.sent_at is None and message.attempts == 1 and "Error" in message.last_error
    # A pending hand-off is not lost: the sweeper leaves it to the outbox.
    assert pipeline_sweep(now=timezone.now() + timedelta(seconds=301)).candidates_requeued == []

    assert outbox_deliver(grace=timedelta(0)) == 1
    assert OutboxMessage.objects.get(pk=message.pk).sent_at is not None
    wait_until(lambda: PolicyVersion.objects.get(pk=candidate.pk).state == "awaiting_approval", timeout=120,
             what="the delivered gate")
    assert outbox_deliver(grace=timedelta(0)) == 0


@pytest.mark.django_db  # no commit, so the requeued message stays in the outbox: no worker takes the run
def test_a_queued_run_no_worker_claimed_is_queued_again_then_failed_after_the_queue_timeout(creds, production,
                                                                                             settings):
    settings.FLYWHEEL_TRAIN_QUEUE_TIMEOUT_S = 900
    run, _ = training_run_start(creds.project, enqueue=False)  # as if its message was lost
    soon, late = timezone.now() + timedelta(seconds=301), timezone.now() + timedelta(seconds=901)
    assert pipeline_sweep(now=soon).runs_requeued == [run.pk]
    assert OutboxMessage.objects.filter(task=TRAIN_POLICY, args=[run.pk]).exists()
    assert pipeline_sweep(now=soon).runs_requeued == []  # not again before another wait
    assert pipeline_sweep(now=late).runs_failed == [run.pk]
    assert audit_actions(f"training_run:{run.pk}") == ["run_requeue", "run_lost"]
    run.refresh_from_db()
    assert run.state == "failed" and "no worker picked the run up" in run.error
