"""Incremental refresh of the dashboard's rollup tables (webapp/models.py).

    .venv/bin/python manage.py shell -c "from webapp.rollups import rollups_refresh; print(rollups_refresh())"

A refresh finds the units touched since the watermarks (feedback and trajectory hours, rubric
project × version) and the units whose raw rows were deleted since (RollupDirty, written by the
delete triggers of migration 0003: an erasure, the admin), deletes their rollup rows and recomputes
them from the raw rows, in one transaction under an advisory lock: running it twice, or
concurrently, gives the same tables, and the tables count the raw rows that exist plus those the
retention sweep expired. Rollups outlive retention: the sweep deletes with `flywheel.rollups_keep`
on, so the triggers mark nothing (migration 0004) and the expired hours keep their counts. A unit
recomputed later for another reason (a new row or reward in a partly expired hour,
`rollups_rebuild()`) counts only the raw rows left in it; an hour whose rows all expired keeps
its counts.
Each project is recomputed in a savepoint of its own: rows that break one project's SQL (say, a
label of 1e308 stored before ingest refused it: its sums overflow) quarantine that project's
refresh and the others go on.

Watermarks on append-only tables are ids. A row whose transaction is still open at refresh time
may have a lower id than a committed one, so a watermark only advances to the largest id of rows
received more than `LAG` ago (ingest transactions are bounded by a statement timeout of
seconds); newer rows are looked at again by the next refresh, which is harmless.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from feedback.services import quarantine_record
from webapp.models import RollupWatermark

LAG = timedelta(minutes=5)
_LOCK_KEY = 7_100_001  # pg_advisory_xact_lock: one refresh at a time

_TAGS = ("CROSS JOIN LATERAL (SELECT '' AS tag UNION ALL SELECT jsonb_array_elements_text("
         "CASE WHEN jsonb_typeof({t}.tags) = 'array' THEN {t}.tags ELSE '[]'::jsonb END)) tg")

_SOURCES = {
    "feedback": ("feedback_feedbackevent", "received_at"),
    "trajectory": ("feedback_trajectory", "received_at"),
    "rubric": ("training_rubricscore", "created_at"),
}

_TOUCHED = """
DROP TABLE IF EXISTS rollup_fb_hours, rollup_traj_hours, rollup_versions, rollup_dirty;  -- a savepoint (tests) keeps them
CREATE TEMP TABLE rollup_fb_hours (project_id bigint, hour timestamptz, PRIMARY KEY (project_id, hour))
    ON COMMIT DROP;
CREATE TEMP TABLE rollup_traj_hours (project_id bigint, hour timestamptz, PRIMARY KEY (project_id, hour))
    ON COMMIT DROP;
CREATE TEMP TABLE rollup_versions (project_id bigint, policy_version int) ON COMMIT DROP;
-- Units whose raw rows were deleted (webapp_rollupdirty, written by the delete triggers): taken
-- in this transaction, so a refresh that rolls back leaves them for the next one.
CREATE TEMP TABLE rollup_dirty (project_id bigint, kind text, hour timestamptz, policy_version int) ON COMMIT DROP;
WITH gone AS (DELETE FROM webapp_rollupdirty RETURNING project_id, kind, hour, policy_version)
    INSERT INTO rollup_dirty SELECT * FROM gone;
INSERT INTO rollup_fb_hours SELECT DISTINCT project_id, hour FROM rollup_dirty WHERE kind = 'feedback_hour'
    ON CONFLICT DO NOTHING;
INSERT INTO rollup_traj_hours SELECT DISTINCT project_id, hour FROM rollup_dirty WHERE kind = 'trajectory_hour'
    ON CONFLICT DO NOTHING;
INSERT INTO rollup_fb_hours SELECT DISTINCT project_id, date_trunc('hour', occurred_at)
    FROM feedback_feedbackevent WHERE id > %(feedback)s ON CONFLICT DO NOTHING;
