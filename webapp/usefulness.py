"""Reads for the overview: what each version is worth to its users, and what it writes now.

A fixed number of queries whatever the row counts, like webapp.selectors. The rules of what a
suggestion is worth and of an invented name are training.rewards.usefulness's, applied to the
suggestion's first line as the gate's naturalness rows apply them (training.gate.naturalness).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import F, Prefetch, Sum, Window
from django.db.models.functions import RowNumber

from feedback.models import FeedbackEvent, Project, Step, Trajectory
from training.gate.naturalness import invented_counts
from training.rewards.usefulness import first_line, known_names

NAME_SAMPLE = 100  # newest suggestions per version the invented-name share is measured on
RECENT = 5  # suggestions per version in "what it writes now"


def accepted_chars_by_version(project: Project, numbers: list[int], since: datetime) -> dict[int, float]:
    """version -> characters the users accepted over the range (the `value` of their accepts: a
    partial accept keeps part of a line; an accept without a value counts none)."""
    rows = (FeedbackEvent.objects.filter(project=project, signal="accept", trajectory__source="live",
                                         trajectory__policy_version__in=numbers, trajectory__occurred_at__gte=since)
            .values_list("trajectory__policy_version").annotate(chars=Sum("value")).order_by())
    return {number: float(chars or 0) for number, chars in rows}


def newest_suggestions(project: Project, numbers: list[int], since: datetime,
                       per_version: int = NAME_SAMPLE) -> list[Trajectory]:
    """The newest `per_version` live suggestions of each version in the range, with their completion
    steps and clicks (three queries)."""
    rank = Window(RowNumber(), partition_by=[F("policy_version")], order_by=F("id").desc())
    return list(
        Trajectory.objects.filter(project=project, source="live", policy_version__in=numbers, occurred_at__gte=since)
        .only("id", "policy_version", "prompt", "occurred_at").annotate(rank=rank).filter(rank__lte=per_version)
        .order_by("policy_version", "-id")
        .prefetch_related(
            Prefetch("steps", queryset=Step.objects.filter(role="assistant").only("trajectory_id", "index", "content")
                     .order_by("index")),
            Prefetch("feedback_events", queryset=FeedbackEvent.objects.only("trajectory_id", "signal", "value")
                     .order_by("occurred_at", "id")))
    )


def _texts(t: Trajectory) -> tuple[str, str]:
    messages = t.prompt if isinstance(t.prompt, list) else []
    prompt = str(messages[-1].get("content", "")) if messages and isinstance(messages[-1], dict) else ""
    return prompt, "".join(s.content for s in t.steps.all())


def writes_now(project: Project, numbers: list[int], since: datetime) -> dict[int, dict[str, Any]]:
    """version -> its invented-name share (of its newest shown suggestions, against the names in the
    code the users sent in those prompts and Python's: a suggestion naming what exists in neither)
    and its newest suggestions with their clicks."""
    sample = newest_suggestions(project, numbers, since)
    texts = {t.id: _texts(t) for t in sample}
    known = known_names(prompt for prompt, _ in texts.values())
    out: dict[int, dict[str, Any]] = {}
    for t in sample:
        prompt, completion = texts[t.id]
        row = out.setdefault(t.policy_version, {"shown": 0, "invented": 0, "recent": []})
        if completion.strip():
            row["shown"] += 1
            row["invented"] += invented_counts(completion, prompt, known)[0] > 0
        if len(row["recent"]) < RECENT:
            clicks = [f"{e.signal} {e.value:g}" if e.value is not None else e.signal for e in t.feedback_events.all()]
            row["recent"].append({"id": t.id, "typed": prompt.rsplit("\n", 1)[-1][-60:],
                                  "suggestion": first_line(completion) if completion.strip() else "",
                                  "clicks": clicks})
    for row in out.values():
        row["invented_share"] = row["invented"] / row["shown"] if row["shown"] else None
    return out
