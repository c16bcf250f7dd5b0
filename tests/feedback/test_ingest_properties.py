"""Property tests of POST /api/v1/events over the event schema: whatever the events, headers or
body, the answer is never a 5xx, every 4xx is in the one error shape, and every stored row is
one the trainer can read. Events are drawn valid and then broken: fields replaced by hostile
JSON (huge integers, NaN, lone surrogates, NUL, deep nesting), dropped, or added."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feedback.events import EventError, parse_event
from feedback.models import FeedbackEvent, Step, Trajectory
from tests.factories import as_django_headers

pytestmark = pytest.mark.django_db

HTTP = settings(max_examples=100, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
PURE = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# The bounds a stored row must respect, written out again rather than imported from the parser.
EARLIEST, MAX_TOKEN_ID, MAX_EXPERT_ID = datetime(2000, 1, 1, tzinfo=UTC), 2**22 - 1, 4095

# --- strategies ----------------------------------------------------------------------------------

WEIRD = ["", " ", "\x00", "a\x00b", "\ud800", "x\udfff", "\ud83d\ude00", "\U0001f600", "\ufffe", "\u202e",
         "é", "accept", "custom:ok", "custom:", "trajectory", "feedback", "live", "assistant", "tests",
         "2026-11-29T08:00:00Z", "0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "x" * 300]
text = st.one_of(st.text(max_size=12), st.sampled_from(WEIRD),
                 st.text(st.sampled_from("ab\x00\ud800\udfff\ud83d\ude00é"), max_size=6))
HUGE = [10**400, -(10**400), 10**309, 2**63, 2**31, 2**22, -1, 0, 1, 1e308, -1e308, 5e-324, -0.0]
number = st.one_of(st.integers(), st.integers(-(10**500), 10**500), st.sampled_from(HUGE),
                   st.floats(allow_nan=True, allow_infinity=True))
leaf = st.one_of(st.none(), st.booleans(), number, text)
json_value = st.recursive(leaf, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                       st.dictionaries(text, kids, max_size=3)), max_leaves=12)


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


hostile = st.one_of(json_value, st.integers(25, 80).map(_nested))
stamp = st.one_of(st.sampled_from(["2026-11-29T08:00:00Z", "2026-11-29T08:00:00+14:00", "1999-12-31T23:59:59Z",
                                   "0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00", "2026-11-29"]),
                  st.datetimes(timezones=st.timezones()).map(datetime.isoformat))
logprob = st.one_of(st.floats(-20, 0), st.sampled_from([-1e4, -1e5, 0, 1e-7, 1e-5, -(10**400)]))
STEP_KEYS = ["role", "content", "token_ids", "logprobs", "routing", "prompt_token_ids", "reward", "tool_calls"]
TRAJECTORY_KEYS = ["type", "id", "policy_version", "task", "tags", "source", "prompt", "steps", "occurred_at",
                   "prompt_token_ids", "check_context", "group"]
FEEDBACK_KEYS = ["type", "id", "trajectory_id", "signal", "value", "step", "user", "occurred_at", "aspect_labels"]


def _break(draw, target: dict, keys: list[str]) -> None:
    """Replaces, drops or adds a few fields of target with hostile values."""
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.one_of(st.sampled_from(keys), text))
        if draw(st.booleans()) and key in target:
            del target[key]
        else:
            target[key] = draw(hostile)


@st.composite
def trajectory_events(draw) -> dict:
    tokens = draw(st.lists(st.integers(0, 5000), max_size=4))
    prompt_ids = draw(st.lists(st.integers(0, 5000), min_size=1, max_size=3))
    layers, k = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    fed = len(prompt_ids) + len(tokens) - 1
    step: dict[str, Any] = {"role": draw(st.sampled_from(["assistant", "user", "tool"])), "content": draw(text),
                            "token_ids": tokens, "logprobs": [draw(logprob) for _ in tokens]}
    if tokens and draw(st.booleans()):
        step["routing"] = [[[draw(st.integers(0, 63)) for _ in range(k)] for _ in range(layers)] for _ in range(fed)]
    if draw(st.booleans()):
        step["reward"] = draw(number)
    event: dict[str, Any] = {
        "type": "trajectory", "id": draw(st.one_of(st.sampled_from(["t-1", "t-2"]), text)),
        "policy_version": draw(st.one_of(st.none(), st.integers(-1, 2**32))), "task": draw(text),
        "prompt": draw(st.one_of(text, st.just([{"role": "user", "content": "def add(a, b):"}]))),
        "steps": [step], "occurred_at": draw(stamp), "tags": draw(st.lists(text, max_size=2)),
    }
    if draw(st.booleans()):
        event["prompt_token_ids"] = prompt_ids
    if draw(st.booleans()):
        event["check_context"] = draw(st.one_of(st.just({}), st.fixed_dictionaries({"tests": text}),
                                                st.just({"tests": "assert add(1, 2) == 3"})))
    _break(draw, step, STEP_KEYS)
    _break(draw, event, TRAJECTORY_KEYS)
    return event


@st.composite
def feedback_events(draw) -> dict:
    event: dict[str, Any] = {
        "type": "feedback", "id": draw(st.one_of(st.sampled_from(["f-1", "f-2"]), text)),
        "trajectory_id": draw(st.one_of(st.just("t-1"), text)),
        "signal": draw(st.one_of(st.sampled_from(["accept", "reject", "custom:stars"]), text)),
        "occurred_at": draw(stamp), "user": draw(st.one_of(text, number)),
    }
    if draw(st.booleans()):
        event["value"] = draw(number)
    if draw(st.booleans()):
        event["aspect_labels"] = draw(st.dictionaries(text, st.one_of(st.floats(0, 1), number), max_size=3))
    _break(draw, event, FEEDBACK_KEYS)
    return event


events = st.one_of(trajectory_events(), feedback_events(), json_value)
batches = st.lists(events, min_size=1, max_size=4)

# --- what a stored row must be -------------------------------------------------------------------


def _clean(value: Any, depth: int = 0) -> None:
    assert depth <= 40
    if isinstance(value, str):
        value.encode("utf-8")
        assert "\x00" not in value
    elif isinstance(value, float):
        assert math.isfinite(value)
    elif isinstance(value, list):
        for item in value:
            _clean(item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _clean(key)
            _clean(item, depth + 1)


def _is_ids(value: Any, top: int) -> bool:
    return isinstance(value, list) and all(type(t) is int and 0 <= t <= top for t in value)


def _assert_valid_trajectory(t: Trajectory, now: datetime) -> None:
    assert EARLIEST <= t.occurred_at <= now + timedelta(days=1)
    assert t.policy_version is None or 0 <= t.policy_version < 2**31
    for value in (t.external_id, t.task, t.tags, t.prompt, t.extra):
        _clean(value)
    recorded = t.extra.get("prompt_token_ids")
    assert recorded is None or (_is_ids(recorded, MAX_TOKEN_ID) and recorded)
    context = t.extra.get("check_context")
    assert context is None or isinstance(context, dict)
    if isinstance(context, dict) and "tests" in context:
        assert isinstance(context["tests"], str) and context["tests"].strip()
    for s in Step.objects.filter(trajectory=t):
        _clean([s.role, s.content, s.tool_calls, s.extra])
        assert s.reward is None or abs(s.reward) <= 1e6
        assert s.token_ids is None or _is_ids(s.token_ids, MAX_TOKEN_ID)
        if s.logprobs is not None:
            assert len(s.logprobs) == len(s.token_ids) and all(-1e4 <= lp <= 1e-6 for lp in s.logprobs)
        if s.routing is not None:
            prompt = s.extra.get("prompt_token_ids") or recorded
            assert len(s.routing) == len(prompt) + len(s.token_ids) - 1 if prompt else len(s.routing) >= len(s.token_ids)
            shapes = {(len(p), len(e)) for p in s.routing for e in p}
            assert len(shapes) == 1 and all(_is_ids(e, MAX_EXPERT_ID) for p in s.routing for e in p)


def _assert_valid_feedback(f: FeedbackEvent, now: datetime) -> None:
    assert EARLIEST <= f.occurred_at <= now + timedelta(days=1)
    assert f.value is None or abs(f.value) <= 1e6
    assert f.step is None or 0 <= f.step < 2**31
    _clean([f.event_id, f.trajectory_external_id, f.signal, f.extra])
    if f.aspect_labels is not None:
        assert all(0 <= v <= 1 and type(v) is not bool for v in f.aspect_labels.values())
        assert all(0 < len(k) <= 64 for k in f.aspect_labels)


def _signed(secret: str, body: bytes, msg_id: str = "msg_prop") -> dict[str, str]:
    stamp = str(int(time.time()))
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, msg_id.encode() + b"." + stamp.encode() + b"." + body, hashlib.sha256).digest()
    return {"webhook-id": msg_id, "webhook-timestamp": stamp, "webhook-signature": "v1," + base64.b64encode(mac).decode()}


# --- properties ----------------------------------------------------------------------------------


@HTTP
@given(batch=batches)
def test_no_batch_gets_a_5xx_or_stores_an_invalid_row(post_events, batch):
    with transaction.atomic():
        response = post_events(None, raw=json.dumps({"events": batch}).encode())
        assert response.status_code == 202, response.content
        body = response.json()
        assert len(body["results"]) == len(batch)
        assert all(r["status"] in ("accepted", "duplicate", "rejected") for r in body["results"])
        assert all(r["reason"] for r in body["results"] if r["status"] == "rejected")
        accepted = [r for r in body["results"] if r["status"] == "accepted"]
        assert Trajectory.objects.count() == sum(r["type"] == "trajectory" for r in accepted)
        assert FeedbackEvent.objects.count() == sum(r["type"] == "feedback" for r in accepted)
        now = datetime.now(tz=UTC)
        for t in Trajectory.objects.all():
            _assert_valid_trajectory(t, now)
        for f in FeedbackEvent.objects.all():
            _assert_valid_feedback(f, now)
        transaction.set_rollback(True)


header_value = st.one_of(st.text(st.characters(max_codepoint=255), max_size=30),
                         st.sampled_from(["v1,", "v1,abc", "v1,a,b", "v1,AAAA  v1,AAAA", "1e99", "msg\x00"]))
bodies = st.one_of(st.binary(max_size=60), batches.map(lambda b: json.dumps({"events": b}).encode()),
                   st.sampled_from([b"", b"\xff", b'{"events": [' + b"[" * 5000 + b"]" * 5000 + b"]}",
                                    json.dumps({"events": [{"type": "feedback"}]}).encode("utf-16")]))


@HTTP
@given(body=bodies, signed=st.booleans(),
       overrides=st.dictionaries(st.sampled_from(["webhook-id", "webhook-timestamp", "webhook-signature",
                                                  "flywheel-project", "authorization"]), header_value, max_size=2))
def test_no_headers_or_body_get_a_5xx(client, creds, body, signed, overrides):
    headers = {**(_signed(creds.webhook_secret, body) if signed else {}), "flywheel-project": creds.project.slug}
    with transaction.atomic():
        response = client.generic("POST", "/api/v1/events", body, content_type="application/json",
                                  **as_django_headers({**headers, **overrides}))
        assert response.status_code < 500, response.content
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["code"] and error["message"] and error["fix"], error
        transaction.set_rollback(True)


@PURE
@given(event=events)
def test_the_parser_only_ever_raises_event_error(event):
    now = datetime.now(tz=UTC)
    try:
        record = parse_event(json.loads(json.dumps(event)), now, "salt")
    except EventError as exc:
        str(exc).encode("utf-8")  # the reason can be sent back
        return
    assert EARLIEST <= record.occurred_at <= now + timedelta(days=1)
    values = [record.extra] + ([record.prompt, record.tags] if hasattr(record, "prompt") else [])
    for value in values:
        _clean(json.loads(json.dumps(value, allow_nan=False)))  # JSON as the service serialises it


# --- the body's JSON: the fast decoder and the rows' encoder agree with the standard library -----


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same types all the way down (1 and 1.0 differ; -0.0 and 0.0 differ)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return repr(a) == repr(b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


# A JSON number: an integer part of up to 30 digits, or near the float range (309), or near
# Python's 4,300-digit limit on int(), with a fraction and an exponent or not.
literal = st.builds(
    lambda sign, head, size, fraction, exponent: sign + (head + "7" * (size - 1) if head != "0" else "0") + fraction
    + exponent,
    st.sampled_from(["", "-"]), st.sampled_from(["0", "1", "9"]),
    st.one_of(st.integers(1, 30), st.integers(305, 315), st.integers(4295, 4305)),
    st.one_of(st.just(""), st.from_regex(r"\.[0-9]{1,25}", fullmatch=True)),
    st.one_of(st.just(""), st.from_regex(r"[eE][+-]?[0-9]{1,3}", fullmatch=True)),
)
body_text = st.one_of(
    json_value.map(lambda v: json.dumps(v, ensure_ascii=False)),  # NaN, Infinity and lone surrogates included
    json_value.map(json.dumps),
    st.lists(literal, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]"),
    st.text(st.sampled_from('[]{}",:0123456789.eE-+ \\u"nulltrefasNIy'), max_size=24),
)


@PURE
@given(text=body_text)
def test_the_body_decodes_as_json_loads_decodes_it(text):
    from feedback.apis import _json_loads

    try:
        expected = json.loads(text)
    except RecursionError:
        with pytest.raises(RecursionError):
            _json_loads(text)
        return
    except ValueError:
        expected = ValueError
    if expected is ValueError:  # the huge-integer retry, or a refusal (a 400 naming the JSON error)
        try:
            expected = json.loads(text, parse_int=lambda s: int(s) if len(s) <= 310 else float(s))
        except ValueError:
            with pytest.raises(ValueError):
                _json_loads(text)
            return
    assert _same(_json_loads(text), expected)


@PURE
@given(rows=st.lists(st.lists(json_value, max_size=4), max_size=4))
def test_the_rows_encode_as_json_dumps_writes_them(rows):
    from feedback.services import _json_rows

    try:
        expected = json.dumps(rows, ensure_ascii=False, allow_nan=False).encode()
    except ValueError:  # NaN or an infinity: parse_event refuses them before any row is written
        return
    except UnicodeEncodeError:  # a lone surrogate: parse_event refuses it too
        return
    try:
        written = _json_rows(rows)
    except UnicodeEncodeError:
        return  # the same refusal, raised one step earlier
    assert _same(json.loads(written), json.loads(expected))
