"""Reward-hacking detectors on hand-made completions."""

from __future__ import annotations

import pytest

from training.gate import detectors


def test_length_drift_is_the_ratio_of_mean_lengths():
    assert detectors.length_drift_ratio([20, 40], [10, 20]) == pytest.approx(2.0)
    assert detectors.length_drift_ratio([], []) == 1.0


@pytest.mark.parametrize("text", ["", "   \n", "I can't help with that.", "Could you clarify what you need?"])
def test_empty_answers_refusals_and_clarifying_questions_count_as_silence(text):
    assert detectors.is_silent(text)


def test_a_real_answer_is_not_silence():
    assert not detectors.is_silent("return a + b")
    assert detectors.silence_rate(["return a + b", ""]) == 0.5


def test_repeated_ngrams_are_counted_against_all_ngrams():
    assert detectors.repeated_ngram_rate("a b c d e f") == 0.0
    assert detectors.repeated_ngram_rate("a b c d a b c d a b c d") == pytest.approx(5 / 9)


def test_tool_call_failures_count_broken_calls_among_completions_that_call():
    good = '<tool_call>{"name": "edit", "arguments": {}}</tool_call>'
    broken = "<tool_call>{name: edit</tool_call>"
    nameless = '<tool_call>{"arguments": {}}</tool_call>'
    assert detectors.tool_call_failed("no call here") is None
    assert detectors.tool_call_failure_rate([good, broken, nameless, "plain text"]) == pytest.approx(2 / 3)


def test_divergence_flags_a_judge_that_rises_while_the_verifiable_check_falls():
    assert detectors.judge_verifiable_divergence(0.2, -0.1) == pytest.approx(0.3)
    assert detectors.judge_verifiable_divergence(0.2, 0.25) == 0.0
    assert detectors.judge_verifiable_divergence(-0.2, -0.5) == 0.0
