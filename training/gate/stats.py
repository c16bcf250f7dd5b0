"""Paired bootstrap intervals and a KL estimate from log-probs. Pure numpy.

The gate compares candidate and production on the *same* prompts, so differences are paired per
prompt: resampling prompts (not completions) keeps the prompt-difficulty correlation and gives a
much tighter interval than two independent means would.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int
    confidence: float

    def as_list(self) -> list[float]:
        return [self.low, self.high]

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def paired_bootstrap(
    candidate: Sequence[float],
    production: Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> Interval:
    """Percentile bootstrap interval of mean(candidate[i] - production[i]) over paired units."""
    c, p = np.asarray(candidate, dtype=np.float64), np.asarray(production, dtype=np.float64)
    if c.shape != p.shape or c.ndim != 1:
        raise ValueError(f"paired samples need equal 1-D shapes, got {c.shape} and {p.shape}")
    if c.size == 0:
        raise ValueError("paired_bootstrap needs at least one pair")
    diff = c - p  # (N,)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, diff.size, size=(resamples, diff.size))  # (B, N)
    means = diff[idx].mean(axis=1)  # (B,)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return Interval(float(diff.mean()), float(low), float(high), int(diff.size), confidence)


def aspect_intervals(
    candidate: Mapping[str, Sequence[float]],
    production: Mapping[str, Sequence[float]],
    **bootstrap: float | int,
) -> dict[str, Interval]:
    """One paired interval per aspect present on both sides (per-prompt aspect means)."""
    shared = sorted(set(candidate) & set(production))
    return {a: paired_bootstrap(candidate[a], production[a], **bootstrap) for a in shared}  # type: ignore[arg-type]


def kl_estimate(sample_logprobs: Sequence[Sequence[float]], other_logprobs: Sequence[Sequence[float]]) -> float:
    """Per-token KL(sampler ‖ other) from tokens sampled by the first policy (k3 estimator).

    k3 = (r − 1) − log r with r = other/sampler: unbiased and never negative, unlike the plain
    log-ratio whose sample mean can go below zero on few tokens.
    """
    terms: list[float] = []
    for mine, theirs in zip(sample_logprobs, other_logprobs, strict=True):
        if len(mine) != len(theirs):
            raise ValueError(f"log-prob lists differ in length: {len(mine)} vs {len(theirs)}")
        for a, b in zip(mine, theirs, strict=True):
            log_r = max(min(b - a, 50.0), -50.0)  # exp overflow guard; such a token fails any budget
            terms.append(math.expm1(log_r) - log_r)
    return float(np.mean(terms)) if terms else 0.0
