"""Writes from the dashboard: a person's decision on a policy version goes to the promotion service."""

from __future__ import annotations

from typing import Any

from core.errors import BadRequest
from training.models import PolicyVersion
from training.promotion.services import candidate_promote

ACTIONS = ("approve", "reject", "rollback")


def version_decide(version: PolicyVersion, actor: Any, action: str, reason: str) -> PolicyVersion:
    """Approve, reject or roll back `version` through training.promotion.candidate_promote."""
    if action not in ACTIONS:
        raise BadRequest(f"unknown action {action!r}", f"Use one of {', '.join(ACTIONS)}.")
    if not reason.strip():
        raise BadRequest("a reason is required", "Say why, in a few words: it goes into the audit log.")
    # The service audits the decision and pushes {"type": "policy_version", ...} to the dashboard.
    return candidate_promote(version, actor, action, reason.strip())
