"""Reads of training runs and their steps."""

from __future__ import annotations

from datetime import datetime

from django.db.models import F, Max, QuerySet

from feedback.models import Project
from training.lineage.selectors import version_clean_ancestor
from training.models import AuditLog, PolicyVersion, RunState, TrainingRun, TrainingStep, VersionState
from training.versions.selectors import latest_report, policy_production, versions_erased_from

ACTIVE_RUN_STATES = (RunState.QUEUED, RunState.RUNNING)


def training_run_active(project: Project) -> TrainingRun | None:
    return TrainingRun.objects.filter(project=project, state__in=ACTIVE_RUN_STATES).order_by("created_at").first()


def training_run_last(project: Project, states: tuple[str, ...] = (RunState.SUCCEEDED,)) -> TrainingRun | None:
    return TrainingRun.objects.filter(project=project, state__in=states).order_by("-created_at").first()


def training_step_list(run: TrainingRun) -> QuerySet[TrainingStep]:
    return TrainingStep.objects.filter(run=run).order_by("step")


def training_run_heartbeat(run: TrainingRun) -> datetime:
    """The newest sign of life of a run: its heartbeat or last step row, else its start (or creation)."""
    last_step = TrainingStep.objects.filter(run=run).aggregate(at=Max("created_at"))["at"]
    return max((t for t in (run.heartbeat_at, last_step, run.started_at) if t is not None), default=run.created_at)


def training_head(project: Project, max_ahead: int) -> PolicyVersion | None:
    """The weights the next run continues from: the training lineage's latest candidate, so that
    learning accumulates while the gate decides what is served.

    Production instead when there is no candidate yet, when production is newer, when the
    candidate was refused for anything but "not better yet" (a person's rejection or rollback, a
    failed detector, aspect or KL check: that direction is not wanted), when the lineage ran
    more than `max_ahead` versions ahead of production (its live data would all be stale), or when
    the candidate's run left its trust region (`rl.kl_stop`, `rl.length_stop`: it measured a KL
    or a length ratio to production past the stop, so a run built on it starts outside the region
    the gate admits. Measured: a run
    from such a candidate, 2.48 nats from production, moved 1.6 more in its first round and was
    refused at 4.41 against a budget of 4; the stop is only checked from the second round on).

    Under the "retrain" erasure policy, the newest version on that one's parent chain that never
    saw erased data (a version rejected by the erasure does not send the lineage back to
    production: that rejection says nothing of its direction), or production when that is newer:
    the lineage learns again from there without the data."""
    erased = versions_erased_from(project, policy="retrain")
    head = _head(project, max_ahead, erased)
    if head is None or not erased:
        return head
    clean = version_clean_ancestor(head, erased)
    production = policy_production(project)
    if production is not None and production.id not in erased and (clean is None or clean.number < production.number):
        return production
    return clean


def training_data_since(project: Project, base: PolicyVersion, previous: TrainingRun | None) -> datetime | None:
    """Where the data window of a run from `base` starts: where the last run's ended, so each
    run learns what arrived since. After an erasure under "retrain" sent the lineage back to
    `base`, where the first run that saw erased data after `base` began instead: the loop learns
    again what the versions it left behind had learned, without the erased rows (deleted)."""
    since = previous.data_until if previous is not None else None
    erased = versions_erased_from(project, policy="retrain")
    if not erased or previous is None:
        return since
    base_run = TrainingRun.objects.filter(candidate=base).order_by("-id").first()
    left_behind = TrainingRun.objects.filter(project=project, candidate_id__in=erased)
    if base_run is not None and base_run.data_until is not None:
        left_behind = left_behind.filter(data_until__gt=base_run.data_until)
    first = left_behind.order_by(F("data_since").asc(nulls_first=True), "id").first()
    return first.data_since if first is not None and (since is None or first.data_since is None
                                                       or first.data_since < since) else since


def _head(project: Project, max_ahead: int, erased: set[int]) -> PolicyVersion | None:
    production = policy_production(project)
    run = (TrainingRun.objects.filter(project=project, state=RunState.SUCCEEDED, candidate__isnull=False)
           .select_related("candidate").order_by("-finished_at", "-id").first())
    if run is None or production is None:
        return production
    head = run.candidate
    if head.number <= production.number or head.number - production.number > max_ahead:
        return production
    if head.state in (VersionState.REJECTED, VersionState.RETIRED) and head.id not in erased \
            and not _only_not_better_yet(head):
        return production
    if run.result.get("stopped_after_round") is not None:
        return production
    return head


def _only_not_better_yet(version: PolicyVersion) -> bool:
    if AuditLog.objects.filter(target=f"policy_version:{version.id}", action__in=("reject", "rollback",
                                                                                  "canary_rollback")).exists():
        return False
    report = latest_report(version)
    failed = {c["name"] for c in report.checks if not c.get("passed")} if report is not None else {"unknown"}
    return failed <= {"reward_improvement"}
