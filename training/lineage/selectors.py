"""Reads of the training lineage of data: which runs and versions learned from a user, a
trajectory or a time window (the rows each run trained on are `RunLineage` id ranges).

    .venv/bin/python -m pytest tests/training/lineage/test_lineage.py -q
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connection
from django.db.models import QuerySet

from feedback.models import FeedbackEvent, Project, Trajectory
from feedback.selectors import in_project
from feedback.services import user_hash_of
from training.models import PolicyVersion


@dataclass(frozen=True)
class Learned:
    """A version that learned from the data: `direct` when its own run trained on it, else it
    continues from weights that did (a descendant in the training lineage)."""

    id: int
    number: int
    state: str
    direct: bool
    runs: tuple[int, ...]  # the runs of this version that trained on the data (direct ones)

    def as_dict(self) -> dict:
        return {"version": self.number, "id": self.id, "state": self.state, "direct": self.direct,
                "runs": list(self.runs)}


# One statement: the data's ids as multiranges, the runs whose lineage overlaps them (GiST), their
# candidates and every version built on those (the parent chain).
_LEARNED_SQL = """
WITH RECURSIVE
  t AS (SELECT coalesce(range_agg(int8range(s.id, s.id + 1)), '{{}}'::int8multirange) AS m FROM ({t}) AS s),
  f AS (SELECT coalesce(range_agg(int8range(s.id, s.id + 1)), '{{}}'::int8multirange) AS m FROM ({f}) AS s),
  runs AS (SELECT l.run_id FROM training_runlineage l, t, f
           WHERE l.project_id = %s AND (l.trajectories && t.m OR l.feedback && f.m)),
  direct AS (SELECT r.candidate_id AS id, array_agg(r.id ORDER BY r.id) AS runs FROM training_trainingrun r
             WHERE r.id IN (SELECT run_id FROM runs) AND r.candidate_id IS NOT NULL GROUP BY r.candidate_id),
  learned AS (SELECT id FROM direct
              UNION SELECT v.id FROM training_policyversion v JOIN learned ON v.parent_id = learned.id)
SELECT v.id, v.number, v.state, d.id IS NOT NULL, coalesce(d.runs, '{{}}')
FROM training_policyversion v JOIN learned ON learned.id = v.id LEFT JOIN direct d ON d.id = v.id
ORDER BY v.number
"""


def data_of(project: Project, *, user: str | None = None, trajectory: str | None = None,
            since: datetime | None = None, until: datetime | None = None
            ) -> tuple[QuerySet[Trajectory], QuerySet[FeedbackEvent]]:
    """The trajectories and feedback events a lineage question is about; each filter given
    narrows it: a user's data (the trajectories served to them and their feedback on anyone's),
    one trajectory (by its id: it and the feedback on it), what occurred in [since, until).
    Nothing given: all of the project's data."""
    trajectories = Trajectory.objects.filter(project=project)
    feedback = FeedbackEvent.objects.filter(project=project)
    if user is not None:
        hashed = user_hash_of(project, user)
        trajectories, feedback = trajectories.filter(user_hash=hashed), feedback.filter(user_hash=hashed)
    if trajectory is not None:  # by its unique key, the project hidden from the planner (in_project)
        one = Trajectory.objects.filter(in_project(project), external_id=trajectory).values("pk")
        trajectories, feedback = trajectories.filter(pk__in=one), feedback.filter(trajectory__in=one)
    if since is not None:
        trajectories, feedback = trajectories.filter(occurred_at__gte=since), feedback.filter(occurred_at__gte=since)
    if until is not None:
        trajectories, feedback = trajectories.filter(occurred_at__lt=until), feedback.filter(occurred_at__lt=until)
    return trajectories, feedback


def versions_learned_from(project: Project, trajectories: QuerySet[Trajectory],
                          feedback: QuerySet[FeedbackEvent]) -> list[Learned]:
    """The versions that learned from these rows, oldest first (one query)."""
    t_sql, t_params = trajectories.values("id").query.sql_with_params()
    f_sql, f_params = feedback.values("id").query.sql_with_params()
    with connection.cursor() as cur:
        cur.execute(_LEARNED_SQL.format(t=t_sql, f=f_sql), [*t_params, *f_params, project.pk])
        return [Learned(i, n, s, d, tuple(r)) for i, n, s, d, r in cur.fetchall()]


def lineage_of(project: Project, **which: str | datetime | None) -> list[Learned]:
    """`versions_learned_from` the data `data_of(project, **which)` names."""
    return versions_learned_from(project, *data_of(project, **which))


def run_lineage_summary(run_id: int) -> dict | None:
    """What one run trained on: counts and its id ranges (as PostgreSQL prints them)."""
    with connection.cursor() as cur:
        cur.execute("SELECT trajectory_count, feedback_count, trajectories::text, feedback::text "
                    "FROM training_runlineage WHERE run_id = %s", [run_id])
        row = cur.fetchone()
    if row is None:
        return None
    return {"trajectories": row[0], "feedback": row[1], "trajectory_ranges": row[2], "feedback_ranges": row[3]}


def version_clean_ancestor(version: PolicyVersion, tainted: set[int]) -> PolicyVersion | None:
    """The newest version on `version`'s parent chain (itself included) that never saw erased data."""
    current: PolicyVersion | None = version
    while current is not None and current.pk in tainted:
        current = current.parent
    return current
