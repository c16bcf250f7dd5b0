"""The rules that say what a suggestion is worth to its user (training/rewards/usefulness.py), the
check that scores a suite by them and the gate's matched-characters row."""

import pytest

from training.gate.config import GateThresholds
from training.gate.naturalness import naturalness_rows
from training.gate.samples import Sample, SuiteSamples
from training.rewards.checks import CheckConfigError, make_check
from training.rewards.usefulness import (
    accepted_chars,
    intent_reaction,
    invented_names,
    known_names,
    language_names,
)


def test_the_accepted_characters_are_the_first_lines_common_prefix_with_what_was_intended():
    assert accepted_chars("(a, b)\n    return", "(a, b):") == 6
    assert accepted_chars("(a, c)", "(a, b):") == 4
    assert accepted_chars("(x", "(a, b):") == 0  # below the minimum: not worth a Tab
    assert accepted_chars("   ", "   x") == 0


def test_a_user_accepts_the_whole_line_part_of_it_or_rejects_it():
    assert intent_reaction("self.name = name", "self.name = name").signal == "accept"
    assert intent_reaction("self.name = name", "self.name = name").full
    partial = intent_reaction("self.name = other", "self.name = name")
    assert (partial.signal, partial.value, partial.full) == ("accept", 12, False)
    assert intent_reaction("zzz", "self").signal == "reject"
    assert intent_reaction("\n", "self").signal == ""


def test_invented_names_are_those_neither_the_code_base_nor_python_knows():
    known = known_names(["def parse_event(raw):\n    return raw\n"])
    assert invented_names("(raw)", "return parse_", known) == []  # continues the prompt's name
    assert invented_names("ribution_taskerderr = 1", "x = self", known) == ["selfribution_taskerderr"]
    assert invented_names(" = len(raw) + BURERUWF", "", known) == ["BURERUWF"]
    assert invented_names(" = pars", "x", known, truncated=True) == []  # cut mid-name at the end
    assert invented_names(" = pars", "x", known, truncated=False) == ["pars"]


def test_numbers_and_the_language_are_not_names_to_invent():
    known = known_names([])
    assert invented_names(" = 0x1f + 1e10", "x", known) == []
    assert {"isinstance", "append", "collections", "self", "match"} <= language_names()


def test_the_intent_match_check_scores_the_share_of_the_line_the_user_kept():
    check = make_check("intent_match")
    kept = check.run(" return a + b\n    more", {"rest": " return a + c  # sum\nnext line"})
    assert kept.score == pytest.approx(12 / 20) and kept.reason == "12 of 20 characters of the line kept"
    assert check.run("(a, b):", {"rest": "(a, b):"}).passed  # the whole line
    assert check.run("(x", {"rest": "(a, b):"}).score == 0.0  # below the minimum: not worth a Tab
    assert check.run("  \n", {"rest": "(a, b):"}).score == 0.0  # nothing suggested
    assert make_check("intent_match", min_chars=1).run("(x", {"rest": "(a, b):"}).score == pytest.approx(1 / 7)
    for context in ({}, {"rest": ""}, {"rest": 3}):
        with pytest.raises(CheckConfigError, match=r"context\['rest'\]"):
            check.run("(a", context)
    with pytest.raises(CheckConfigError, match="min_chars must be at least 1"):
        make_check("intent_match", min_chars=0)


def _samples(texts: dict[str, list[str]]) -> list[Sample]:
    return [Sample(p, t, len(t), 0.0) for p, ts in texts.items() for t in ts]


def test_the_gate_refuses_a_candidate_shown_to_write_less_of_what_people_type():
    intended = {f"p{i}": f"value_{i} = compute(value_{i - 1})" for i in range(10, 50)}
    base = {p: [rest[:12], rest[:8]] for p, rest in intended.items()}  # 12 and 8 characters kept
    pleaser = {p: ["(self)", "(self)"] for p in intended}  # compiles, real name, none of what was typed
    near = {p: [rest[:12], rest[:7] + "#"] for p, rest in intended.items()}  # one character fewer in one sample

    def row(candidate: dict[str, list[str]], **thresholds) -> dict:
        samples = SuiteSamples(_samples(candidate), _samples(base), prompts={p: "" for p in intended},
                               intended=intended)
        rows = naturalness_rows(samples, GateThresholds(logprob_tolerance=None, **thresholds), known_names([]),
                                {"seed": 0})
        return next(r for r in rows if r.name == "matched_chars").as_dict()

    refused = row(pleaser)
    assert not refused["passed"] and refused["value"] == pytest.approx(-10.0) and refused["interval"][1] < 0
    assert "candidate 0.000, base 10.000 over 40 prompts" in refused["detail"]
    assert row(base)["passed"] and row(base)["value"] == 0.0
    assert not row(near)["passed"]  # shown fewer (every prompt loses half a character) ...
    assert row(near, matched_chars_tolerance=1.0)["passed"]  # ... within a tolerance a policy may set
    assert row(pleaser, matched_chars_tolerance=None)["passed"]  # switched off
    unknown = SuiteSamples(_samples(pleaser), _samples(base), prompts={p: "" for p in intended})
    rows = naturalness_rows(unknown, GateThresholds(logprob_tolerance=None), known_names([]), {"seed": 0})
    assert next(r for r in rows if r.name == "matched_chars").passed  # no prompt says what was typed
