"""Reads of the feedback app: query shaping for the API and the dashboard."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from itertools import groupby
from typing import Any

from django.db.models import (
    BigIntegerField,
    Exists,
    F,
    IntegerField,
    JSONField,
    OuterRef,
    Prefetch,
    Q,
    QuerySet,
    TextField,
)
from django.db.models.expressions import RawSQL
from django.db.models.fields.json import KT
from django.db.models.functions import Cast

from core.errors import BadRequest, NotFound
from feedback import export
from feedback.auth import SLUG, Principal
from feedback.models import ConsentOptOut, FeedbackEvent, Membership, Project, Quarantine, Step, Trajectory


def project_get(slug: str) -> Project:
    project = Project.objects.filter(slug=slug).first()
    if project is None:
        raise NotFound(f"no project {slug!r}", "Check the slug (see the admin's project list).")
    return project


# --- who may see and decide what (per-project membership) ----------------------------------------


def principal_user(principal: Any) -> Any:
    """The account a caller acts as: a logged-in user, or the owner an API key is bound to
    (None for a key bound to nobody, a webhook, or a system actor)."""
    if isinstance(principal, Principal):
        return principal.owner
    if isinstance(principal, str) or principal is None or not getattr(principal, "is_authenticated", False):
        return None
    return principal


def member_role(user: Any, project_id: int) -> str | None:
    """`user`'s role in the project, or None. Inactive accounts have none; a superuser is a
    member only where a Membership row says so (docs/architecture.md, "Who sees what")."""
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return None
    return Membership.objects.filter(project_id=project_id, user_id=user.pk).values_list("role", flat=True).first()


def role_at_least(role: str | None, needed: str) -> bool:
    return role is not None and Membership.RANK[role] >= Membership.RANK[needed]


def principal_role(principal: Any, project_id: int) -> str | None:
    """The role a caller holds in the project: a key counts as its owner, and only in its own
    project (a key bound to nobody is a viewer of its project: it reads what its scopes allow)."""
    if isinstance(principal, Principal):
        if principal.project.id != project_id:
            return None
        return member_role(principal.owner, project_id) if principal.owner is not None else "viewer"
    return member_role(principal_user(principal), project_id)


def project_not_found(slug: str) -> NotFound:
    # The same answer for a project that does not exist and one the caller is no member of.
    return NotFound(f"there is no project {str(slug)[:64]!r} you are a member of",
                    "Pick one of your projects on the dashboard's front page, or ask the project's admin to add you.")


def project_for_member(principal: Any, slug: str) -> tuple[Project, str]:
    """The project `slug` and the caller's role in it; NotFound when it does not exist or the
    caller is no member of it (another project's existence is not disclosed)."""
    # A slug no project can have (a NUL, 5,000 characters) is looked up nowhere: the same 404.
    is_slug = isinstance(slug, str) and SLUG.fullmatch(slug) is not None
    project = Project.objects.filter(slug=slug).first() if is_slug else None
    role = principal_role(principal, project.id) if project is not None else None
    if project is None or role is None:
        raise project_not_found(slug)
    return project, role


def in_project(project: Project) -> Q:
    """The rows of `project` (trajectories, feedback), its id hidden from the planner (an InitPlan),
    for a look-up by the project's own unique key: a trajectory's or an event's id.

    Given the literal id, the planner estimates the project's rows from the table's statistics,
    and a project that grew after the last ANALYZE (autovacuum analyses a table after a tenth of
    it changed) looks empty: every index that leads with project_id then ties with the unique one,
    and it took one with a filter, reading all of the project's rows (40 ms against 0.3 for one
    trajectory of a 200,000-trajectory project). Hidden, the project is estimated by the number of
    projects, and the unique index always wins."""
    return Q(project_id=RawSQL("(SELECT %s::bigint)", [project.pk], output_field=BigIntegerField()))


def projects_of(user: Any) -> QuerySet[Project]:
    """The projects `user` is a member of, by slug."""
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return Project.objects.none()
    return Project.objects.filter(memberships__user_id=user.pk).order_by("slug")


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
    trajectory = _with_children(Trajectory.objects.filter(in_project(project), external_id=external_id),
                                max_tokens).first()
    if trajectory is None:
        raise NotFound(f"no trajectory {external_id[:80]!r} in project {project.slug!r}",
                       "Check the id; it is the one your product sent (or the serving endpoint returned).")
    return trajectory


def quarantine_recent(project: Project, limit: int = 10) -> list[Quarantine]:
    """The items the project's queues set aside most recently (newest first)."""
    return list(Quarantine.objects.filter(project=project).order_by("-last_at", "-id")[:limit])


# --- consent: what may be trained on ------------------------------------------------------------


def trainable(queryset: QuerySet, trajectory: str = "") -> QuerySet:
    """`queryset` (of trajectories, or of rows reaching one through `trajectory`, e.g.
    "trajectory" for rewards) without what may not be trained on: a trajectory sent with consent
    "no_train" (or under a project default of it), one served to a user who opted out, and one
    carrying feedback that may not be trained on (sent "no_train", or from a user who opted out).
    Decided when the query runs, so an opt-out holds for every run that starts after it. Every
    reader that feeds training goes through here (runs, group-rollout prompts, the reward model,
    the dataset export)."""
    to = f"{trajectory}__" if trajectory else ""
    pk = f"{trajectory}_id" if trajectory else "pk"
    served_to_opted_out = ConsentOptOut.objects.filter(project_id=OuterRef(f"{to}project_id"),
                                                       user_hash=OuterRef(f"{to}user_hash"))
    from_opted_out = ConsentOptOut.objects.filter(project_id=OuterRef("project_id"), user_hash=OuterRef("user_hash"))
    refused_feedback = FeedbackEvent.objects.filter(trajectory_id=OuterRef(pk)).filter(
        Q(no_train=True) | Exists(from_opted_out))
    return queryset.filter(**{f"{to}no_train": False}).exclude(Exists(served_to_opted_out)).exclude(
        Exists(refused_feedback))


# --- dataset export --------------------------------------------------------------------------

EXPORT_CHUNK = 500  # trajectories fetched (with their steps and events) per round trip


def dataset_rows(project: Project, fmt: export.Format, **filters: Any) -> Iterator[dict[str, Any]]:
    """Rows of `fmt` (see feedback/export.py), oldest first, streamed from a server-side cursor in
    chunks of EXPORT_CHUNK trajectories: memory stays flat however big the project is.
    `filters`: those of `trajectory_list` (since, until, policy_version, signal, task, source)."""
    if fmt not in export.FORMATS:
        raise BadRequest(f"unknown format {str(fmt)[:40]!r}", f"Use one of: {', '.join(export.FORMATS)}.")
    queryset = trainable(trajectory_list(project, **filters))  # an export is a training set
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
