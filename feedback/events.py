"""Validation of ingest events: plain Python, no Django, fast enough for 1,000 events a request.

Each `parse_*` returns a typed record or raises `EventError` whose message says what was wrong
with the event and how to fix it. The contract is in DESIGN.md ("The ingest contract").

Every field is checked here for type, range and size, so a record that comes out is one that
PostgreSQL stores and the trainer reads without a special case:

- strings, object keys included, are valid Unicode (no lone surrogate: UTF-8 cannot encode it)
  without NUL (PostgreSQL text cannot hold it);
- every number is finite and within the 64-bit float range; typed fields are tighter:
  log-probs in [-10000, 0], `value` and step `reward` within +-1e6 (a custom signal's value is
  its reward), aspect labels on the judges' scale [0, 1];
- a graded signal's `value` is its grade (`GRADED_VALUES`): an `accept`'s is the accepted
  characters (a whole number in [0, 100000]; a partial accept), an `edit_kept`'s the kept fraction
  in [0, 1]; the reward spec says how it scales the signal's reward;
- `occurred_at` lies in 2000-01-01 .. now + 1 day (clients buffer events; clocks drift);
- free-form JSON (prompt, tool calls, extra fields) nests at most 32 levels;
- token ids lie in [0, 2**22): policy versions do not record their vocabulary size, so one bound
  16 times the largest vocabularies in use stands in for it;
- MoE `routing` has one entry per position fed to the model (prompt ids + token ids - 1), each a
  list of layers of top-k expert ids in [0, 4096), with the same layers and k throughout.

    .venv/bin/python -m pytest tests/feedback -q -p no:cacheprovider
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from itertools import chain
from typing import Any

MAX_ID_CHARS = 255
MAX_SIGNAL_CHARS = 64
MAX_TASK_CHARS = 100
MAX_ROLE_CHARS = 32
MAX_TAG_CHARS = 100
MAX_TAGS = 64
MAX_USER_CHARS = 255
MAX_KEY_CHARS = 255  # any object key inside an event
MAX_DEPTH = 32  # containers nested inside one free-form value
MAX_STEPS = 10_000  # steps of a trajectory, messages of a prompt
MAX_TOKENS = 1 << 20  # ids in one list (the 5 MiB body bounds it first)
MAX_TOKEN_ID = (1 << 22) - 1
MAX_EXPERT_ID = 4095
MAX_MOE_LAYERS = 1024
MAX_TOP_K = 64
MIN_LOGPROB = -1e4
VALUE_LIMIT = 1e6  # |value| of feedback, |reward| of a step
LABEL_SCALE = (0.0, 1.0)  # human aspect labels are compared with judge scores, which lie in [0, 1]
MAX_ASPECTS = 64
MAX_ASPECT_CHARS = 64  # RubricScore.aspect
MAX_CHECK_CHARS = 100_000  # check_context prefix and tests
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
MAX_AHEAD = timedelta(days=1)
_FLOAT_MAX = sys.float_info.max
_BAD_CHAR = re.compile("[\x00\ud800-\udfff]")
_NUMBERS = {float, int}
_FINITE = "send a finite number (NaN, Infinity and numbers beyond +-1.8e308 are refused)"
KNOWN_SIGNALS = frozenset({"happy", "sad", "accept", "reject", "edit_kept", "followup_dissatisfied"})
SOURCES = frozenset({"live", "simulated", "eval"})
EVENT_TYPES = ("trajectory", "feedback")
CONSENTS = frozenset({"train", "no_train"})  # absent: the project's default
_TRAJECTORY_FIELDS = frozenset(
    {"type", "id", "policy_version", "task", "tags", "source", "prompt", "steps", "occurred_at", "user", "consent"}
)
MAX_ACCEPTED_CHARS = 100_000  # characters of one accepted suggestion
# Signals whose `value` grades them, and the unit it is in (training.rewards.spec scales by it).
GRADED_VALUES = {"accept": "chars", "edit_kept": "fraction"}
_FEEDBACK_FIELDS = frozenset(
    {"type", "id", "trajectory_id", "signal", "value", "step", "user", "occurred_at", "aspect_labels", "consent"}
)
_STEP_FIELDS = frozenset({"role", "content", "token_ids", "logprobs", "tool_calls", "routing", "reward"})


class EventError(ValueError):
    """One event is invalid; the message is sent back as that event's `reason`."""

    def __init__(self, message: str) -> None:
        # The reason goes back in a UTF-8 JSON answer, which a lone surrogate would break.
        super().__init__(message.encode("utf-8", "backslashreplace").decode("utf-8"))