INSERT INTO rollup_fb_hours SELECT DISTINCT fe.project_id, date_trunc('hour', fe.occurred_at)
    FROM feedback_feedbackevent fe WHERE fe.trajectory_id > %(trajectory)s ON CONFLICT DO NOTHING;
INSERT INTO rollup_traj_hours SELECT DISTINCT project_id, date_trunc('hour', occurred_at)
    FROM feedback_trajectory WHERE id > %(trajectory)s ON CONFLICT DO NOTHING;
INSERT INTO rollup_traj_hours SELECT DISTINCT t.project_id, date_trunc('hour', t.occurred_at)
    FROM training_reward r JOIN feedback_trajectory t ON t.id = r.trajectory_id
    WHERE r.computed_at > %(reward_at)s ON CONFLICT DO NOTHING;
-- A new accept changes its trajectory's hour (the usefulness columns), whenever it came.
INSERT INTO rollup_traj_hours SELECT DISTINCT t.project_id, date_trunc('hour', t.occurred_at)
    FROM feedback_feedbackevent fe JOIN feedback_trajectory t ON t.id = fe.trajectory_id
    WHERE fe.id > %(feedback)s AND fe.signal = 'accept' ON CONFLICT DO NOTHING;
INSERT INTO rollup_versions
    SELECT t.project_id, t.policy_version FROM training_rubricscore rs
        JOIN feedback_trajectory t ON t.id = rs.trajectory_id WHERE rs.id > %(rubric)s
    UNION
    SELECT t.project_id, t.policy_version FROM feedback_feedbackevent fe
        JOIN feedback_trajectory t ON t.id = fe.trajectory_id
        WHERE fe.aspect_labels IS NOT NULL AND (fe.id > %(feedback)s OR t.id > %(trajectory)s)
    UNION
    SELECT project_id, policy_version FROM rollup_dirty WHERE kind = 'version';
"""

_FEEDBACK = """
DELETE FROM webapp_feedbackhourly f USING rollup_fb_hours h
    WHERE f.project_id = h.project_id AND f.hour = h.hour AND h.project_id = %(project)s;
INSERT INTO webapp_feedbackhourly (project_id, policy_version, hour, signal, n)
SELECT fe.project_id, t.policy_version, h.hour, fe.signal, count(*)
FROM rollup_fb_hours h
JOIN feedback_feedbackevent fe ON fe.project_id = h.project_id
    AND fe.occurred_at >= h.hour AND fe.occurred_at < h.hour + interval '1 hour'
LEFT JOIN feedback_trajectory t ON t.id = fe.trajectory_id
WHERE h.project_id = %(project)s
GROUP BY 1, 2, 3, 4;
"""

_TRAJECTORIES = """
DELETE FROM webapp_trajectoryhourly f USING rollup_traj_hours h
    WHERE f.project_id = h.project_id AND f.hour = h.hour AND h.project_id = %(project)s;
INSERT INTO webapp_trajectoryhourly (project_id, policy_version, hour, trajectories, rewarded, reward_sum,
                                     live, live_accepted, live_accepted_chars)
SELECT t.project_id, t.policy_version, h.hour, count(*), count(r.total), coalesce(sum(r.total), 0),
       count(*) FILTER (WHERE t.source = 'live'), count(*) FILTER (WHERE t.source = 'live' AND a.n > 0),
       coalesce(sum(a.chars) FILTER (WHERE t.source = 'live'), 0)
FROM rollup_traj_hours h
JOIN feedback_trajectory t ON t.project_id = h.project_id
    AND t.occurred_at >= h.hour AND t.occurred_at < h.hour + interval '1 hour'
