"""Reads of the feedback app: query shaping for the API and the dashboard."""

from __future__ import annotations

from datetime import datetime

from django.db.models import IntegerField, JSONField, Prefetch, QuerySet
from django.db.models.expressions import RawSQL

from core.errors import NotFound
from feedback.models import FeedbackEvent, Project, Step, Trajectory


def project_get(slug: str) -> Project:
    project = Project.objects.filter(slug=slug).first()
    if project is None:
        raise NotFound(f"no project {slug!r}", "Check the slug (see the admin's project list).")
    return project


# A step's per-token arrays: what a read summarises past `max_tokens`.
TOKEN_ARRAYS = ("token_ids", "logprobs", "routing")


def _steps(max_tokens: int | None) -> QuerySet[Step]:
    """Steps in order; with `max_tokens`, each per-token array is cut to its first `max_tokens`
    items by PostgreSQL (the rest never leaves the database) as `<array>_head`, and
    `token_count` says how many ids the step holds."""
    steps = Step.objects.order_by("index")
    if max_tokens is None:
        return steps
    path = f"$[0 to {max(max_tokens, 1) - 1}]"
    heads = {f"{name}_head": RawSQL(f"CASE WHEN jsonb_typeof(feedback_step.{name}) = 'array' "  # noqa: S608 - fixed names
                                     f"THEN jsonb_path_query_array(feedback_step.{name}, %s::jsonpath) END", [path],
                                     output_field=JSONField())
             for name in TOKEN_ARRAYS}
    count = RawSQL("CASE WHEN jsonb_typeof(feedback_step.token_ids) = 'array' "
                   "THEN jsonb_array_length(feedback_step.token_ids) ELSE 0 END", [], output_field=IntegerField())
    return steps.defer(*TOKEN_ARRAYS).annotate(token_count=count, **heads)


def _with_children(queryset: QuerySet[Trajectory], max_tokens: int | None = None) -> QuerySet[Trajectory]:
    return queryset.prefetch_related(
        Prefetch("steps", queryset=_steps(max_tokens)),
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
    max_tokens: int | None = None,
) -> QuerySet[Trajectory]:
    """Newest first, with steps and feedback; `max_tokens` summarises long steps (see `_steps`)."""
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
    return _with_children(queryset, max_tokens)


def trajectory_get(project: Project, external_id: str, max_tokens: int | None = None) -> Trajectory:
    trajectory = _with_children(Trajectory.objects.filter(project=project, external_id=external_id), max_tokens).first()
    if trajectory is None:
        raise NotFound(f"no trajectory {external_id[:80]!r} in project {project.slug!r}",
                       "Check the id; it is the one your product sent (or the serving endpoint returned).")
    return trajectory
