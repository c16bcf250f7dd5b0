"""Canary stopping rule: a Bayesian beta-binomial comparison of live success rates (accept/happy
vs reject/sad), canary vs production, checked as feedback arrives. Pure numpy.

Each arm's rate has a Beta(1 + successes, 1 + failures) posterior; P(canary < production) is
estimated from seeded posterior draws (deterministic for the same counts). Decide:
  rollback  when P(canary < production − tolerance) ≥ confidence,
  promote   when P(canary ≥ production − tolerance) ≥ confidence,
  continue  otherwise, or while either arm has fewer than `min_events` signals.
Checking after every batch inflates the error rate of a fixed-n test; the high confidence and the
minimum sample size are what keep it honest (and `max_events` ends a canary that never decides:
it then keeps production, the safe side).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

Decision = Literal["continue", "promote", "rollback"]


@dataclass(frozen=True)
class ArmCounts:
    successes: int
    failures: int

    @property
    def n(self) -> int:
        return self.successes + self.failures

    @property
    def rate(self) -> float:
        return self.successes / self.n if self.n else 0.0


@dataclass(frozen=True)
class CanaryRule:
    confidence: float = 0.95
    min_events: int = 100  # per arm
    max_events: int = 20_000  # per arm: undecided by then -> rollback
    tolerance: float = 0.0  # how much worse the canary may be and still be promoted
    draws: int = 20_000
    seed: int = 0


@dataclass(frozen=True)
class CanaryVerdict:
    decision: Decision
    p_worse: float  # P(canary rate < production rate − tolerance)
    canary: ArmCounts
    production: ArmCounts
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def prob_worse(canary: ArmCounts, production: ArmCounts, tolerance: float = 0.0, draws: int = 20_000,
               seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    c = rng.beta(1 + canary.successes, 1 + canary.failures, draws)  # (D,)
    p = rng.beta(1 + production.successes, 1 + production.failures, draws)  # (D,)
    return float(np.mean(c < p - tolerance))


def canary_decide(canary: ArmCounts, production: ArmCounts, rule: CanaryRule = CanaryRule()) -> CanaryVerdict:
    p_worse = prob_worse(canary, production, rule.tolerance, rule.draws, rule.seed)
    rates = f"canary {canary.rate:.3f} (n={canary.n}) vs production {production.rate:.3f} (n={production.n})"
    if min(canary.n, production.n) < rule.min_events:
        if max(canary.n, production.n) >= rule.max_events:
            return CanaryVerdict("rollback", p_worse, canary, production, f"undecided at the event cap; {rates}")
        return CanaryVerdict("continue", p_worse, canary, production, f"fewer than {rule.min_events} signals per arm; {rates}")
    if p_worse >= rule.confidence:
        return CanaryVerdict("rollback", p_worse, canary, production, f"P(canary worse) = {p_worse:.3f}; {rates}")
    if 1 - p_worse >= rule.confidence:
        return CanaryVerdict("promote", p_worse, canary, production, f"P(canary not worse) = {1 - p_worse:.3f}; {rates}")
    if min(canary.n, production.n) >= rule.max_events:
        return CanaryVerdict("rollback", p_worse, canary, production, f"undecided at the event cap; {rates}")
    return CanaryVerdict("continue", p_worse, canary, production, f"undecided, P(canary worse) = {p_worse:.3f}; {rates}")