# A record's JSON fields hold the checked values themselves (not their text): the service
# serialises a whole batch once (one json.dumps in C), not every field of every event.


@dataclass(slots=True)
class StepRecord:
    index: int
    role: str
    content: str
    tool_calls: Any  # checked JSON value, or None
    token_ids: list[int] | None
    logprobs: list[float] | None
    routing: list | None
    reward: float | None
    extra: dict


@dataclass(slots=True)
class TrajectoryRecord:
    external_id: str
    policy_version: int | None
    source: str
    task: str
    tags: list[str]
    prompt: list
    extra: dict
    occurred_at: datetime
    steps: list[StepRecord] = field(default_factory=list)
    user_hash: str = ""
    consent: str | None = None  # "train" | "no_train" | None (the project's default)


@dataclass(slots=True)
class FeedbackRecord:
    event_id: str
    trajectory_external_id: str
    signal: str
    value: float | None
    step: int | None
    user_hash: str
    aspect_labels: dict | None
    extra: dict
    occurred_at: datetime
    consent: str | None = None


def event_identity(raw: Any) -> tuple[str | None, str | None]:
    """(type, id) of a raw event when they are usable, for the per-event answer."""
    if not isinstance(raw, dict):
        return None, None
    kind, ident = raw.get("type"), raw.get("id")
    kind = kind if isinstance(kind, str) and len(kind) <= 32 and not _BAD_CHAR.search(kind) else None
    usable = isinstance(ident, str) and 0 < len(ident) <= MAX_ID_CHARS and not _BAD_CHAR.search(ident)
    return kind, ident if usable else None


