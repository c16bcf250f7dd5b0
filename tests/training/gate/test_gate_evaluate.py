"""The gate's verdict on candidates built to be better, worse on one aspect, or gaming the judge."""

from __future__ import annotations

import random

from training.gate.config import GateThresholds
from training.gate.runner import Sample, SuiteSamples, evaluate

PROMPTS = 24
N = 4
ASPECTS = ("style", "helpfulness")


def production_samples(seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for p in range(PROMPTS):
        difficulty = rng.uniform(0.2, 0.8)
        for _ in range(N):
            verifiable = min(1.0, max(0.0, difficulty + rng.gauss(0, 0.05)))
            aspects = {a: min(1.0, max(0.0, difficulty + rng.gauss(0, 0.05))) for a in ASPECTS}
            words = rng.randint(8, 14)
            out.append(_sample(f"p{p}", verifiable, aspects, words, rng))
    return out


def _sample(prompt_id: str, verifiable: float, aspects: dict[str, float], words: int, rng: random.Random) -> Sample:
    text = " ".join(f"w{rng.randint(0, 10_000)}" for _ in range(words))
    logprobs = [rng.uniform(-3, -0.1) for _ in range(words)]
    judge = sum(aspects.values()) / len(aspects)
    return Sample(prompt_id, text, words, verifiable + sum(aspects.values()), verifiable, judge, dict(aspects),
                  logprobs=logprobs, other_logprobs=[lp - 0.02 for lp in logprobs])


def changed(base: list[Sample], *, verifiable: float = 0.0, aspects: dict[str, float] | None = None,
            length: float = 1.0, seed: int = 1) -> list[Sample]:
    """The candidate: each production sample shifted by the given amounts (same prompts)."""
    rng = random.Random(seed)
    out = []
    for s in base:
        shifted = {a: min(1.0, max(0.0, v + (aspects or {}).get(a, 0.0))) for a, v in s.aspects.items()}
        out.append(_sample(s.prompt_id, min(1.0, max(0.0, s.verifiable + verifiable)), shifted,
                           round(s.tokens * length), rng))
    return out


def verdict(candidate: list[Sample], production: list[Sample], **thresholds) -> dict[str, bool]:
    rows = evaluate(SuiteSamples(candidate, production), GateThresholds(**thresholds))
    return {r.name: r.passed for r in rows}


def test_a_candidate_better_by_construction_passes_every_check():
    prod = production_samples()
    checks = verdict(changed(prod, verifiable=0.1, aspects={"style": 0.05, "helpfulness": 0.1}), prod, margin=0.1)
    assert set(checks) == {"reward_improvement", "aspect:style", "aspect:helpfulness", "kl", "length_drift",
                           "silence_jump", "repeated_ngram_jump", "tool_call_failure_jump",
                           "judge_verifiable_divergence", "median_chars", "naturalness_logprob", "invented_names",
                           "collapse_top_share", "collapse_distinct", "matched_chars", "intended_logprob"}
    assert all(checks.values()), checks


def test_a_candidate_worse_on_one_aspect_fails_that_check_only():
    prod = production_samples()
    cand = changed(prod, verifiable=0.3, aspects={"style": -0.2, "helpfulness": 0.1})
    checks = verdict(cand, prod, margin=0.05, aspect_tolerance=0.05)
    assert [name for name, ok in checks.items() if not ok] == ["aspect:style"]


def test_an_aspect_tolerance_lets_a_small_loss_through():
    prod = production_samples()
    cand = changed(prod, verifiable=0.3, aspects={"style": -0.1})
    assert not verdict(cand, prod)["aspect:style"]
    assert verdict(cand, prod, aspect_tolerances={"style": 0.2})["aspect:style"]


def test_a_candidate_gaming_a_length_loving_judge_is_caught_by_the_detectors():
    # The rule judge rewards longer answers: judged aspects go up, the verifiable check drops,
    # and the total reward still rises, so the reward check alone would let it through.
    prod = production_samples()
    cand = changed(prod, verifiable=-0.15, aspects={"style": 0.25, "helpfulness": 0.25}, length=2.5)
    checks = verdict(cand, prod)
    assert checks["reward_improvement"]
    assert not checks["length_drift"]
    assert not checks["judge_verifiable_divergence"]


def test_silence_and_broken_tool_calls_are_caught():
    prod = production_samples()
    cand = [
        Sample(s.prompt_id, "Could you clarify what you mean?" if i % 3 == 0 else "<tool_call>{oops</tool_call>",
               s.tokens, s.reward + 1.0, s.verifiable, s.judge, s.aspects, s.logprobs, s.other_logprobs)
        for i, s in enumerate(prod)
    ]
    checks = verdict(cand, prod)
    assert not checks["silence_jump"]
    assert not checks["tool_call_failure_jump"]


def test_a_candidate_far_from_production_fails_the_kl_budget():
    prod = production_samples()
    cand = [Sample(s.prompt_id, s.text, s.tokens, s.reward + 1, s.verifiable, s.judge, s.aspects,
                   s.logprobs, [lp - 3.0 for lp in s.logprobs]) for s in prod]
    assert not verdict(cand, prod, kl_budget=0.5)["kl"]
    assert verdict(cand, prod, kl_budget=None)["kl"]


def test_a_candidate_that_shrinks_below_the_median_floor_is_refused_unless_production_already_is():
    prod = production_samples()
    tiny = changed(prod, verifiable=0.2, length=0.1)  # better on the checks, one word per suggestion
    checks = verdict(tiny, prod, length_ratio_max=100.0, min_median_chars=20)
    assert checks["median_chars"] is False and checks["reward_improvement"] and checks["length_drift"]
    assert "median_chars" not in verdict(tiny, prod, length_ratio_max=100.0, min_median_chars=None)  # off
    # production already shows one-word suggestions: the floor is what it shows, not more
    short_prod = changed(prod, length=0.1, seed=3)
    assert verdict(changed(short_prod, verifiable=0.2, seed=4), short_prod, min_median_chars=20)["median_chars"]
