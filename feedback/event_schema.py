"""The ingest contract as JSON Schema (OpenAPI 3.0 dialect), built from the bounds that
`feedback/events.py` enforces, so the published schema and the validation cannot drift apart.

Plain Python, no Django: the API view hands these dicts to the schema generator.
What JSON Schema cannot say (a routing tensor's shape against its token ids, `occurred_at` within
now + 1 day, no lone surrogate in a string) stays in `parse_event`, whose per-event `rejected`
answer names it; a batch whose events break only those is still answered 202.
"""

from __future__ import annotations

from typing import Any

from feedback import events as ev

# No string may hold NUL (PostgreSQL text cannot): said once, in EVENT_BATCH's description, not as a
# pattern on every string, which would make generating examples from this schema 5x slower.
_ID = {"type": "string", "minLength": 1, "maxLength": ev.MAX_ID_CHARS, "pattern": "\\S",
       "description": "Unique per project: the idempotency key of the event (not only spaces)."}
_TIMESTAMP = {"type": "string", "format": "date-time", "nullable": True,
              "description": "ISO 8601 with a time zone, between 2000-01-01 and now + 1 day; default: now."}
_VERSION = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1, "nullable": True}
_TOKEN_IDS = {"type": "array", "maxItems": ev.MAX_TOKENS,
              "items": {"type": "integer", "minimum": 0, "maximum": ev.MAX_TOKEN_ID}}


def _text(limit: int | None = None, *, min_length: int = 0, nullable: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string"}
    if limit is not None:
        out["maxLength"] = limit
    if min_length:
        out["minLength"] = min_length
    if nullable:
        out["nullable"] = True
    return out


def _bounded(low: float, high: float, **extra: Any) -> dict[str, Any]:
    return {"type": "number", "minimum": low, "maximum": high, **extra}


STEP = {
    "type": "object",
    "description": "One turn of the trajectory; `logprobs` (behaviour log-probs) need `token_ids`, one per id.",
    "required": ["role"],
    "properties": {
        "role": _text(ev.MAX_ROLE_CHARS, min_length=1),
        "content": _text(),
        "token_ids": _TOKEN_IDS,
        "logprobs": {"type": "array", "maxItems": ev.MAX_TOKENS, "items": _bounded(ev.MIN_LOGPROB, 0)},
        "prompt_token_ids": {**_TOKEN_IDS, "minItems": 1},
        "tool_calls": {"nullable": True, "description": "Free-form JSON, nested at most 32 levels."},
        "routing": {
            "type": "array", "nullable": True,
            "description": "MoE expert ids: positions fed (prompt ids + token ids - 1) x layers x top-k.",
            "items": {"type": "array", "maxItems": ev.MAX_MOE_LAYERS, "items": {
                "type": "array", "minItems": 1, "maxItems": ev.MAX_TOP_K,
                "items": {"type": "integer", "minimum": 0, "maximum": ev.MAX_EXPERT_ID}}},
        },
        "reward": _bounded(-ev.VALUE_LIMIT, ev.VALUE_LIMIT, nullable=True),
    },
}

MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {"role": _text(ev.MAX_ROLE_CHARS, min_length=1),
                   "content": {"oneOf": [_text(), {"type": "array", "items": {}}]}},
}

_USER = {"description": "The person it was served to or who reacted; stored hashed.", "oneOf": [
    _text(ev.MAX_USER_CHARS), {"type": "integer", "minimum": -(2**63) + 1, "maximum": 2**63 - 1}]}
_CONSENT = {"type": "string", "enum": sorted(ev.CONSENTS), "nullable": True,
            "description": "no_train: stored and shown, never trained on; absent: the project's default."}

TRAJECTORY_EVENT = {
    "type": "object",
    "description": "A completion (prompt and steps) a policy produced; extra fields are kept.",
    "required": ["type", "id"],
    "properties": {
        "type": {"type": "string", "enum": ["trajectory"]},
        "id": _ID,
        "policy_version": _VERSION,
        "task": _text(ev.MAX_TASK_CHARS, nullable=True),
        "tags": {"type": "array", "maxItems": ev.MAX_TAGS, "items": _text(ev.MAX_TAG_CHARS)},
        "source": {"type": "string", "enum": sorted(ev.SOURCES)},
        "prompt": {"oneOf": [_text(), {"type": "array", "maxItems": ev.MAX_STEPS, "items": MESSAGE}]},
        "prompt_token_ids": {**_TOKEN_IDS, "minItems": 1, "nullable": True},
        "steps": {"type": "array", "maxItems": ev.MAX_STEPS, "items": STEP},
        "group": {"oneOf": [_text(ev.MAX_ID_CHARS, min_length=1),
                                               {"type": "integer", "minimum": -(2**63) + 1, "maximum": 2**63 - 1}]},
        "check_context": {"type": "object", "nullable": True, "properties": {
            "prefix": _text(ev.MAX_CHECK_CHARS),
            "tests": {**_text(ev.MAX_CHECK_CHARS, min_length=1), "pattern": "\\S"}}},
        "user": _USER,
        "consent": _CONSENT,
        "occurred_at": _TIMESTAMP,
    },
}

FEEDBACK_EVENT = {
    "type": "object",
    "description": "A user's signal on a trajectory (which may arrive later); extra fields are kept.",
    "required": ["type", "id", "trajectory_id", "signal"],
    "properties": {
        "type": {"type": "string", "enum": ["feedback"]},
        "id": _ID,
        "trajectory_id": _ID,
        "signal": {"oneOf": [
            {"type": "string", "enum": sorted(ev.KNOWN_SIGNALS)},
            {"type": "string", "maxLength": ev.MAX_SIGNAL_CHARS, "pattern": "^custom:[A-Za-z0-9_]*[A-Za-z0-9][A-Za-z0-9_]*$"},
        ]},
        "value": _bounded(-ev.VALUE_LIMIT, ev.VALUE_LIMIT, nullable=True),
        "step": _VERSION,
        "user": _USER,
        "consent": _CONSENT,
        "aspect_labels": {"type": "object", "nullable": True, "maxProperties": ev.MAX_ASPECTS,
                          "additionalProperties": _bounded(*ev.LABEL_SCALE),
                          "description": f"Aspect name (1 to {ev.MAX_ASPECT_CHARS} characters) -> score in [0, 1]."},
        "occurred_at": _TIMESTAMP,
    },
}

EVENT_BATCH = {
    "type": "object",
    "required": ["events"],
    "properties": {"events": {
        "type": "array", "minItems": 1, "maxItems": 1000,
        "items": {"oneOf": [TRAJECTORY_EVENT, FEEDBACK_EVENT]},
        "description": "At most 1,000 events and 5 MiB per request. No string may contain NUL (U+0000) "
                       "or a lone surrogate; an event that does is rejected alone.",
    }},
}

EVENT_RESULTS = {
    "type": "object",
    "required": ["results", "accepted", "duplicate", "rejected"],
    "properties": {
        "results": {"type": "array", "items": {
            "type": "object", "required": ["index", "id", "type", "status"],
            "properties": {
                "index": {"type": "integer", "minimum": 0},
                "id": {"type": "string", "nullable": True},
                "type": {"type": "string", "nullable": True},
                "status": {"type": "string", "enum": ["accepted", "duplicate", "rejected"]},
                "reason": {"type": "string", "description": "What was wrong and how to fix it."},
            },
        }},
        "accepted": {"type": "integer", "minimum": 0},
        "duplicate": {"type": "integer", "minimum": 0},
        "rejected": {"type": "integer", "minimum": 0},
    },
}