def parse_event(raw: Any, now: datetime, user_key: str) -> TrajectoryRecord | FeedbackRecord:
    """`user_key`: the HMAC key user ids are hashed with (feedback.services.user_hash_key)."""
    if not isinstance(raw, dict):
        raise EventError(f"an event must be a JSON object, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind not in EVENT_TYPES:
        raise EventError(f"unknown type {_show(kind)}: use 'trajectory' or 'feedback'")
    _identifier(raw.get("id"), "id")
    if kind == "trajectory":
        return parse_trajectory(raw, now, user_key)
    return parse_feedback(raw, now, user_key)


def parse_trajectory(raw: dict, now: datetime, user_key: str = "") -> TrajectoryRecord:
    steps = raw.get("steps", [])
    if not isinstance(steps, list) or len(steps) > MAX_STEPS:
        raise EventError(f"'steps' must be a list of at most {MAX_STEPS} {{role, content, token_ids?, logprobs?}}")
    tags = raw.get("tags", [])
    if not isinstance(tags, list) or len(tags) > MAX_TAGS or not all(
        isinstance(t, str) and len(t) <= MAX_TAG_CHARS for t in tags
    ):
        raise EventError(f"'tags' must be a list of at most {MAX_TAGS} strings of at most {MAX_TAG_CHARS} characters")
    source = raw.get("source", "live")
    if not isinstance(source, str) or source not in SOURCES:
        raise EventError(f"unknown source {_show(source)}: use one of {sorted(SOURCES)}")
    prompt_ids = _token_list(raw.get("prompt_token_ids"), "prompt_token_ids", allow_empty=False)
    _group(raw.get("group"))
    _check_context(raw.get("check_context"))
    # Recorded prompt ids belong to the first step with token ids: the one the trainer scores.
    first = next((i for i, s in enumerate(steps) if isinstance(s, dict) and s.get("token_ids")), None)
    user = _user(raw.get("user"))
    return TrajectoryRecord(
        external_id=raw["id"],
        policy_version=_optional_int(raw.get("policy_version"), "policy_version"),
        source=source,
        task=_optional_str(raw.get("task"), "task", MAX_TASK_CHARS),
        tags=_json_value(tags, "tags"),
        prompt=_json_value(_prompt(raw.get("prompt")), "prompt"),
        extra=_json_value(_extra(raw, _TRAJECTORY_FIELDS), ""),
        occurred_at=_timestamp(raw.get("occurred_at"), now),
        steps=[_step(i, s, prompt_ids if i == first else None) for i, s in enumerate(steps)],
        user_hash=hash_user(user, user_key) if user is not None else "",
        consent=_consent(raw.get("consent")),
    )


def parse_feedback(raw: dict, now: datetime, user_key: str) -> FeedbackRecord:
    signal = raw.get("signal")
    if not isinstance(signal, str) or not (signal in KNOWN_SIGNALS or _is_custom(signal)):
        raise EventError(
            f"unknown signal {_show(signal)}: use one of {sorted(KNOWN_SIGNALS)} or 'custom:<name>'"
        )
    user = _user(raw.get("user"))
    labels = _aspect_labels(raw.get("aspect_labels"))
    return FeedbackRecord(
        event_id=raw["id"],
        trajectory_external_id=_identifier(raw.get("trajectory_id"), "trajectory_id"),
        signal=signal,
        value=_signal_value(signal, raw.get("value")),
        step=_optional_int(raw.get("step"), "step"),
        user_hash=hash_user(user, user_key) if user is not None else "",
        aspect_labels=labels,
        extra=_json_value(_extra(raw, _FEEDBACK_FIELDS), ""),
        occurred_at=_timestamp(raw.get("occurred_at"), now),
        consent=_consent(raw.get("consent")),
    )


def _consent(raw: Any) -> str | None:
    if raw is None or (isinstance(raw, str) and raw in CONSENTS):
        return raw
    raise EventError(f"'consent'={_show(raw)}: send 'no_train' (stored and shown, never trained on) or 'train', "
                     "or leave it out for the project's default")


def hash_user(user: str, key: str) -> str:
    """HMAC-SHA256 of the user id under `key` (the server's per-project key, from its pepper):
    without the key a hash cannot be matched against guessed ids (e.g. emails)."""
    mac = _keyed_hmac(key).copy()  # the key's pads hashed once per key, not once per event
    mac.update(user.encode())
    return mac.hexdigest()


@lru_cache(maxsize=256)
def _keyed_hmac(key: str) -> hmac.HMAC:
    return hmac.new(key.encode(), digestmod=hashlib.sha256)


def _is_custom(signal: str) -> bool:
    name = signal.removeprefix("custom:")
    return signal.startswith("custom:") and 0 < len(signal) <= MAX_SIGNAL_CHARS and name.replace("_", "").isalnum()


def _signal_value(signal: str, raw: Any) -> float | None:
    unit = GRADED_VALUES.get(signal)
    if unit is None or raw is None:
        return _bounded(raw, "value", -VALUE_LIMIT, VALUE_LIMIT)
    value = _as_float(raw)
    if unit == "chars" and (value is None or not value.is_integer() or not 0 <= value <= MAX_ACCEPTED_CHARS):
        raise EventError(f"'value'={_show(raw)} of an 'accept' is the accepted characters: send a finite whole number in "
                         f"[0, {MAX_ACCEPTED_CHARS}] (the characters of a partial accept), or null for a full accept")
    if unit == "fraction" and (value is None or not 0 <= value <= 1):
        raise EventError(f"'value'={_show(raw)} of an 'edit_kept' is the kept fraction: send a finite number in [0, 1] "
                         "(0.25: a quarter of the suggestion survived the edit), or null")
    return value


def _user(raw: Any) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, int) and not isinstance(raw, bool) and abs(raw) < 2**63:
        return str(raw)
    if isinstance(raw, str) and len(raw) <= MAX_USER_CHARS:
        return _clean(raw, "'user'")
    raise EventError(f"'user' must be a string id of at most {MAX_USER_CHARS} characters (it is stored hashed), "
                     f"got {_show(raw)}")


def _aspect_labels(raw: Any) -> dict | None:
    if raw is None:
        return None
    low, high = LABEL_SCALE
    if not isinstance(raw, dict) or len(raw) > MAX_ASPECTS:
        raise EventError(f"'aspect_labels' must be an object of at most {MAX_ASPECTS} aspect names -> "
                         f"scores in [{low:g}, {high:g}]")
    for name, score in raw.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_ASPECT_CHARS:
            raise EventError(f"'aspect_labels' names must be 1 to {MAX_ASPECT_CHARS} characters, got {_show(name)}")
        _clean(name, "an 'aspect_labels' name")
        value = _as_float(score)
        if value is None or not low <= value <= high:
            raise EventError(f"'aspect_labels.{name}'={_show(score)}: send a finite number in [{low:g}, {high:g}], "
                             "the scale the judges score on")
    return raw