LEFT JOIN LATERAL (
    SELECT r.total FROM training_reward r JOIN training_rewardspec s ON s.id = r.spec_id
    WHERE r.trajectory_id = t.id ORDER BY s.version DESC LIMIT 1
) r ON true
CROSS JOIN LATERAL (
    SELECT count(*) AS n, sum(fe.value) AS chars FROM feedback_feedbackevent fe
    WHERE fe.trajectory_id = t.id AND fe.project_id = t.project_id AND fe.signal = 'accept'
) a
WHERE h.project_id = %(project)s
GROUP BY 1, 2, 3;
"""

# Judge scores and human labels of the touched versions' trajectories, one row per score.
_SCORES = """
scored AS (
    SELECT t.id AS tid, t.project_id, t.policy_version, t.task, t.tags, rs.aspect, 'judge' AS source,
           rs.score
    FROM rollup_versions v
    JOIN feedback_trajectory t ON t.project_id = v.project_id
        AND t.policy_version IS NOT DISTINCT FROM v.policy_version
    JOIN training_rubricscore rs ON rs.trajectory_id = t.id
    WHERE v.project_id = %(project)s
    UNION ALL
    SELECT t.id, t.project_id, t.policy_version, t.task, t.tags, l.key, 'human', l.value::float
    FROM rollup_versions v
    JOIN feedback_trajectory t ON t.project_id = v.project_id
        AND t.policy_version IS NOT DISTINCT FROM v.policy_version
    JOIN feedback_feedbackevent fe ON fe.trajectory_id = t.id AND fe.aspect_labels IS NOT NULL
    CROSS JOIN LATERAL jsonb_each_text(
        CASE WHEN jsonb_typeof(fe.aspect_labels) = 'object' THEN fe.aspect_labels ELSE '{}'::jsonb END) l
    WHERE v.project_id = %(project)s
)
"""

_RUBRIC = f"""
DELETE FROM webapp_rubricrollup r USING rollup_versions v
    WHERE r.project_id = v.project_id AND r.policy_version IS NOT DISTINCT FROM v.policy_version
        AND v.project_id = %(project)s;
DELETE FROM webapp_agreementrollup r USING rollup_versions v
    WHERE r.project_id = v.project_id AND r.policy_version IS NOT DISTINCT FROM v.policy_version
        AND v.project_id = %(project)s;
WITH {_SCORES}
INSERT INTO webapp_rubricrollup (project_id, policy_version, task, tag, aspect, source, bin, n, score_sum)
SELECT s.project_id, s.policy_version, s.task, tg.tag, s.aspect, s.source,
       CASE WHEN s.score IS NULL THEN -1 ELSE least(greatest(floor(s.score * 10), 0), 9)::int END,
       count(*), coalesce(sum(s.score), 0)
FROM scored s {_TAGS.format(t="s")}
GROUP BY 1, 2, 3, 4, 5, 6, 7;
WITH {_SCORES},
pairs AS (
    SELECT tid, project_id, policy_version, task, tags, aspect,
           avg(score) FILTER (WHERE source = 'judge') AS judge,
           avg(score) FILTER (WHERE source = 'human') AS human
    FROM scored GROUP BY 1, 2, 3, 4, 5, 6
)
INSERT INTO webapp_agreementrollup (project_id, policy_version, task, tag, aspect, pairs, agree, abs_err_sum)
SELECT p.project_id, p.policy_version, p.task, tg.tag, p.aspect, count(*),
       count(*) FILTER (WHERE abs(p.judge - p.human) <= 0.2), sum(abs(p.judge - p.human))
