"""Writes of the training lineage of data: what a run trained on (recorded when it finishes), the
erasure of one user's data with the report of the versions that learned from it, and the audited
changes of a project's data policy and opt-out list (their rows are the feedback app's, the audit
log is ours: imports only point down).

    .venv/bin/python -m pytest tests/training/lineage/test_lineage.py -q
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import connection, transaction

from feedback.models import DataPolicy, Project
from feedback.services import data_policy_of, user_audit_ref
from feedback.userdata.selectors import data_policy_json
from feedback.userdata.services import consent_opt_out_set, data_policy_set, user_rows_erase
from training.lineage.selectors import Learned, lineage_of
from training.models import AuditLog, Erasure, PolicyVersion, TrainingRun
from training.promotion.services import erasure_retrain
from training.versions.selectors import versions_erased_from
from training.versions.services import Actor, actor_name

# The feedback a run learned from: the events on its trajectories that the rewards it read had
# seen (received before the reward under the run's spec was computed).
_RECORD_SQL = """
INSERT INTO training_runlineage (run_id, project_id, trajectories, feedback, trajectory_count, feedback_count,
                                 created_at)
SELECT %(run)s, %(project)s,
       (SELECT coalesce(range_agg(int8range(x, x + 1)), '{}'::int8multirange) FROM unnest(%(ids)s::bigint[]) AS x),
       coalesce(range_agg(int8range(fe.id, fe.id + 1)), '{}'::int8multirange),
       cardinality(%(ids)s::bigint[]), count(fe.id), now()
FROM feedback_feedbackevent fe
JOIN training_reward r ON r.trajectory_id = fe.trajectory_id AND r.spec_id = %(spec)s
WHERE fe.trajectory_id = ANY(%(ids)s::bigint[]) AND fe.received_at <= r.computed_at
ON CONFLICT (run_id) DO NOTHING
"""


def lineage_record(run: TrainingRun, trajectory_ids: Sequence[int]) -> None:
    """Records the trajectories `run` trained on (its samples' and its reward model's) and the
    feedback events their rewards had seen, as id ranges. In the transaction that marks the run
    succeeded: a candidate never exists without its lineage."""
    ids = sorted({int(i) for i in trajectory_ids})
    with connection.cursor() as cur:
        cur.execute(_RECORD_SQL, {"run": run.pk, "project": run.project_id, "ids": ids, "spec": run.spec_id})


@dataclass
class ErasureReport:
    erasure: int
    policy: str
    removed: dict[str, int]
    export_files: list[str]
    versions: list[Learned] = field(default_factory=list)
    retrain: dict[str, Any] | None = None  # under "retrain": what serves now, what was retired, rejected

    def as_dict(self) -> dict[str, Any]:
        return {"erasure": self.erasure, "policy": self.policy, "removed": self.removed,
                "export_files_rewritten": len(self.export_files),
                "versions": [v.as_dict() for v in self.versions], "retrain": self.retrain}


def user_erase(project: Project, user: str, actor: Actor) -> ErasureReport:
    """Erases one user's data (feedback.userdata.services.user_rows_erase), reports the versions
    that learned from it and applies the project's erasure policy to them: keep (reported only),
    flag (marked on the registry) or retrain: production goes back to the newest version that
    served before and never saw the data, the others that saw it are rejected
    (training.promotion.services.erasure_retrain) and the training lineage continues from the
    newest clean version (training.runs.selectors.training_head). One transaction; the audit rows
    name the erasure, never the user (and take no free-text reason that could)."""
    policy = data_policy_of(project).erasure_policy
    with transaction.atomic():
        # Serialised with a run's finish (erasure_taint_candidate): either this sees its lineage,
        # or it sees this erasure.
        Project.objects.select_for_update().get(pk=project.pk)
        learned = lineage_of(project, user=user)  # before the rows go: afterwards nothing links them
        rows = user_rows_erase(project, user)
        erasure = Erasure.objects.create(project=project, actor=actor_name(actor), policy=policy,
                                         removed=rows.counts, versions=[v.id for v in learned])
        retrain = None
        if policy == "retrain":
            retrain = erasure_retrain(project, versions_erased_from(project, policy="retrain"), actor,
                                      f"erasure #{erasure.pk} under the retrain policy")
        AuditLog.objects.create(
            project=project, actor=actor_name(actor), action="user_erase", target=f"erasure:{erasure.pk}",
            before=None,
            after={"policy": policy, "removed": rows.counts, "export_files_rewritten": len(rows.export_files),
                   "versions": [v.number for v in learned], **({"retrain": retrain} if retrain else {})})
    return ErasureReport(erasure.pk, policy, rows.counts, rows.export_files, learned, retrain)


def erasure_taint_candidate(run: TrainingRun, candidate: PolicyVersion) -> str | None:
    """A run that existed when data was erased under the retrain policy chose its base (and, if it
    had started, read its rows) before the erasure, and its lineage was not on record yet: its
    candidate may have learned from the erased data. It is added to those erasures' versions (it never serves, the
    lineage does not continue from it) and the reason it is not gated is returned. In the run's
    finishing transaction."""
    Project.objects.select_for_update().get(pk=run.project_id)  # see user_erase
    erasures = list(Erasure.objects.select_for_update().filter(
        project_id=run.project_id, policy="retrain", created_at__gte=run.created_at))
    for erasure in erasures:
        erasure.versions = [*erasure.versions, candidate.pk]
        erasure.save(update_fields=["versions"])
    if not erasures:
        return None
    return (f"data was erased under the retrain policy while this run was queued or training (erasure "
            f"#{', #'.join(str(e.pk) for e in erasures)}): it may have learned from it, so it is not gated")


def data_policy_update(project: Project, actor: Actor, reason: str = "", **fields: Any) -> DataPolicy:
    """Changes the project's data policy (feedback.userdata.services.data_policy_set checks every
    value) and writes one AuditLog row with the fields that changed, before and after. A change
    that changes nothing writes no row."""
    with transaction.atomic():
        Project.objects.select_for_update().get(pk=project.pk)  # the `before` is the row this one replaces
        before = data_policy_json(project)
        policy = data_policy_set(project, **fields)
        after = data_policy_json(project)
        changed = sorted(name for name in after if after[name] != before[name])
        if changed:
            AuditLog.objects.create(project=project, actor=actor_name(actor), action="data_policy_update",
                                    target=f"data_policy:{project.slug}"[:200],
                                    before={name: before[name] for name in changed},
                                    after={name: after[name] for name in changed}, reason=reason)
    return policy


def consent_opt_out_update(project: Project, user: str, opted_out: bool, actor: Actor) -> bool:
    """Puts the user on (or off) the project's opt-out list and, when that changed anything, writes
    one AuditLog row naming the user by `user_audit_ref` (never their id, nor the hash their rows
    carry: the row outlives an erasure). Returns whether they were on the list. Takes no free-text
    reason, which could name the user."""
    with transaction.atomic():
        Project.objects.select_for_update().get(pk=project.pk)  # two concurrent calls: one audit row
        before = consent_opt_out_set(project, user, opted_out)
        if before != opted_out:
            AuditLog.objects.create(project=project, actor=actor_name(actor),
                                    action="consent_opt_out" if opted_out else "consent_opt_in",
                                    target=f"user_ref:{user_audit_ref(project, user)}",
                                    before={"opted_out": before}, after={"opted_out": opted_out})
    return before
