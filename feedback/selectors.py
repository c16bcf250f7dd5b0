"""Reads of the feedback app: query shaping for the API and the dashboard."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from itertools import groupby
from typing import Any

from django.db.models import F, Prefetch, QuerySet, TextField
from django.db.models.fields.json import KT
from django.db.models.functions import Cast

from core.errors import BadRequest, NotFound
from feedback import export
from feedback.models import FeedbackEvent, Project, Step, Trajectory


def project_get(slug: str) -> Project:
    project = Project.objects.filter(slug=slug).first()
    if project is None:
        raise NotFound(f"no project {slug!r}", "Check the slug (see the admin's project list).")
    return project


def _with_children(queryset: QuerySet[Trajectory]) -> QuerySet[Trajectory]:
    return queryset.prefetch_related(
        Prefetch("steps", queryset=Step.objects.order_by("index")),
        Prefetch("feedback_events", queryset=FeedbackEvent.objects.order_by("occurred_at", "id")),
    )


def trajectory_list(
    project: Project,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    policy_version: int | None = None,
    signal: str | None = None,
    task: str | None = None,
    source: str | None = None,
) -> QuerySet[Trajectory]:
    queryset = Trajectory.objects.filter(project=project)
    if since is not None:
        queryset = queryset.filter(occurred_at__gte=since)
    if until is not None:
        queryset = queryset.filter(occurred_at__lt=until)
    if policy_version is not None:
        queryset = queryset.filter(policy_version=policy_version)
    if task:
        queryset = queryset.filter(task=task)
    if source:
        queryset = queryset.filter(source=source)
    if signal:
        queryset = queryset.filter(
            id__in=FeedbackEvent.objects.filter(project=project, signal=signal).values("trajectory_id")
        )
    return _with_children(queryset)


def trajectory_get(project: Project, external_id: str) -> Trajectory:
    trajectory = _with_children(Trajectory.objects.filter(project=project, external_id=external_id)).first()
    if trajectory is None:
        raise NotFound(f"no trajectory {external_id[:80]!r} in project {project.slug!r}",
                       "Check the id; it is the one your product sent (or the serving endpoint returned).")
    return trajectory


# --- dataset export --------------------------------------------------------------------------

EXPORT_CHUNK = 500  # trajectories fetched (with their steps and events) per round trip


def dataset_rows(project: Project, fmt: export.Format, **filters: Any) -> Iterator[dict[str, Any]]:
    """Rows of `fmt` (see feedback/export.py), oldest first, streamed from a server-side cursor in
    chunks of EXPORT_CHUNK trajectories: memory stays flat however big the project is.
    `filters`: those of `trajectory_list` (since, until, policy_version, signal, task, source)."""
    if fmt not in export.FORMATS:
        raise BadRequest(f"unknown format {str(fmt)[:40]!r}", f"Use one of: {', '.join(export.FORMATS)}.")
    queryset = trajectory_list(project, **filters)
    if fmt == "preference":
        return export.preference_rows(_groups(queryset))
    rows = export.messages_rows if fmt == "messages" else export.kto_rows
    return rows(queryset.order_by("occurred_at", "id").iterator(chunk_size=EXPORT_CHUNK))


def _groups(queryset: QuerySet[Trajectory]) -> Iterator[list[Trajectory]]:
    """Runs of trajectories answering one prompt: the same sampling `group`, else (no group) the
    same prompt messages. The database sorts by that key so a group is contiguous in the stream."""
    keyed = queryset.annotate(group_key=KT("extra__group"), prompt_key=Cast("prompt", TextField())).order_by(
        F("group_key").asc(nulls_last=True), "prompt_key", "occurred_at", "id")
    rows = keyed.iterator(chunk_size=EXPORT_CHUNK)
    for _, run in groupby(rows, key=lambda t: ("g", t.group_key) if t.group_key is not None else ("p", t.prompt_key)):
        yield list(run)
