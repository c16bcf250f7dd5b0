"""Reads of the feedback app: query shaping for the API and the dashboard."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Prefetch, QuerySet

from core.errors import NotFound
from feedback.models import FeedbackEvent, Project, Quarantine, Step, Trajectory


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


def quarantine_recent(project: Project, limit: int = 10) -> list[Quarantine]:
    """The items the project's queues set aside most recently (newest first)."""
    return list(Quarantine.objects.filter(project=project).order_by("-last_at", "-id")[:limit])
