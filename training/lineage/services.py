"""Writes of the training lineage of data: what a run trained on (recorded when it finishes), and
the erasure of one user's data with the report of the versions that learned from it.

    .venv/bin/python -m pytest tests/training/test_lineage.py -q
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import connection, transaction

from feedback.models import Project
from feedback.services import data_policy_of
from feedback.userdata.services import user_rows_erase
from training.lineage.selectors import Learned, lineage_of
from training.models import AuditLog, Erasure, TrainingRun
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

    def as_dict(self) -> dict[str, Any]:
        return {"erasure": self.erasure, "policy": self.policy, "removed": self.removed,
                "export_files_rewritten": len(self.export_files),
                "versions": [v.as_dict() for v in self.versions]}


def user_erase(project: Project, user: str, actor: Actor) -> ErasureReport:
    """Erases one user's data (feedback.userdata.services.user_rows_erase), reports the versions
    that learned from it and applies the project's erasure policy to them: keep (reported only),
    flag (marked on the registry) or retrain (also: the training lineage goes back to the newest
    version that never saw the data, training.runs.selectors.training_head). One transaction; the
    audit row names the erasure, never the user (and takes no free-text reason that could)."""
    policy = data_policy_of(project).erasure_policy
    with transaction.atomic():
        learned = lineage_of(project, user=user)  # before the rows go: afterwards nothing links them
        rows = user_rows_erase(project, user)
        erasure = Erasure.objects.create(project=project, actor=actor_name(actor), policy=policy,
                                         removed=rows.counts, versions=[v.id for v in learned])
        AuditLog.objects.create(
            project=project, actor=actor_name(actor), action="user_erase", target=f"erasure:{erasure.pk}",
            before=None,
            after={"policy": policy, "removed": rows.counts, "export_files_rewritten": len(rows.export_files),
                   "versions": [v.number for v in learned]})
    return ErasureReport(erasure.pk, policy, rows.counts, rows.export_files, learned)
