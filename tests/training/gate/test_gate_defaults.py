"""The gate's thresholds derived from a base's own samples, and how a gate policy sets or overrides them."""

from __future__ import annotations

import pytest

from training.gate.config import AUTO, GateThresholds
from training.gate.defaults import BaseMeasure, base_measure
from training.gate.samples import Sample


def _samples(lengths: list[int], logprob: float, text: str = "value = compute(x)") -> list[Sample]:
    return [Sample(f"p{i}", text if n else "", n, 0.0, logprobs=[logprob] * n) for i, n in enumerate(lengths)]


def test_the_kl_budget_is_the_bases_entropy_per_token_over_both_seeds():
    measure = base_measure([_samples([10] * 8, -2.0), _samples([10] * 8, -3.0)], seeds=(0, 1))
    assert measure.entropy_by_seed == (2.0, 3.0) and measure.entropy == 2.5
    assert measure.derived()["kl_budget"] == 2.5 and measure.derived()["logprob_tolerance"] == 1.25


def test_the_length_bound_is_the_spread_of_the_bases_own_lengths_never_tighter_than_the_library_default():
    always_full = base_measure([_samples([16] * 20, -1.0)])  # every completion runs to the limit
    assert always_full.derived()["length_ratio_max"] == 1.5
    spread = base_measure([_samples([2, 3, 4, 8, 8, 8, 8, 12, 13, 14], -1.0)])  # mean 8, p25 4, p75 12
    assert (spread.tokens_p25, spread.tokens_p75) == (4, 12)
    assert spread.derived()["length_ratio_max"] == pytest.approx(8.0 / 4)
    stops_at_once = base_measure([_samples([1] * 6 + [16] * 4, -1.0)])  # mean 7, p25 1: the row would be off
    assert stops_at_once.derived()["length_ratio_max"] == 3.0


def test_the_median_floor_is_the_bases_25th_percentile_of_shown_characters():
    texts = ["x = 1"] * 2 + ["value = 1"] * 6 + ["a much longer line of code"] * 2
    measure = base_measure([[Sample(f"p{i}", t, 4, 0.0, logprobs=[-1.0] * 4) for i, t in enumerate(texts)]])
    assert measure.chars_p25 == 9 and measure.derived()["min_median_chars"] == 9


def test_a_base_that_gave_nothing_cannot_be_measured():
    with pytest.raises(ValueError, match="no sample"):
        base_measure([[]])


def test_a_measure_survives_its_json_round_trip():
    measure = base_measure([_samples([3, 5], -1.5), _samples([4], -2.5)], seeds=(0, 1), prompts={"p0": "x = "})
    stored = measure.as_dict()
    assert stored["seeds"] == [0, 1] and stored["derived"] == measure.derived()
    assert BaseMeasure.from_dict(stored) == measure


def test_auto_thresholds_are_replaced_by_the_derived_values_and_explicit_ones_kept():
    t = GateThresholds.from_json({"kl_budget": 0.3, "min_median_chars": None})
    assert t.automatic == ["length_ratio_max", "logprob_tolerance", "intended_logprob_tolerance"]
    resolved = t.resolved({"kl_budget": 9.0, "length_ratio_max": 2.0, "min_median_chars": 6.0, "logprob_tolerance": 1.0,
                           "intended_logprob_tolerance": None})  # a suite with no real line: nothing to derive
    assert (resolved.kl_budget, resolved.length_ratio_max, resolved.min_median_chars, resolved.logprob_tolerance,
            resolved.intended_logprob_tolerance) == (0.3, 2.0, None, 1.0, None)
    with pytest.raises(ValueError, match="measure the base first"):
        GateThresholds().resolved({})


@pytest.mark.parametrize(("thresholds", "message"), [
    ({"kl_budget": "wide"}, "kl_budget must be a number >= 0, 'auto' or null"),
    ({"length_ratio_max": None}, "length_ratio_max must be a number >= 1 or 'auto'"),
    ({"length_ratio_max": 0.5}, "length_ratio_max must be a number >= 1 or 'auto'"),
    ({"invented_jump_max": -0.1}, "invented_jump_max must be a number >= 0 or null"),
    ({"top_share_jump_max": AUTO}, "top_share_jump_max must be a number >= 0 or null"),
    ({"logprob_tolerance": True}, "logprob_tolerance must be"),
])
def test_a_bad_threshold_is_refused_saying_what_it_may_be(thresholds, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        GateThresholds.from_json(thresholds)
