"""Validation of ingest events: plain Python, no Django, fast enough for 1,000 events a request.

Each `parse_*` returns a typed record or raises `EventError` whose message says what was wrong
with the event and how to fix it. The contract is in DESIGN.md ("The ingest contract").
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

MAX_ID_CHARS = 255
MAX_SIGNAL_CHARS = 64
MAX_TASK_CHARS = 100
MAX_ROLE_CHARS = 32
KNOWN_SIGNALS = frozenset({"happy", "sad", "accept", "reject", "edit_kept", "followup_dissatisfied"})
SOURCES = frozenset({"live", "simulated", "eval"})
EVENT_TYPES = ("trajectory", "feedback")
_TRAJECTORY_FIELDS = frozenset(
    {"type", "id", "policy_version", "task", "tags", "source", "prompt", "steps", "occurred_at"}
)
_FEEDBACK_FIELDS = frozenset(
    {"type", "id", "trajectory_id", "signal", "value", "step", "user", "occurred_at", "aspect_labels"}
)
_STEP_FIELDS = frozenset({"role", "content", "token_ids", "logprobs", "tool_calls", "routing", "reward"})


class EventError(ValueError):
    """One event is invalid; the message is sent back as that event's `reason`."""


@dataclass(slots=True)
class StepRecord:
    index: int
    role: str
    content: str
    tool_calls: str | None  # JSON text
    token_ids: str | None
    logprobs: str | None
    routing: str | None
    reward: float | None
    extra: str


@dataclass(slots=True)
class TrajectoryRecord:
    external_id: str
    policy_version: int | None
    source: str
    task: str
    tags: str  # JSON text
    prompt: str
    extra: str
    occurred_at: datetime
    steps: list[StepRecord] = field(default_factory=list)


@dataclass(slots=True)
class FeedbackRecord:
    event_id: str
    trajectory_external_id: str
    signal: str
    value: float | None
    step: int | None
    user_hash: str
    aspect_labels: str | None
    extra: str
    occurred_at: datetime


def event_identity(raw: Any) -> tuple[str | None, str | None]:
    """(type, id) of a raw event when they are usable, for the per-event answer."""
    if not isinstance(raw, dict):
        return None, None
    kind, ident = raw.get("type"), raw.get("id")
    kind = kind if isinstance(kind, str) and len(kind) <= 32 else None
    ident = ident if isinstance(ident, str) and 0 < len(ident) <= MAX_ID_CHARS else None
    return kind, ident


def parse_event(raw: Any, now: datetime, user_salt: str) -> TrajectoryRecord | FeedbackRecord:
    if not isinstance(raw, dict):
        raise EventError(f"an event must be a JSON object, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind not in EVENT_TYPES:
        raise EventError(f"unknown type {_show(kind)}: use 'trajectory' or 'feedback'")
    _identifier(raw.get("id"), "id")
    if kind == "trajectory":
        return parse_trajectory(raw, now)
    return parse_feedback(raw, now, user_salt)


def parse_trajectory(raw: dict, now: datetime) -> TrajectoryRecord:
    steps = raw.get("steps", [])
    if not isinstance(steps, list):
        raise EventError("'steps' must be a list of {role, content, token_ids?, logprobs?}")
    tags = raw.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) and len(t) <= 100 for t in tags):
        raise EventError("'tags' must be a list of strings of at most 100 characters")
    source = raw.get("source", "live")
    if source not in SOURCES:
        raise EventError(f"unknown source {_show(source)}: use one of {sorted(SOURCES)}")
    return TrajectoryRecord(
        external_id=raw["id"],
        policy_version=_optional_int(raw.get("policy_version"), "policy_version"),
        source=source,
        task=_optional_str(raw.get("task"), "task", MAX_TASK_CHARS),
        tags=_json_text(tags, "tags"),
        prompt=_json_text(_prompt(raw.get("prompt")), "prompt"),
        extra=_json_text(_extra(raw, _TRAJECTORY_FIELDS), "extra fields"),
        occurred_at=_timestamp(raw.get("occurred_at"), now),
        steps=[_step(i, s) for i, s in enumerate(steps)],
    )


def parse_feedback(raw: dict, now: datetime, user_salt: str) -> FeedbackRecord:
    signal = raw.get("signal")
    if not isinstance(signal, str) or not (signal in KNOWN_SIGNALS or _is_custom(signal)):
        raise EventError(
            f"unknown signal {_show(signal)}: use one of {sorted(KNOWN_SIGNALS)} or 'custom:<name>'"
        )
    user = raw.get("user")
    if user is not None and not isinstance(user, str | int):
        raise EventError("'user' must be a string id (it is stored hashed)")
    labels = raw.get("aspect_labels")
    if labels is not None:
        if not isinstance(labels, dict) or not all(isinstance(k, str) for k in labels):
            raise EventError("'aspect_labels' must be an object of aspect name -> number")
        for name, score in labels.items():
            _finite(score, f"aspect_labels.{name}", required=True)
    return FeedbackRecord(
        event_id=raw["id"],
        trajectory_external_id=_identifier(raw.get("trajectory_id"), "trajectory_id"),
        signal=signal,
        value=_finite(raw.get("value"), "value"),
        step=_optional_int(raw.get("step"), "step"),
        user_hash=hash_user(str(user), user_salt) if user is not None else "",
        aspect_labels=_json_text(labels, "aspect_labels") if labels is not None else None,
        extra=_json_text(_extra(raw, _FEEDBACK_FIELDS), "extra fields"),
        occurred_at=_timestamp(raw.get("occurred_at"), now),
    )