FROM pairs p {_TAGS.format(t="p")}
WHERE p.judge IS NOT NULL AND p.human IS NOT NULL
GROUP BY 1, 2, 3, 4, 5;
"""


def _watermarks() -> dict[str, Any]:
    marks = {m.name: m for m in RollupWatermark.objects.select_for_update()}
    out: dict[str, Any] = {name: marks[name].last_id if name in marks else 0 for name in _SOURCES}
    reward = marks.get("reward")
    out["reward_at"] = (reward.at - LAG) if reward and reward.at else datetime(1970, 1, 1, tzinfo=UTC)
    return out


def _advance(cur: Any, marks: dict[str, Any], start: datetime) -> dict[str, int]:
    new: dict[str, int] = {}
    for name, (table, received) in _SOURCES.items():
        cur.execute(f"SELECT coalesce(max(id), %s) FROM {table} WHERE id > %s AND {received} <= %s",
                    [marks[name], marks[name], start - LAG])
        new[name] = cur.fetchone()[0]
        RollupWatermark.objects.update_or_create(name=name, defaults={"last_id": new[name]})
    RollupWatermark.objects.update_or_create(name="reward", defaults={"at": start})
    return new


def _count(cur: Any, table: str) -> int:
    cur.execute(f"SELECT count(*) FROM {table}")
    return cur.fetchone()[0]


_PROJECTS = """
SELECT project_id FROM rollup_fb_hours UNION SELECT project_id FROM rollup_traj_hours
UNION SELECT project_id FROM rollup_versions ORDER BY 1
"""


def _project_refresh(cur: Any, project_id: int) -> str | None:
    """Recomputes one project's touched units in a savepoint; the error when its rows broke the
    SQL (a label of 1e308 overflows the sums), so that project is skipped and the others go on."""
    try:
        with transaction.atomic():
            for sql in (_FEEDBACK, _TRAJECTORIES, _RUBRIC):
                cur.execute(sql, {"project": project_id})
    except DatabaseError as exc:
        return f"{type(exc).__name__}: {str(exc).strip()}"
    return None


def _units(cur: Any, project_id: int) -> dict[str, list[str]]:
    out = {}
    for name, sql in (("feedback_hours", "SELECT hour FROM rollup_fb_hours WHERE project_id = %s ORDER BY 1"),
                      ("trajectory_hours", "SELECT hour FROM rollup_traj_hours WHERE project_id = %s ORDER BY 1"),
                      ("versions", "SELECT policy_version FROM rollup_versions WHERE project_id = %s ORDER BY 1")):
        cur.execute(sql, [project_id])
        out[name] = [str(r[0]) for r in cur.fetchall()][:50]
    return out


def rollups_refresh() -> dict[str, int]:
    """Recomputes the rollup rows touched since the last refresh; returns what it touched.

    Each project is recomputed in its own savepoint: one whose rows break the SQL is quarantined
    (kind "rollup", with the units it could not refresh) and skipped, never blocking the others.
    Its units are not retried (the watermarks move on): fix the rows, then `rollups_rebuild()`."""
    start = timezone.now()
    failed: list[tuple[int, str, dict[str, list[str]]]] = []
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK_KEY])
        marks = _watermarks()
        cur.execute(_TOUCHED, marks)
        touched = {"feedback_hours": _count(cur, "rollup_fb_hours"),
                   "trajectory_hours": _count(cur, "rollup_traj_hours"),
                   "rubric_versions": _count(cur, "rollup_versions")}
        cur.execute(_PROJECTS)
        for (project_id,) in cur.fetchall():
            error = _project_refresh(cur, project_id)
            if error is not None:
                failed.append((project_id, error, _units(cur, project_id)))
        _advance(cur, marks, start)
    for project_id, error, units in failed:
        quarantine_record(project_id, "rollup", "rollup refresh", error, detail={"at": start.isoformat(), **units})
    touched["projects_failed"] = len(failed)
    return touched


# What a rebuild reads whole. After a bulk load their statistics are those of the empty tables
# until autovacuum gets to them, and the planner's nested loops over "no rows" then took over 15
# minutes at 1M events (1.4 s once analysed): a rebuild analyses them first.
_REBUILD_READS = ("feedback_trajectory", "feedback_feedbackevent", "training_reward", "training_rubricscore")


def rollups_rebuild() -> dict[str, int]:
    """Forgets the watermarks and recomputes every rollup row (after a bulk load), on fresh
    statistics of the tables it reads."""
    with connection.cursor() as cur:
        cur.execute("ANALYZE " + ", ".join(_REBUILD_READS))
    RollupWatermark.objects.all().delete()
    return rollups_refresh()