def _group(raw: Any) -> None:
    if raw is None or (isinstance(raw, str) and 0 < len(raw) <= MAX_ID_CHARS) or (
        isinstance(raw, int) and not isinstance(raw, bool) and abs(raw) < 2**63
    ):
        return
    raise EventError(f"'group' must be a string of 1 to {MAX_ID_CHARS} characters or an integer naming the "
                     f"prompt's sample group, got {_show(raw)}")


def _check_context(raw: Any) -> None:
    if raw is None:
        return
    if not isinstance(raw, dict):
        raise EventError("'check_context' must be an object such as "
                         '{"prefix": "def add(a, b):", "tests": "assert add(1, 2) == 3"}')
    for key in ("prefix", "tests"):
        if key not in raw:
            continue
        value = raw[key]
        if not isinstance(value, str) or len(value) > MAX_CHECK_CHARS or (key == "tests" and not value.strip()):
            hint = "; leave 'tests' out when there are none" if key == "tests" else ""
            raise EventError(f"'check_context.{key}'={_show(value)}: send source text of at most "
                             f"{MAX_CHECK_CHARS} characters{hint}")


def _step(index: int, raw: Any, prompt_ids: list[int] | None) -> StepRecord:
    where = f"steps[{index}]"
    if not isinstance(raw, dict):
        raise EventError(f"{where} must be an object with 'role' and 'content'")
    role = raw.get("role")
    if not isinstance(role, str) or not role or len(role) > MAX_ROLE_CHARS:
        raise EventError(f"{where}.role must be a non-empty string such as 'assistant'")
    _clean(role, f"{where}.role")
    content = raw.get("content", "")
    if not isinstance(content, str):
        raise EventError(f"{where}.content must be a string")
    _clean(content, f"{where}.content")
    token_ids, logprobs = raw.get("token_ids"), raw.get("logprobs")
    _tokens(token_ids, logprobs, where)
    own_ids = _token_list(raw.get("prompt_token_ids"), f"{where}.prompt_token_ids", allow_empty=False)
    routing = raw.get("routing")
    if routing is not None:
        _routing(routing, token_ids, own_ids if own_ids is not None else prompt_ids, f"{where}.routing")
    calls = raw.get("tool_calls")
    return StepRecord(
        index=index,
        role=role,
        content=content,
        tool_calls=_json_value(calls, f"{where}.tool_calls") if calls is not None else None,
        token_ids=token_ids,
        logprobs=logprobs,
        routing=routing,
        reward=_bounded(raw.get("reward"), f"{where}.reward", -VALUE_LIMIT, VALUE_LIMIT),
        extra=_json_value(_extra(raw, _STEP_FIELDS), where),
    )


def _tokens(token_ids: Any, logprobs: Any, where: str) -> None:
    _token_list(token_ids, f"{where}.token_ids", allow_empty=True)
    if logprobs is None:
        return
    if token_ids is None:
        raise EventError(f"{where}.logprobs needs token_ids: send the sampled token ids beside them")
    if not isinstance(logprobs, list) or len(logprobs) != len(token_ids):
        n = len(logprobs) if isinstance(logprobs, list) else "not a list"
        raise EventError(
            f"{where}: {len(token_ids)} token_ids but {n} logprobs; send one log-prob per token id"
        )
    if _all_logprobs(logprobs):
        return
    for i, lp in enumerate(logprobs):
        value = _as_float(lp)
        # The ceiling tolerates rounding above 0; the floor keeps exp() and float32 meaningful.
        if value is None or not MIN_LOGPROB <= value <= 1e-6:
            raise EventError(f"{where}.logprobs[{i}]={_show(lp)} is not a finite log-probability: "
                             f"send the sampled token's log-prob, in [{MIN_LOGPROB:g}, 0]")


def _token_list(raw: Any, where: str, *, allow_empty: bool) -> list[int] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not (allow_empty or raw) or len(raw) > MAX_TOKENS:
        raise EventError(f"{where} must be a {'' if allow_empty else 'non-empty '}flat list of at most "
                         f"{MAX_TOKENS} token ids, got {_show(raw)}")
    if _all_ints(raw, 0, MAX_TOKEN_ID):
        return raw
    i, bad = next((i, t) for i, t in enumerate(raw) if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID)
    raise EventError(f"{where}[{i}]={_show(bad)} is not a token id: send the tokenizer's ids, "
                     f"integers in [0, {MAX_TOKEN_ID}]")


