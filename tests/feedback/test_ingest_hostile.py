"""POST /api/v1/events under hostile input: each case once answered 500 (or stored a row the
trainer cannot read); now the event is refused alone with a reason, or the request gets a 4xx
in the one error shape. The property tests beside this file look for the cases not listed here."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from feedback.models import FeedbackEvent, Step, Trajectory, WebhookDelivery
from tests.factories import as_django_headers, feedback, sign, trajectory

pytestmark = pytest.mark.django_db

HUGE = 10**400  # a 401-digit integer: float() of it overflows
STEP = {"role": "assistant", "content": "x", "token_ids": [17, 92, 5], "logprobs": [-0.1, -0.7, -0.2]}


def _error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["fix"], error
    return error


def _refused_alone(post_events, bad: dict | str, reason: str, raw: bytes | None = None) -> str:
    """Posts [good feedback, bad]: the good one lands, the bad one is rejected with `reason`."""
    body = raw if raw is not None else json.dumps({"events": [feedback("good"), bad]}).encode()
    response = post_events(None, raw=body)
    assert response.status_code == 202, response.content
    good, answer = response.json()["results"]
    assert good["status"] == "accepted", good
    assert answer["status"] == "rejected", answer
    assert reason in answer["reason"], answer["reason"]
    assert FeedbackEvent.objects.filter(event_id="good").count() == 1
    assert Trajectory.objects.count() == 0 and FeedbackEvent.objects.count() == 1
    return answer["reason"]


def _each_refused_alone(post_events, cases: dict[str, tuple[Any, str]]) -> None:
    """Posts one batch: a good event, then each bad case; every case is rejected with its reason."""
    names = list(cases)
    body = json.dumps({"events": [feedback("good")] + [cases[n][0] for n in names]}).encode()
    response = post_events(None, raw=body)
    assert response.status_code == 202, response.content
    good, *answers = response.json()["results"]
    assert good["status"] == "accepted", good
    for name, answer in zip(names, answers, strict=True):
        assert answer["status"] == "rejected", (name, answer)
        assert cases[name][1] in answer["reason"], (name, answer["reason"])
    assert Trajectory.objects.count() == 0 and FeedbackEvent.objects.count() == 1


def _step(**fields) -> dict:
    return {**STEP, **fields}


# --- numbers outside the float range ---------------------------------------------------------------


def test_a_number_beyond_the_float_range_refuses_its_event_alone(post_events):
    _each_refused_alone(post_events, {
        "logprobs": (trajectory("x", steps=[_step(logprobs=[-0.1, -HUGE, -0.2])]), "finite"),
        "step reward": (trajectory("x", steps=[_step(reward=HUGE)]), "finite"),
        "value": (feedback("x", value=HUGE), "finite"),
        "negative value": (feedback("x", value=-HUGE), "finite"),
        "aspect label": (feedback("x", aspect_labels={"style": HUGE}), "finite"),
        "extra field": (trajectory("x", experiment=HUGE), "finite"),
        "tool_calls": (trajectory("x", steps=[_step(tool_calls=[{"n": HUGE}])]), "finite"),
        "prompt part": (trajectory("x", prompt=[{"role": "user", "content": [{"n": HUGE}]}]), "finite"),
    })


def test_an_integer_python_will_not_parse_refuses_its_event_not_the_body(post_events):
    # Over 4,300 digits json.loads itself refuses the integer: it once failed the whole batch.
    raw = json.dumps({"events": [feedback("good"), feedback("x", value=0)]}).replace(
        '"value": 0', '"value": ' + "9" * 5000).encode()
    _refused_alone(post_events, None, "finite", raw=raw)


def test_finite_but_absurd_numbers_are_refused(post_events):
    _each_refused_alone(post_events, {
        "value": (feedback("x", value=1e300), "value"),
        "reward": (trajectory("x", steps=[_step(reward=-1e300)]), "reward"),
        "logprob": (trajectory("x", steps=[_step(logprobs=[-0.1, -1e300, -0.2])]), "log-prob"),
    })


# --- timestamps ----------------------------------------------------------------------------------------


def test_a_timestamp_outside_the_window_refuses_its_event(post_events):
    _each_refused_alone(post_events, {stamp: (feedback("x", occurred_at=stamp), "2000-01-01") for stamp in [
        "0001-01-01T00:00:00+14:00",  # astimezone(UTC) lands in year 0
        "9999-12-31T23:59:59-14:00",  # ... in year 10000
        "9999-12-31T23:59:59-23:59",
        "1999-12-31T23:59:59Z",
        "1970-01-01T00:00:00Z",
    ]})


def test_a_timestamp_over_a_day_ahead_is_refused_and_one_just_ahead_is_kept(post_events):
    ahead = (datetime.now(tz=UTC) + timedelta(days=2)).isoformat()
    _refused_alone(post_events, feedback("x", occurred_at=ahead), "occurred_at")
    soon = (datetime.now(tz=UTC) + timedelta(hours=1)).isoformat()
    assert post_events([feedback("y", occurred_at=soon)]).json()["accepted"] == 1


# --- strings PostgreSQL cannot store -------------------------------------------------------------------


SURROGATE = "\ud800"


def test_a_lone_surrogate_refuses_its_event_alone(post_events):
    _each_refused_alone(post_events, {
        "step content": (trajectory("x", steps=[_step(content="a" + SURROGATE)]), "surrogate"),
        "step role": (trajectory("x", steps=[_step(role="assist" + SURROGATE)]), "surrogate"),
        "task": (trajectory("x", task="t" + SURROGATE), "surrogate"),
        "tag": (trajectory("x", tags=["a" + SURROGATE]), "surrogate"),
        "prompt": (trajectory("x", prompt=[{"role": "user", "content": SURROGATE}]), "surrogate"),
        "prompt string": (trajectory("x", prompt="lone " + SURROGATE), "surrogate"),
        "extra key": (trajectory("x", **{"key" + SURROGATE: 1}), "surrogate"),
        "extra value": (trajectory("x", experiment={"k": SURROGATE}), "surrogate"),
        "user": (feedback("x", user="u" + SURROGATE), "surrogate"),
        "trajectory_id": (feedback("x", trajectory_id="t" + SURROGATE), "surrogate"),
        "signal": (feedback("x", signal="custom:" + SURROGATE), "signal"),
        "aspect name": (feedback("x", aspect_labels={"st" + SURROGATE: 0.5}), "surrogate"),
    })


@pytest.mark.parametrize("bad", [
    pytest.param(feedback("x" + SURROGATE), id="id"),
    pytest.param({"type": "feedback" + SURROGATE, "id": "x"}, id="type"),
])
def test_a_lone_surrogate_in_the_echoed_id_or_type_is_not_echoed(post_events, bad):
    reason = _refused_alone(post_events, bad, "")
    body = post_events(None, raw=json.dumps({"events": [bad]}).encode()).json()
    assert SURROGATE not in json.dumps(body, ensure_ascii=False) and reason


def test_a_nul_character_refuses_its_event_alone(post_events):
    _each_refused_alone(post_events, {
        "step role": (trajectory("x", steps=[_step(role="assis\x00tant")]), "NUL"),
        "tool_calls": (trajectory("x", steps=[_step(tool_calls=[{"name": "a\x00"}])]), "NUL"),
        "tag": (trajectory("x", tags=["a\x00"]), "NUL"),
        "extra key": (trajectory("x", **{"k\x00": 1}), "NUL"),
        "user": (feedback("x", user="u\x00"), "NUL"),
    })


# --- nesting -------------------------------------------------------------------------------------------


def test_a_body_nested_past_the_parser_is_a_400(post_events):
    depth = 100_000
    raw = b'{"events": [' + b"[" * depth + b"]" * depth + b"]}"
    error = _error(post_events(None, raw=raw), 400, "bad_request")
    assert "deep" in error["message"]
    assert Trajectory.objects.count() == 0 and FeedbackEvent.objects.count() == 0


@pytest.mark.parametrize("depth", [40, 500])
def test_an_event_nested_too_deep_is_refused_alone(post_events, depth):
    nested: object = 1
    for _ in range(depth):
        nested = [nested]
    reason = _refused_alone(post_events, trajectory("x", experiment=nested), "nest")
    assert "32" in reason


# --- labels, routing, prompt token ids, check inputs ---------------------------------------------------


def test_aspect_labels_outside_their_scale_are_refused(post_events):
    bad = [{"style": 1e308}, {"style": -0.01}, {"style": 1.5}, {"style": True}, {"style": "0.5"}, {"": 0.5},
           {"a" * 65: 0.5}, {f"a{i}": 0.5 for i in range(65)}, [0.5]]
    _each_refused_alone(post_events, {str(i): (feedback("x", aspect_labels=labels), "aspect_labels")
                                      for i, labels in enumerate(bad)})


def test_aspect_labels_at_the_ends_of_the_scale_are_kept(post_events):
    assert post_events([feedback("x", aspect_labels={"style": 0, "concision": 1.0})]).json()["accepted"] == 1
    assert FeedbackEvent.objects.get().aspect_labels == {"style": 0, "concision": 1.0}


MOE = [[[0, 1], [2, 3]]] * 4  # 2 prompt ids + 3 tokens - 1 = 4 positions fed, 2 layers, top-2


def test_routing_that_does_not_fit_the_step_is_refused(post_events):
    bad = {
        "a string": "experts",
        "empty": [],
        "one position short": [[[0, 1], [2, 3]]] * 3,
        "one position over": [[[0, 1], [2, 3]]] * 5,
        "ragged layers": [[[0, 1], [2, 3]]] * 3 + [[[0, 1]]],
        "ragged top-k": [[[0, 1], [2, 3]]] * 3 + [[[0, 1], [2]]],
        "negative expert": [[[0, -1], [2, 3]]] * 4,
        "huge expert": [[[0, 10**6], [2, 3]]] * 4,
        "float expert": [[[0, 1.0], [2, 3]]] * 4,
        "bool expert": [[[0, True], [2, 3]]] * 4,
        "missing a level": [[0, 1]] * 4,
        "extra level": [[[[0], [1]], [2, 3]]] * 4,
    }
    _each_refused_alone(post_events, {
        name: (trajectory("x", prompt_token_ids=[1, 2], steps=[_step(routing=routing)]), "routing")
        for name, routing in bad.items()
    })


def test_routing_needs_token_ids(post_events):
    bad = trajectory("x", steps=[{"role": "assistant", "content": "x", "routing": [[[0, 1]]]}])
    _refused_alone(post_events, bad, "routing")


def test_routing_as_the_engines_record_it_is_kept(post_events):
    # The rollout shape (prompt ids on the trajectory) and the serving shape (on the step).
    rollout = trajectory("t-1", prompt_token_ids=[1, 2], steps=[_step(routing=MOE)])
    served = trajectory("t-2", steps=[_step(routing=MOE, prompt_token_ids=[1, 2])])
    unknown_prompt = trajectory("t-3", steps=[_step(routing=MOE)])  # 2 positions of prompt assumed
    body = post_events([rollout, served, unknown_prompt]).json()
    assert body["accepted"] == 3, body
    assert [s.routing for s in Step.objects.order_by("trajectory__external_id")] == [MOE] * 3


def test_prompt_token_ids_that_are_not_a_flat_list_of_ids_are_refused(post_events):
    bad = ["1 2 3", [], [-1], [1.0], [True], [[1]], [2**40]]
    cases = {f"trajectory {ids!r}": (trajectory("x", prompt_token_ids=ids), "prompt_token_ids") for ids in bad}
    cases |= {f"step {ids!r}": (trajectory("x", steps=[_step(prompt_token_ids=ids)]), "prompt_token_ids")
              for ids in bad}
    _each_refused_alone(post_events, cases)


def test_a_token_id_past_any_vocabulary_is_refused(post_events):
    _refused_alone(post_events, trajectory("x", steps=[_step(token_ids=[1, 2, 2**31 - 1])]), "token_ids")


def test_check_context_with_empty_or_invalid_tests_is_refused(post_events):
    bad = [{"tests": ""}, {"tests": "   \n"}, {"tests": None}, {"tests": 3}, {"tests": ["assert 1"]},
           {"prefix": 7}, "assert add(1, 2) == 3", []]
    _each_refused_alone(post_events, {repr(c): (trajectory("x", check_context=c), "check_context") for c in bad})


def test_check_context_with_tests_is_kept(post_events):
    context = {"prefix": "def add(a, b):", "tests": "assert add(1, 2) == 3"}
    assert post_events([trajectory("x", check_context=context), trajectory("y", check_context={})]).json()[
        "accepted"] == 2
    assert Trajectory.objects.get(external_id="x").extra["check_context"] == context


def test_fields_of_the_wrong_kind_or_size_are_refused(post_events):
    _each_refused_alone(post_events, {
        "source list": (trajectory("x", source=[]), "source"),
        "source object": (trajectory("x", source={"a": 1}), "source"),
        "group list": (trajectory("x", group=[1]), "group"),
        "user true": (feedback("x", user=True), "user"),
        "user 256 chars": (feedback("x", user="u" * 256), "user"),
        "65 tags": (trajectory("x", tags=[f"t{i}" for i in range(65)]), "tags"),
    })


# --- headers and bodies: 400/401 before anything else -----------------------------------------------


@pytest.mark.parametrize("signature", [
    "garbage", "v1", "v1,", "v1,abc", "v1,a,b", "v1,AAAA  v1,AAAA", "v1,\u00e9t\u00e9", " ", "v1,AAAA ",
])
def test_a_malformed_signature_header_is_a_401(post_events, creds, signature):
    body = json.dumps({"events": [feedback()]}).encode()
    headers = {**sign(creds.webhook_secret, body), "webhook-signature": signature}
    error = _error(post_events(None, raw=body, headers=headers), 401, "unauthorized")
    assert "webhook-signature" in error["message"]
    assert FeedbackEvent.objects.count() == 0


@pytest.mark.parametrize("msg_id", ["m" * 256, "msg\x00id", "msg_\u00e9", " msg"])
def test_a_malformed_webhook_id_is_a_401(post_events, creds, msg_id):
    body = json.dumps({"events": [feedback()]}).encode()
    error = _error(post_events(None, raw=body, headers=sign(creds.webhook_secret, body, msg_id=msg_id)), 401,
                   "unauthorized")
    assert "webhook-id" in error["message"]
    assert WebhookDelivery.objects.count() == 0 and FeedbackEvent.objects.count() == 0


@pytest.mark.parametrize("stamp", ["abc", "1e12", "nan", "9" * 5000, "-1", "1700000000.5"])
def test_a_malformed_webhook_timestamp_is_a_401(post_events, creds, stamp):
    body = json.dumps({"events": [feedback()]}).encode()
    headers = {**sign(creds.webhook_secret, body), "webhook-timestamp": stamp}
    error = _error(post_events(None, raw=body, headers=headers), 401, "unauthorized")
    assert "webhook-timestamp" in error["message"] and "seconds" in error["fix"]


@pytest.mark.parametrize("slug", ["acme\x00", "a" * 10_000, "\u00e9", ""])
def test_a_malformed_project_is_a_401(client, creds, slug):
    body = json.dumps({"events": [feedback()]}).encode()
    headers = as_django_headers(sign(creds.webhook_secret, body))
    response = client.generic("POST", "/api/v1/events?" + "project=" + slug.replace("\x00", "%00"), body,
                              content_type="application/json", **headers)
    _error(response, 401, "unauthorized")


def test_a_signed_body_that_is_not_utf8_is_a_400(post_events, creds):
    body = b'{"events": [{"type": "feedback", "id": "\xff\xfe"}]}'
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(int(datetime.now(tz=UTC).timestamp())),
               "webhook-signature": "v1,AAAA"}
    error = _error(post_events(None, raw=body, headers=headers), 400, "bad_request")
    assert "UTF-8" in error["message"] and "UTF-8" in error["fix"]


def test_a_utf16_body_with_a_key_is_a_400(client, creds):
    body = json.dumps({"events": [feedback()]}).encode("utf-16")
    response = client.generic("POST", "/api/v1/events", body, content_type="application/json",
                              HTTP_AUTHORIZATION=f"Bearer {creds.api_key}")
    assert "UTF-8" in _error(response, 400, "bad_request")["message"]
    assert FeedbackEvent.objects.count() == 0


@pytest.mark.parametrize("length,status,code", [
    ("\u00b2", 400, "bad_request"), ("-1", 400, "bad_request"), ("1e9", 400, "bad_request"),
    ("9" * 5000, 413, "payload_too_large"),
])
def test_a_malformed_content_length_is_a_4xx(client, creds, length, status, code):
    body = json.dumps({"events": [feedback()]}).encode()
    headers = {**sign(creds.webhook_secret, body), "flywheel-project": creds.project.slug}
    response = client.generic("POST", "/api/v1/events", body, content_type="application/json",
                              CONTENT_LENGTH=length, **as_django_headers(headers))
    _error(response, status, code)


# --- one event's failure never costs the batch ---------------------------------------------------------


def test_an_unexpected_parser_error_refuses_only_its_event(post_events, monkeypatch):
    import feedback.services as services

    real = services.parse_event

    def parse(raw, now, salt):
        if raw.get("id") == "boom":
            raise RuntimeError("a bug in the parser")
        return real(raw, now, salt)

    monkeypatch.setattr(services, "parse_event", parse)
    reason = _refused_alone(post_events, feedback("boom"), "RuntimeError")
    assert "a bug in the parser" not in reason  # internals stay in the log


def test_a_row_the_database_refuses_costs_only_its_event(post_events, monkeypatch):
    # A gap in the parser, simulated by widening its id limit past the column's 255 characters.
    import feedback.events as events

    monkeypatch.setattr(events, "MAX_ID_CHARS", 10_000)
    body = post_events([trajectory("t-ok"), feedback("good"), trajectory("t" * 300), feedback("f" * 300)]).json()
    assert [r["status"] for r in body["results"]] == ["accepted", "accepted", "rejected", "rejected"]
    assert "database" in body["results"][2]["reason"]
    assert Trajectory.objects.get().external_id == "t-ok" and Step.objects.count() == 1
    assert FeedbackEvent.objects.get().event_id == "good"


@pytest.mark.django_db(transaction=True)
def test_hostile_requests_over_real_http_get_4xx_and_hostile_events_are_refused_alone(asgi_server, creds):
    import httpx

    url, project = f"{asgi_server}/api/v1/events", {"flywheel-project": creds.project.slug}

    def post(body: bytes, **headers) -> httpx.Response:
        return httpx.post(url, content=body, headers={**project, "content-type": "application/json", **headers})

    good = json.dumps({"events": [feedback("good")]}).encode()
    not_utf8 = b'{"events": [{"type": "feedback", "id": "\xff"}]}'
    assert post(not_utf8, **sign(creds.webhook_secret, good)).status_code == 400
    bad_signature = {**sign(creds.webhook_secret, good), "webhook-signature": b"v1,\xe9t\xe9"}
    assert post(good, **bad_signature).json()["error"]["code"] == "unauthorized"
    deep = b'{"events": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}"
    assert post(deep, **sign(creds.webhook_secret, deep)).status_code == 400
    hostile = [feedback("good"), feedback("x", value=HUGE), trajectory("y", task=SURROGATE),
               feedback("z", occurred_at="0001-01-01T00:00:00+14:00")]
    body = json.dumps({"events": hostile}).encode()
    answer = post(body, **sign(creds.webhook_secret, body)).json()
    assert [r["status"] for r in answer["results"]] == ["accepted", "rejected", "rejected", "rejected"]
    assert FeedbackEvent.objects.get().event_id == "good" and Trajectory.objects.count() == 0


# --- no oracle: a real project slug and a made-up one get the same answers ------------------------


def _answer(response) -> tuple[int, dict]:
    return response.status_code, response.json()["error"]


@pytest.mark.parametrize("case", ["wrong secret", "stale timestamp", "malformed signature"])
def test_webhook_errors_are_the_same_for_a_real_and_a_made_up_project(post_events, creds, case):
    body = json.dumps({"events": [feedback("f")]}).encode()
    wrong = "whsec_" + base64.b64encode(b"x" * 24).decode()
    headers = {"wrong secret": sign(wrong, body),
               "stale timestamp": sign(wrong, body, at=datetime.now(tz=UTC) - timedelta(hours=1)),
               "malformed signature": {**sign(wrong, body), "webhook-signature": "v1,!!"}}[case]
    real = post_events(None, raw=body, headers=headers, project=creds.project.slug)
    made_up = post_events(None, raw=body, headers=headers, project="no-such-project")
    assert real.status_code == 401 and _answer(real) == _answer(made_up)


def test_a_project_without_an_active_secret_answers_like_a_wrong_signature(post_events, creds, other_creds):
    from feedback.models import WebhookSecret

    WebhookSecret.objects.filter(project=other_creds.project).delete()
    body = json.dumps({"events": [feedback("f")]}).encode()
    headers = sign(other_creds.webhook_secret, body)
    no_secret = post_events(None, raw=body, headers=headers, project=other_creds.project.slug)
    wrong = post_events(None, raw=body, headers=headers, project=creds.project.slug)
    assert no_secret.status_code == 401 and _answer(no_secret) == _answer(wrong)


# --- graded signals ------------------------------------------------------------------------------------


def test_a_graded_value_out_of_its_range_refuses_its_event_with_the_unit(post_events):
    _each_refused_alone(post_events, {
        "negative chars": (feedback("x", value=-3), "accepted characters: send a finite whole number in [0, 100000]"),
        "fractional chars": (feedback("x", value=2.5), "whole number"),
        "too many chars": (feedback("x", value=100_001), "[0, 100000]"),
        "chars as text": (feedback("x", value="12"), "accepted characters"),
        "fraction above 1": (feedback("x", signal="edit_kept", value=1.5), "kept fraction: send a finite number in [0, 1]"),
        "negative fraction": (feedback("x", signal="edit_kept", value=-0.1), "kept fraction"),
        "fraction as a bool": (feedback("x", signal="edit_kept", value=True), "kept fraction"),
    })


def test_graded_values_in_range_are_stored(post_events):
    events = [feedback("a", value=17), feedback("b", value=0), feedback("c", signal="edit_kept", value=0.25),
              feedback("d", value=None), feedback("e", signal="reject", value=-3)]
    response = post_events(None, raw=json.dumps({"events": events}).encode())
    assert [r["status"] for r in response.json()["results"]] == ["accepted"] * 5
    assert dict(FeedbackEvent.objects.values_list("event_id", "value")) == {
        "a": 17.0, "b": 0.0, "c": 0.25, "d": None, "e": -3.0}
