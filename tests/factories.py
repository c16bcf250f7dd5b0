"""Builders of signed requests and events for tests."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from standardwebhooks.webhooks import Webhook


def sign(secret: str, body: bytes | str, *, msg_id: str | None = None, at: datetime | None = None) -> dict[str, str]:
    text = body.decode() if isinstance(body, bytes) else body
    msg_id = msg_id or f"msg_{uuid.uuid4().hex}"
    at = at or datetime.now(tz=UTC)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": Webhook(secret).sign(msg_id, at, text),
    }


def as_django_headers(headers: dict[str, str]) -> dict[str, str]:
    return {"HTTP_" + k.upper().replace("-", "_"): v for k, v in headers.items()}


def member(user: Any, project: Any, role: str) -> Any:
    """Gives `user` `role` (viewer | approver | admin) in `project` and returns the user."""
    from feedback.services import membership_set  # Django is set up by the time a test calls this

    membership_set(project, user, role)
    return user


def trajectory(ident: str = "traj-1", **fields: Any) -> dict[str, Any]:
    event = {
        "type": "trajectory", "id": ident, "policy_version": 1, "task": "tab-completion",
        "prompt": [{"role": "user", "content": "def add(a, b):"}],
        "steps": [{"role": "assistant", "content": " return a + b", "token_ids": [17, 92, 5],
                   "logprobs": [-0.1, -0.7, -0.2]}],
        "occurred_at": "2026-11-29T08:00:00Z",
    }
    event.update(fields)
    return event


def feedback(ident: str = "fb-1", trajectory_id: str = "traj-1", signal: str = "accept", **fields: Any) -> dict:
    event = {"type": "feedback", "id": ident, "trajectory_id": trajectory_id, "signal": signal,
             "user": "u-42", "occurred_at": "2026-11-29T08:00:05Z"}
    event.update(fields)
    return event
