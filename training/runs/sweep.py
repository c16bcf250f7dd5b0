"""The sweeper (beat, `training.tasks.pipeline_sweep`): finds work stuck between two states and
requeues or fails it, with an audit row each time.

- a run `running` whose worker is gone or stopped beating → failed (the next train check starts
  a new one from the same lineage);
- a run `queued` that no worker claimed → queued again, failed after the queue timeout;
- a version `gated` with no live gate task (its worker is gone, or it outlived the task's time
  limit) → back to `candidate` and gated again; a gate lost FLYWHEEL_SWEEP_MAX_ATTEMPTS times
  (it kills its worker) → rejected;
- a run's candidate never gated (its message lost, e.g. Redis restarted empty) → gated again.

Hand-offs go through the outbox (core/outbox.py): a message still pending there is not lost, so
the sweeper leaves its work alone. Every version state change goes through `version_transition`.

    .venv/bin/python -m pytest tests/training/runs/test_self_healing.py -q
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.models import OutboxMessage
from core.tasks import enqueue_after_commit
from training.gate.services import gate_lost_reason
from training.gate.tasks import GATE_RUN, gate_run_enqueue
from training.models import AuditLog, PolicyVersion, RunState, TrainingRun, VersionState
from training.runs import selectors
from training.runs.services import training_run_fail, training_run_lost_reason
from training.versions.services import version_audit, version_locked, version_transition

PIPELINE_SWEEP = "training.tasks.pipeline_sweep"
TRAIN_POLICY = "training.tasks.train_policy"
SWEEPER = "system:sweeper"


@dataclass
class SweepReport:
    runs_failed: list[int] = field(default_factory=list)
    runs_requeued: list[int] = field(default_factory=list)
    gates_requeued: list[int] = field(default_factory=list)
    gates_failed: list[int] = field(default_factory=list)
    candidates_requeued: list[int] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {name: len(ids) for name, ids in asdict(self).items()}


def pipeline_sweep(now: datetime | None = None) -> SweepReport:
    now = now or timezone.now()
    report = SweepReport()
    for run in TrainingRun.objects.filter(state__in=selectors.ACTIVE_RUN_STATES).select_related("project"):
        _sweep_run(run, now, report)
    for version in PolicyVersion.objects.filter(state=VersionState.GATED):
        _sweep_gate(version, now, report)
    for version in _candidates_waiting_for_gate():
        _sweep_candidate(version, now, report)
    return report


def _requeue_after() -> timedelta:
    return timedelta(seconds=float(settings.FLYWHEEL_SWEEP_REQUEUE_AFTER_S))


def _pending(task: str, target_id: int) -> bool:
    return OutboxMessage.objects.filter(task=task, sent_at__isnull=True, args__0=target_id).exists()


def _audits(target: str, action: str):
    return AuditLog.objects.filter(target=target, action=action).order_by("-at", "-id")


def _run_audit(run: TrainingRun, action: str, before: str, after: str, reason: str) -> None:
    AuditLog.objects.create(project_id=run.project_id, actor=SWEEPER, action=action, target=f"training_run:{run.pk}",
                            before={"run": run.pk, "state": before}, after={"run": run.pk, "state": after},
                            reason=reason)


def _sweep_run(run: TrainingRun, now: datetime, report: SweepReport) -> None:
    reason = training_run_lost_reason(run, now)
    if reason is not None:
        with transaction.atomic():
            if training_run_fail(run.pk, f"worker lost: {reason}"):
                _run_audit(run, "run_lost", run.state, "failed", reason)
                report.runs_failed.append(run.pk)
        return
    target = f"training_run:{run.pk}"
    last = _audits(target, "run_requeue").first()
    since = last.at if last is not None else run.created_at
    if run.state != RunState.QUEUED or now - since < _requeue_after() or _pending(TRAIN_POLICY, run.pk):
        return
    with transaction.atomic():
        if TrainingRun.objects.filter(pk=run.pk, state=RunState.QUEUED).select_for_update().exists():
            enqueue_after_commit(TRAIN_POLICY, run.pk)
            _run_audit(run, "run_requeue", "queued", "queued",
                       f"no worker claimed it for {(now - since).total_seconds():.0f} s; queued again")
            report.runs_requeued.append(run.pk)


def _sweep_gate(version: PolicyVersion, now: datetime, report: SweepReport) -> None:
    if gate_lost_reason(version, now) is None:
        return
    with transaction.atomic():
        version = version_locked(version.pk)
        reason = gate_lost_reason(version, now) if version.state == VersionState.GATED else None
        if reason is None:
            return
        version_transition(version, VersionState.CANDIDATE, SWEEPER, "gate_lost", reason)
        lost = _audits(f"policy_version:{version.pk}", "gate_lost").count()
        if lost >= int(settings.FLYWHEEL_SWEEP_MAX_ATTEMPTS):
            version_transition(version, VersionState.REJECTED, SWEEPER, "gate_abandoned",
                               f"its gate was lost {lost} times (last: {reason}); train a new candidate")
            report.gates_failed.append(version.pk)
        else:
            gate_run_enqueue(version.pk)
            report.gates_requeued.append(version.pk)


def _candidates_waiting_for_gate():
    # A run's candidate is handed to the gate unless its run was flagged (result["flag"] says why).
    return (PolicyVersion.objects.filter(state=VersionState.CANDIDATE, runs_to__state=RunState.SUCCEEDED)
            .exclude(runs_to__result__has_key="flag").distinct())


def _sweep_candidate(version: PolicyVersion, now: datetime, report: SweepReport) -> None:
    target = f"policy_version:{version.pk}"
    last = AuditLog.objects.filter(target=target).order_by("-at", "-id").first()
    if last is not None and last.action == "gate_error":
        return  # the gate ran and failed: a person gates it again on purpose
    since = max(version.created_at, last.at) if last is not None else version.created_at
    if now - since < _requeue_after() or _pending(GATE_RUN, version.pk):
        return
    with transaction.atomic():
        version = version_locked(version.pk)
        if version.state != VersionState.CANDIDATE:
            return
        version_audit(version, SWEEPER, "gate_requeue", {"state": "candidate"},
                      f"no gate started for {(now - since).total_seconds():.0f} s; gated again")
        gate_run_enqueue(version.pk)
        report.candidates_requeued.append(version.pk)
