"""Simulated user populations: tastes, corpora, click noise, silence that gets no click."""

from __future__ import annotations

import random

import pytest

from webapp.demo.simulator import aspect_labels, corpus_lines, likes, react, user_keys


@pytest.mark.parametrize(("taste", "completion", "liked"), [
    ("compiles", " b)\nx = 1", True), ("one-statement", " b)\nx = 1", False), ("one-statement", " b)", True),
    ("compiles", " b", False), ("short-compiles", " b)", True), ("short-compiles", " b)  # " + "x" * 40, False),
])
def test_each_taste_judges_a_suggestion_its_own_way(taste, completion, liked):
    assert likes(taste, "f(a,", completion) is liked


def test_an_empty_suggestion_is_not_shown_so_it_gets_no_click():
    assert react("x = ", "  ", random.Random(0)) == []


def test_click_noise_is_the_share_of_random_clicks():
    rng = random.Random(3)
    signals = [react("x = (", "1)", rng, taste="compiles", noise=0.2)[0].signal for _ in range(4000)]
    # liked: accepted except when a random click (20%) says reject half the time
    assert signals.count("reject") / len(signals) == pytest.approx(0.1, abs=0.02)


def test_a_population_writes_the_code_of_its_own_corpus(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def handler(event, context):\n    return respond(event)\n\nx\n")
    (tmp_path / "notes.txt").write_text("not python")
    assert corpus_lines(tmp_path) == ["def handler(event, context):", "return respond(event)"]
    with pytest.raises(ValueError, match="no Python lines"):
        corpus_lines(tmp_path / "pkg", min_chars=100)


def test_aspect_labels_are_on_the_judges_scale():
    labels = aspect_labels("x = (", "1)")
    assert set(labels) == {"style", "concision"} and all(0 <= v <= 1 for v in labels.values())


# --- intent-taste users on a code base the base policy never saw -----------------------------

from webapp.demo.simulator import (  # noqa: E402 - grouped with the tests that use them
    INTENT,
    UserPrompt,
    code_base,
    held_out_prompts,
    intent_prompt,
    population_metrics,
    user_prompts,
)

SOURCE = '''import json


def handler(event, context):
    payload = json.loads(event["body"])
    return respond(payload, status=200)
'''


def _code(tmp_path, files: int = 40):
    for i in range(files):
        (tmp_path / f"mod_{i}.py").write_text(SOURCE.replace("handler", f"handler_{i}"))
    return code_base(tmp_path)


def test_an_intent_prompt_is_the_files_preceding_lines_and_the_lines_start():
    lines = SOURCE.splitlines()
    request = intent_prompt(lines, 5, 6)
    assert request.prompt.endswith('payload = json.loads(event["body"])\n    return')
    assert request.prompt.startswith("import json") and request.intended == " respond(payload, status=200)"
    assert intent_prompt(lines, 0, 6) is None  # "import json": too short to type a continuation of


@pytest.mark.parametrize(("suggestion", "signal", "value"), [
    (" respond(payload, status=200)\nx = 1", "accept", 29.0),  # the first line whole
    (" respond(payload, code=5)", "accept", 18.0),  # partial: the characters kept
    (" print(payload)", "reject", None),
    ("   ", None, None),  # not shown: no click
])
def test_an_intent_user_accepts_what_they_were_about_to_type(suggestion, signal, value):
    reactions = react("    return", suggestion, random.Random(0), taste=INTENT, noise=0.0,
                      intended=" respond(payload, status=200)")
    if signal is None:
        assert reactions == []
    else:
        assert (reactions[0].signal, reactions[0].value) == (signal, value)


def test_held_out_files_are_fixed_by_path_and_never_sent_by_users(tmp_path):
    code = _code(tmp_path)
    held = {f.path for f in code.held_out_files()}
    assert held and len(held) < len(code.files)  # some, not all
    assert held == {f.path for f in code_base(tmp_path).held_out_files()}  # the same on every load
    sent = user_prompts(code, INTENT, random.Random(5))
    assert not {next(sent).path for _ in range(300)} & held
    assert {r.path for r in held_out_prompts(code, INTENT, 30)} <= held


def test_held_out_prompts_are_the_same_for_a_seed(tmp_path):
    code = _code(tmp_path)
    assert held_out_prompts(code, INTENT, 20) == held_out_prompts(code, INTENT, 20)
    assert held_out_prompts(code, "compiles", 20, seed=3)[0].prompt[0] != " "  # a line taste's: dedented


def test_a_population_reports_utility_silence_invented_names_and_collapse(tmp_path):
    code = _code(tmp_path, files=2)
    requests = [UserPrompt("    return", " respond(payload, status=200)")] * 4
    suggestions = [" respond(payload, status=200)", " respond(zorblax)", "", " respond(payload, status=200)"]
    m = population_metrics(INTENT, requests, suggestions, code.known)
    assert m["accepted_chars"] == pytest.approx((29 + 9 + 0 + 29) / 4)  # " respond(" kept of the second
    assert m["accept_rate"] == pytest.approx(3 / 4) and m["silent_rate"] == pytest.approx(1 / 4)
    assert m["invented_share"] == pytest.approx(1 / 3)  # "zorblax" exists nowhere
    assert m["top_suggestion_share"] == pytest.approx(2 / 4)  # of the requests: one in two got it
    assert m["matched_chars"] == pytest.approx(m["accepted_chars"])
    compiles = population_metrics("compiles", [UserPrompt("x = (", "1)")], ["1)"], code.known)
    assert compiles["accept_rate"] == 1 and compiles["accepted_chars"] == 0  # "1)" is under 3 characters


def test_the_default_population_is_the_intent_taste_on_held_out_django_code():
    from webapp.demo.simulator import POPULATIONS, django_source

    assert POPULATIONS[0] == INTENT and {"compiles", "one-statement", "short-compiles"} <= set(POPULATIONS)
    assert (django_source() / "db" / "models" / "query.py").exists()


@pytest.mark.parametrize(("prompt", "completion", "style"), [
    ("import os\n\ndef handler(event", ", context):", 1.0),  # opens a block: reads as code
    ("x = 1\n    return", " respond(payload)", 1.0),  # the context's indentation is not judged
    ("x = 1\n    return", " respond(pay load)", 0.3),
    ("total = (a", " + b)", 1.0),  # a line taste's prompt: no context
])
def test_a_users_style_label_judges_the_line_being_typed_not_the_files_context(prompt, completion, style):
    assert aspect_labels(prompt, completion)["style"] == style


def test_a_line_taste_asks_with_a_statements_start_and_knows_the_rest_of_the_line():
    request = next(user_prompts(["    total = compute(a, b)"], "compiles", random.Random(1)))
    assert request.prompt + request.intended == "total = compute(a, b)" and 8 <= len(request.prompt) <= 24


def test_each_simulated_user_asks_with_its_own_key_when_there_are_enough():
    """Serving limits each key's rate (600 a minute by default): the demo's six users on one key
    were answered 429 four times in ten; given a key each, each asks with its own."""
    assert user_keys(["k1", "k2", "k3"], 3) == ["k1", "k2", "k3"]
    assert user_keys(["k1", "k2"], 3) == ["k1", "k2", "k1"]
    assert user_keys("k", 2) == ["k", "k"]
    with pytest.raises(ValueError, match="at least one serve key"):
        user_keys([], 2)
