"""Reads for the overview: what each version is worth to its users, and what it writes now.

A fixed number of queries whatever the row counts, like webapp.selectors. The rules of what a
suggestion is worth and of an invented name are training.rewards.usefulness's, applied to the
suggestion's first line as the gate's naturalness rows apply them (training.gate.naturalness).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection

from feedback.models import FeedbackEvent, Project
from training.gate.naturalness import invented_counts
from training.rewards.usefulness import first_line, known_names

NAME_SAMPLE = 100  # newest suggestions per version the invented-name share is measured on
RECENT = 5  # suggestions per version in "what it writes now"


@dataclass(frozen=True)
class Served:
    served: int  # live completions of the version in the range
    accepted: int  # of them, those the users accepted (at least one accept)
    chars: float  # characters their accepts kept (the accepts' values)


# Whole hours from TrajectoryHourly, the rest counted from the raw rows as the rollup counts them:
# one lookup of a trajectory's accepts each, on the trajectory index of the feedback events.
_SERVED = """
SELECT policy_version, sum(n)::bigint, sum(a)::bigint, sum(c)::float FROM (
    SELECT h.policy_version, h.live AS n, h.live_accepted AS a, h.live_accepted_chars AS c
    FROM webapp_trajectoryhourly h
    WHERE h.project_id = %(project)s AND h.policy_version = ANY(%(numbers)s::int[])
        AND h.hour >= %(head)s AND h.hour < %(cut)s
    UNION ALL
    SELECT t.policy_version, 1, (a.n > 0)::int, coalesce(a.chars, 0)
    FROM feedback_trajectory t
    CROSS JOIN LATERAL (
        SELECT count(*) AS n, sum(fe.value) AS chars FROM feedback_feedbackevent fe
        WHERE fe.trajectory_id = t.id AND fe.project_id = t.project_id AND fe.signal = 'accept'
    ) a
    WHERE t.project_id = %(project)s AND t.source = 'live' AND t.policy_version = ANY(%(numbers)s::int[])
        AND t.occurred_at >= %(since)s AND (t.occurred_at < %(head)s OR t.occurred_at >= %(cut)s)
) parts
GROUP BY 1
"""


def served_by_version(project: Project, numbers: list[int], since: datetime, cut: datetime) -> dict[int, Served]:
    """version -> its live completions since `since` (by the trajectory's occurred_at): whole hours
    from `hour_after(since)` to `cut` from TrajectoryHourly, the part hour before and everything
    from `cut` on from the raw rows (bounded by the (project, occurred_at) index). One query."""
    head = min(hour_after(since), cut)
    with connection.cursor() as cur:
        cur.execute(_SERVED, {"project": project.id, "numbers": numbers, "since": since, "head": head, "cut": cut})
        return {number: Served(n, a, c) for number, n, a, c in cur.fetchall()}


def hour_after(at: datetime) -> datetime:
    """The first whole hour at or after `at`."""
    floor = at.replace(minute=0, second=0, microsecond=0)
    return floor if floor == at else floor + timedelta(hours=1)


# Each version's newest live suggestions, read backwards on the index traj_live_version_id (never a
# rank over the whole range), with their last prompt message (a prompt may carry whole files) and
# the completion their assistant steps make.
_NEWEST = """
SELECT t.id, t.policy_version, (CASE WHEN jsonb_typeof(t.prompt) = 'array' THEN t.prompt -> -1 END)::text,
       coalesce((SELECT string_agg(s.content, '' ORDER BY s.index) FROM feedback_step s
                 WHERE s.trajectory_id = t.id AND s.role = 'assistant'), '')
FROM unnest(%s::int[]) v(number) CROSS JOIN LATERAL (
    SELECT t.id, t.policy_version, t.prompt FROM feedback_trajectory t
    WHERE t.project_id = %s AND t.source = 'live' AND t.policy_version = v.number AND t.occurred_at >= %s
    ORDER BY t.id DESC LIMIT %s) t
ORDER BY t.policy_version, t.id DESC
"""


@dataclass(frozen=True)
class Suggestion:
    id: int
    policy_version: int
    prompt: str  # the last prompt message's content: the code the user had typed
    completion: str


def newest_suggestions(project: Project, numbers: list[int], since: datetime,
                       per_version: int = NAME_SAMPLE) -> list[Suggestion]:
    """The newest `per_version` live suggestions of each version in the range (one query)."""
    with connection.cursor() as cur:
        cur.execute(_NEWEST, [numbers, project.id, since, per_version])
        return [Suggestion(id_, version, _content(json.loads(last) if last else None), completion)
                for id_, version, last, completion in cur.fetchall()]


def _content(message: Any) -> str:
    return str(message.get("content", "")) if isinstance(message, dict) else ""


def _clicks(trajectory_ids: list[int]) -> dict[int, list[str]]:
    """The clicks of the few suggestions shown, in order (one query: not the whole sample's)."""
    out: dict[int, list[str]] = {i: [] for i in trajectory_ids}
    rows = (FeedbackEvent.objects.filter(trajectory_id__in=trajectory_ids).order_by("occurred_at", "id")
            .values_list("trajectory_id", "signal", "value"))
    for trajectory_id, signal, value in rows:
        out[trajectory_id].append(f"{signal} {value:g}" if value is not None else signal)
    return out


def writes_now(project: Project, numbers: list[int], since: datetime) -> dict[int, dict[str, Any]]:
    """version -> its invented-name share (of its newest shown suggestions, against the names in the
    code the users sent in those prompts and Python's: a suggestion naming what exists in neither)
    and its newest suggestions with their clicks."""
    sample = newest_suggestions(project, numbers, since)
    known = known_names(t.prompt for t in sample)
    out: dict[int, dict[str, Any]] = {}
    for t in sample:
        prompt, completion = t.prompt, t.completion
        row = out.setdefault(t.policy_version, {"shown": 0, "invented": 0, "recent": []})
        if completion.strip():
            row["shown"] += 1
            row["invented"] += invented_counts(completion, prompt, known)[0] > 0
        if len(row["recent"]) < RECENT:
            row["recent"].append({"id": t.id, "typed": prompt.rsplit("\n", 1)[-1][-60:],
                                  "suggestion": first_line(completion) if completion.strip() else ""})
    clicks = _clicks([r["id"] for row in out.values() for r in row["recent"]])
    for row in out.values():
        row["invented_share"] = row["invented"] / row["shown"] if row["shown"] else None
        for r in row["recent"]:
            r["clicks"] = clicks[r["id"]]
    return out