def hash_user(user: str, salt: str) -> str:
    return hashlib.sha256(f"{salt}:{user}".encode()).hexdigest()


def _is_custom(signal: str) -> bool:
    name = signal.removeprefix("custom:")
    return signal.startswith("custom:") and 0 < len(signal) <= MAX_SIGNAL_CHARS and name.replace("_", "").isalnum()


def _step(index: int, raw: Any) -> StepRecord:
    where = f"steps[{index}]"
    if not isinstance(raw, dict):
        raise EventError(f"{where} must be an object with 'role' and 'content'")
    role = raw.get("role")
    if not isinstance(role, str) or not role or len(role) > MAX_ROLE_CHARS:
        raise EventError(f"{where}.role must be a non-empty string such as 'assistant'")
    content = raw.get("content", "")
    if not isinstance(content, str):
        raise EventError(f"{where}.content must be a string")
    if "\x00" in content:
        raise EventError(f"{where}.content contains a NUL character; remove it")
    token_ids, logprobs = raw.get("token_ids"), raw.get("logprobs")
    _tokens(token_ids, logprobs, where)
    extra_calls = raw.get("tool_calls")
    return StepRecord(
        index=index,
        role=role,
        content=content,
        tool_calls=_json_text(extra_calls, f"{where}.tool_calls") if extra_calls is not None else None,
        token_ids=json.dumps(token_ids) if token_ids is not None else None,
        logprobs=json.dumps(logprobs) if logprobs is not None else None,
        routing=_json_text(raw["routing"], f"{where}.routing") if raw.get("routing") is not None else None,
        reward=_finite(raw.get("reward"), f"{where}.reward"),
        extra=_json_text(_extra(raw, _STEP_FIELDS), f"{where} extra fields"),
    )


def _tokens(token_ids: Any, logprobs: Any, where: str) -> None:
    if token_ids is not None:
        if not isinstance(token_ids, list) or not all(
            type(t) is int and 0 <= t < 2**31 for t in token_ids
        ):
            raise EventError(f"{where}.token_ids must be a list of non-negative integers")
    if logprobs is None:
        return
    if token_ids is None:
        raise EventError(f"{where}.logprobs needs token_ids: send the sampled token ids beside them")
    if not isinstance(logprobs, list) or len(logprobs) != len(token_ids):
        n = len(logprobs) if isinstance(logprobs, list) else "not a list"
        raise EventError(
            f"{where}: {len(token_ids)} token_ids but {n} logprobs; send one log-prob per token id"
        )
    for i, lp in enumerate(logprobs):
        if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp) or lp > 1e-6:
            raise EventError(f"{where}.logprobs[{i}]={_show(lp)} is not a finite log-probability (<= 0)")


def _prompt(raw: Any) -> list:
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise EventError("'prompt' must be a list of messages {role, content} or a string")
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(
            msg.get("content", ""), str | list
        ):
            raise EventError(f"prompt[{i}] must be a message object with 'role' and 'content'")
    return raw


def _extra(raw: dict, known: frozenset[str]) -> dict:
    return {k: v for k, v in raw.items() if k not in known}


def _identifier(raw: Any, name: str) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise EventError(f"'{name}' is missing: every event needs a non-empty string '{name}'")
    if len(raw) > MAX_ID_CHARS:
        raise EventError(f"'{name}' is {len(raw)} characters; at most {MAX_ID_CHARS} are allowed")
    if "\x00" in raw:
        raise EventError(f"'{name}' contains a NUL character; remove it")
    return raw


def _optional_str(raw: Any, name: str, limit: int) -> str:
    if raw is None:
        return ""
    if not isinstance(raw, str) or len(raw) > limit or "\x00" in raw:
        raise EventError(f"'{name}' must be a string of at most {limit} characters")
    return raw


def _optional_int(raw: Any, name: str) -> int | None:
    if raw is None:
        return None
    if type(raw) is not int or not 0 <= raw < 2**31:
        raise EventError(f"'{name}' must be a non-negative integer, got {_show(raw)}")
    return raw


def _finite(raw: Any, name: str, *, required: bool = False) -> float | None:
    if raw is None and not required:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise EventError(f"'{name}' must be a finite number (NaN and infinity are not allowed), got {_show(raw)}")
    return float(raw)


def _timestamp(raw: Any, now: datetime) -> datetime:
    if raw is None:
        return now
    if not isinstance(raw, str) or len(raw) > 40:
        raise EventError("'occurred_at' must be an ISO 8601 string such as 2026-11-29T08:00:00Z")
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        raise EventError(f"'occurred_at'={_show(raw)} is not ISO 8601, e.g. 2026-11-29T08:00:00Z") from None
    if value.tzinfo is None:
        raise EventError("'occurred_at' needs a time zone, e.g. a trailing 'Z' for UTC")
    return value.astimezone(UTC)


def _json_text(value: Any, name: str) -> str:
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except ValueError:
        raise EventError(f"'{name}' holds NaN or infinity; JSON numbers must be finite") from None
    if "\\u0000" in text:
        raise EventError(f"'{name}' contains a NUL character; remove it")
    return text


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