def _routing(raw: Any, token_ids: Any, prompt_ids: list[int] | None, where: str) -> None:
    """Engine routing: (prompt + tokens - 1 positions, layers, top-k) expert ids as nested lists."""
    if not token_ids:
        raise EventError(f"{where} needs the step's token_ids: it has one entry per position fed to the model")
    shape = "a list of positions, each a list of layers, each a list of the top-k expert ids"
    if not isinstance(raw, list) or not raw:
        raise EventError(f"{where} must be {shape}, got {_show(raw)}")
    fed = len(token_ids) - 1  # the last sampled token is never fed back
    if prompt_ids is not None and len(raw) != len(prompt_ids) + fed:
        raise EventError(f"{where} has {len(raw)} positions but the model was fed {len(prompt_ids) + fed} "
                         f"({len(prompt_ids)} prompt_token_ids + {len(token_ids)} token_ids - 1); "
                         "send one entry per position fed")
    if prompt_ids is None and not fed < len(raw) <= fed + MAX_TOKENS:
        raise EventError(f"{where} has {len(raw)} positions for {len(token_ids)} token_ids; send one entry per "
                         "position fed: the prompt's ids and all token ids but the last")
    first = raw[0]
    layers = len(first) if isinstance(first, list) else 0
    top_k = len(first[0]) if layers and isinstance(first[0], list) else 0
    if not (0 < layers <= MAX_MOE_LAYERS and 0 < top_k <= MAX_TOP_K):
        raise EventError(f"{where}[0] must list 1 to {MAX_MOE_LAYERS} layers of 1 to {MAX_TOP_K} expert ids "
                         f"({shape}), got {_show(first)}")
    for i, position in enumerate(raw):
        if not (type(position) is list and len(position) == layers and set(map(type, position)) == {list}
                and set(map(len, position)) == {top_k}):
            raise EventError(f"{where}[{i}] must list {layers} layers of {top_k} expert ids, like {where}[0]; "
                             f"got {_show(position)}")
    if not _all_ints(list(chain.from_iterable(chain.from_iterable(raw))), 0, MAX_EXPERT_ID):
        i, j = next((i, j) for i, p in enumerate(raw) for j, e in enumerate(p) if not _all_ints(e, 0, MAX_EXPERT_ID))
        raise EventError(f"{where}[{i}][{j}] must be {top_k} expert ids, integers in [0, {MAX_EXPERT_ID}], "
                         f"got {_show(raw[i][j])}")


def _all_logprobs(values: list) -> bool:
    """values are floats or ints (not bools) in [MIN_LOGPROB, 1e-6], at C speed. A NaN can slip
    past min() and max() but not past the sum (NaN too); an infinity fails the range itself."""
    return not values or (set(map(type, values)) <= _NUMBERS and MIN_LOGPROB <= min(values)
                          and max(values) <= 1e-6 and not math.isnan(sum(values)))


def _all_ints(values: list, low: int, high: int) -> bool:
    """values are ints (not bools) in [low, high]: passes at C speed, as routing can hold millions."""
    return not values or (set(map(type, values)) == {int} and low <= min(values) and max(values) <= high)


def _prompt(raw: Any) -> list:
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or len(raw) > MAX_STEPS:
        raise EventError(f"'prompt' must be a list of at most {MAX_STEPS} messages {{role, content}} or a string")
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict) or not isinstance(msg.get("content", ""), str | list) or not (
            isinstance(msg.get("role"), str) and 0 < len(msg["role"]) <= MAX_ROLE_CHARS
        ):
            raise EventError(f"prompt[{i}] must be a message object with 'role' (at most {MAX_ROLE_CHARS} "
                             "characters) and 'content'")
    return raw


def _extra(raw: dict, known: frozenset[str]) -> dict:
    return {k: v for k, v in raw.items() if k not in known}


def _identifier(raw: Any, name: str) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise EventError(f"'{name}' is missing: every event needs a non-empty string '{name}'")
    if len(raw) > MAX_ID_CHARS:
        raise EventError(f"'{name}' is {len(raw)} characters; at most {MAX_ID_CHARS} are allowed")
    return _clean(raw, f"'{name}'")


def _optional_str(raw: Any, name: str, limit: int) -> str:
    if raw is None:
        return ""
    if not isinstance(raw, str) or len(raw) > limit:
        raise EventError(f"'{name}' must be a string of at most {limit} characters")
    return _clean(raw, f"'{name}'")


