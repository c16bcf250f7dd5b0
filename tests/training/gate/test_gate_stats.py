"""Paired bootstrap intervals and the KL estimate on fixtures with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from training.gate.stats import aspect_intervals, kl_estimate, paired_bootstrap


def test_a_constant_difference_has_a_zero_width_interval_at_that_difference():
    ci = paired_bootstrap([1.3, 0.8, 0.5], [1.0, 0.5, 0.2])
    assert ci.mean == pytest.approx(0.3)
    assert ci.low == pytest.approx(0.3) and ci.high == pytest.approx(0.3)


def test_the_interval_has_the_textbook_width_around_the_sample_mean():
    rng = np.random.default_rng(7)
    production = rng.normal(0, 1, 400)
    candidate = production + rng.normal(0.5, 1.0, 400)  # mean difference 0.5, sd 1
    ci = paired_bootstrap(candidate, production, resamples=4000)
    assert ci.low < ci.mean < ci.high
    assert ci.high - ci.low == pytest.approx(2 * 1.96 / math.sqrt(400), rel=0.2)


def test_95_percent_intervals_cover_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    hits = 0
    for replica in range(300):
        diff = rng.normal(0.5, 1.0, 100)
        ci = paired_bootstrap(diff, np.zeros(100), resamples=1000, seed=replica)
        hits += ci.low < 0.5 < ci.high
    assert 0.90 <= hits / 300 <= 0.99


def test_pairing_removes_the_prompt_difficulty_from_the_interval():
    rng = np.random.default_rng(1)
    difficulty = rng.normal(0, 5, 200)  # large shared per-prompt effect
    production = difficulty + rng.normal(0, 0.1, 200)
    candidate = difficulty + 0.2 + rng.normal(0, 0.1, 200)
    ci = paired_bootstrap(candidate, production)
    assert ci.low > 0.15  # an unpaired interval would straddle 0 with sd 5 per side
    assert ci.high < 0.25


def test_it_refuses_unpaired_samples():
    with pytest.raises(ValueError, match="equal"):
        paired_bootstrap([1.0, 2.0], [1.0])


def test_aspect_intervals_cover_the_shared_aspects_only():
    out = aspect_intervals({"style": [1, 1], "speed": [0, 0]}, {"style": [0.5, 0.5]})
    assert list(out) == ["style"]
    assert out["style"].mean == pytest.approx(0.5)


def test_kl_of_a_policy_with_itself_is_zero():
    assert kl_estimate([[-0.1, -2.0], [-0.5]], [[-0.1, -2.0], [-0.5]]) == 0.0


def test_kl_estimate_matches_the_exact_kl_between_two_categoricals():
    p = np.array([0.7, 0.2, 0.1])
    q = np.array([0.3, 0.3, 0.4])
    exact = float(np.sum(p * np.log(p / q)))
    tokens = np.random.default_rng(0).choice(3, size=20_000, p=p)
    estimate = kl_estimate([np.log(p[tokens]).tolist()], [np.log(q[tokens]).tolist()])
    assert estimate == pytest.approx(exact, rel=0.05)
