"""The canary stopping rule (Bayesian beta-binomial)."""

from __future__ import annotations

from training.promotion.sequential import ArmCounts, CanaryRule, canary_decide, prob_worse

RULE = CanaryRule(confidence=0.95, min_events=50, max_events=5000)


def test_a_clearly_worse_canary_is_rolled_back():
    verdict = canary_decide(ArmCounts(20, 80), ArmCounts(70, 30), RULE)
    assert verdict.decision == "rollback"
    assert verdict.p_worse > 0.99


def test_a_clearly_better_canary_is_promoted():
    assert canary_decide(ArmCounts(80, 20), ArmCounts(60, 40), RULE).decision == "promote"


def test_it_waits_for_the_minimum_number_of_signals():
    verdict = canary_decide(ArmCounts(0, 40), ArmCounts(40, 0), RULE)
    assert verdict.decision == "continue"
    assert "fewer than 50" in verdict.reason


def test_equal_rates_keep_it_running_until_the_cap_then_keep_production():
    assert canary_decide(ArmCounts(50, 50), ArmCounts(50, 50), RULE).decision == "continue"
    assert canary_decide(ArmCounts(2500, 2500), ArmCounts(2500, 2500), RULE).decision == "rollback"


def test_the_posterior_probability_is_deterministic_and_symmetric():
    a, b = ArmCounts(30, 70), ArmCounts(50, 50)
    assert prob_worse(a, b) == prob_worse(a, b)
    assert abs(prob_worse(a, b) + prob_worse(b, a) - 1) < 0.01
