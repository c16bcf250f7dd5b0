"""Simulated user populations: tastes, corpora, click noise, silence that gets no click."""

from __future__ import annotations

import random

import pytest

from webapp.demo.simulator import aspect_labels, corpus_lines, likes, react


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
    signals = [react("x = (", "1)", rng, noise=0.2)[0].signal for _ in range(4000)]
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