def _optional_int(raw: Any, name: str) -> int | None:
    if raw is None:
        return None
    if type(raw) is not int or not 0 <= raw < 2**31:
        raise EventError(f"'{name}' must be a non-negative integer below 2**31, got {_show(raw)}")
    return raw


def _as_float(raw: Any) -> float | None:
    """raw as a finite float; None for bools, NaN, infinities and integers a float cannot hold."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        # Compared as an int: float(raw) would raise OverflowError past 1.8e308.
        return float(raw) if -_FLOAT_MAX <= raw <= _FLOAT_MAX else None
    if isinstance(raw, float):
        return raw if math.isfinite(raw) else None
    return None


def _bounded(raw: Any, name: str, low: float, high: float) -> float | None:
    if raw is None:
        return None
    value = _as_float(raw)
    if value is None or not low <= value <= high:
        raise EventError(f"'{name}'={_show(raw)}: send a finite number in [{low:g}, {high:g}] "
                         "(NaN and infinity are not allowed)")
    return value


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
    latest = now + MAX_AHEAD
    try:
        # Year 1 at +14:00 or year 9999 at -14:00 has no UTC datetime: astimezone overflows.
        value = value.astimezone(UTC)
    except (OverflowError, ValueError):
        value = None
    if value is None or not EARLIEST <= value <= latest:
        raise EventError(f"'occurred_at'={_show(raw)} is outside {EARLIEST:%Y-%m-%d} .. now + 1 day "
                         f"({latest:%Y-%m-%dT%H:%M}Z): send when the event happened, with its UTC offset")
    return value


def _clean(text: str, where: str) -> str:
    """text, unless it holds a character PostgreSQL or UTF-8 cannot take."""
    bad = _BAD_CHAR.search(text)
    if bad is not None:
        raise EventError(f"{where} {_char_problem(bad)}")
    return text


def _char_problem(bad: re.Match) -> str:
    if bad.group() == "\x00":
        return f"contains a NUL character at position {bad.start()}; remove it (PostgreSQL cannot store it)"
    return (f"contains a lone surrogate {bad.group()!r} at position {bad.start()}, which is not valid Unicode; "
            "send text as UTF-8 (a \\ud800-\\udfff escape must be half of a pair)")


def _json_value(value: Any, name: str) -> Any:
    """Free-form JSON (prompt, tool calls, extra fields) checked for a jsonb column."""
    problem = _json_problem(value, 0)
    if problem is not None:
        path, what = problem
        where = f"{name}{path}".lstrip(".")
        raise EventError(f"'{where}' {what}" if where else f"the event {what}")
    return value


def _json_problem(value: Any, depth: int) -> tuple[str, str] | None:
    """(path, what is wrong) for the first value PostgreSQL or a reader could not take, or None."""
    if isinstance(value, str):
        bad = _BAD_CHAR.search(value)
        return None if bad is None else ("", _char_problem(bad))
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return None if _as_float(value) is not None else ("", f"is {_show(value)}: {_FINITE}")
    if depth >= MAX_DEPTH and isinstance(value, list | dict):
        return "", f"nests deeper than {MAX_DEPTH} levels; flatten it or send it as a string"
    if isinstance(value, list):
        for i, item in enumerate(value):
            if (problem := _json_problem(item, depth + 1)) is not None:
                return f"[{i}]{problem[0]}", problem[1]
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
                return "", f"has a key {_show(key)}: keys must be strings of at most {MAX_KEY_CHARS} characters"
            if (bad := _BAD_CHAR.search(key)) is not None:
                return "", f"has a key that {_char_problem(bad)}"
            if (problem := _json_problem(item, depth + 1)) is not None:
                return f".{key}{problem[0]}", problem[1]
        return None
    return "", f"is a {type(value).__name__}, which is not JSON"


def _show(value: Any) -> str:
    """A short rendering of a client's value for a reason (never the repr of something huge)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else repr(value[:37]) + "..."
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    if isinstance(value, list | dict):
        parts = [*value, *value.values()] if isinstance(value, dict) else value
        if len(value) > 8 or not all(map(_is_small_scalar, parts)):
            return f"a JSON {'array' if isinstance(value, list) else 'object'} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_small_scalar(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= 20
    return value is None or isinstance(value, bool | float) or (isinstance(value, int) and value.bit_length() <= 64)
