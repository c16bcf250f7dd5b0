"""Reads of users' data: one user's rows for a subject access export, and a project's data
overview (retention, consent share, redaction counts) for the dashboard's Data page.

    .venv/bin/python -m pytest tests/feedback/test_users_data.py -q
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.db.models import Count, Q

from feedback.models import ConsentOptOut, FeedbackEvent, Project, Trajectory
from feedback.services import data_policy_of, user_hash_of

EXPORT_CHUNK = 200
DATA_POLICY_FIELDS = ("consent_default", "retention_days", "erasure_policy", "redactors", "custom_patterns")


def data_policy_json(project: Project) -> dict[str, Any]:
    """The project's data policy as JSON (an audit row's before/after, the API's answer)."""
    policy = data_policy_of(project)
    return {name: getattr(policy, name) for name in DATA_POLICY_FIELDS}


def user_export_rows(project: Project, user: str | int) -> Iterator[dict[str, Any]]:
    """Everything stored about one user, one JSON object per row: the trajectories served to them
    (prompt, steps with text and token ids), their feedback on anyone's trajectory, and whether
    they opted out. Streamed (a server-side cursor): memory stays flat."""
    hashed = user_hash_of(project, user)
    yield {"type": "user", "project": project.slug, "user_hash": hashed,
           "opted_out": ConsentOptOut.objects.filter(project=project, user_hash=hashed).exists()}
    trajectories = (Trajectory.objects.filter(project=project, user_hash=hashed).prefetch_related("steps")
                    .order_by("occurred_at", "id"))
    for t in trajectories.iterator(chunk_size=EXPORT_CHUNK):
        yield {"type": "trajectory", "id": t.external_id, "policy_version": t.policy_version, "source": t.source,
               "task": t.task, "tags": t.tags, "prompt": t.prompt, "extra": t.extra, "no_train": t.no_train,
               "occurred_at": t.occurred_at.isoformat(), "received_at": t.received_at.isoformat(),
               "steps": [{"index": s.index, "role": s.role, "content": s.content, "tool_calls": s.tool_calls,
                          "token_ids": s.token_ids, "reward": s.reward, "extra": s.extra} for s in t.steps.all()]}
    events = FeedbackEvent.objects.filter(project=project, user_hash=hashed).order_by("occurred_at", "id")
    for e in events.iterator(chunk_size=EXPORT_CHUNK):
        yield {"type": "feedback", "id": e.event_id, "trajectory_id": e.trajectory_external_id, "signal": e.signal,
               "value": e.value, "step": e.step, "aspect_labels": e.aspect_labels, "extra": e.extra,
               "no_train": e.no_train, "occurred_at": e.occurred_at.isoformat(),
               "received_at": e.received_at.isoformat()}


def data_overview(project: Project) -> dict[str, Any]:
    """Retention, consent and opt-outs of a project (the Data page; redaction counts and erasures
    are added by the dashboard's selector from /metrics' counters and the training app)."""
    policy = data_policy_of(project)
    shares = Trajectory.objects.filter(project=project).aggregate(
        total=Count("id"), no_train=Count("id", filter=Q(no_train=True)),
        with_user=Count("id", filter=~Q(user_hash="")))
    oldest = Trajectory.objects.filter(project=project).order_by("received_at").values_list(
        "received_at", flat=True).first()
    return {"consent_default": policy.consent_default, "retention_days": policy.retention_days,
            "erasure_policy": policy.erasure_policy, "redactors": policy.redactors,
            "custom_patterns": [p.get("name") for p in policy.custom_patterns],
            "trajectories": shares["total"], "no_train": shares["no_train"], "with_user": shares["with_user"],
            "no_train_share": shares["no_train"] / shares["total"] if shares["total"] else None,
            "opted_out_users": ConsentOptOut.objects.filter(project=project).count(), "oldest": oldest}
