"""Judge calibration: per-aspect agreement between a judge and human labels.

Spearman's rho on the raw scores and Cohen's kappa on scores binarised at a threshold.
Plain Python (no scipy); a Django selector feeds it (aspect, judge score, human score) rows.

    .venv/bin/python -m pytest tests/training/rewards/test_calibration.py -q -p no:django
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Agreement:
    aspect: str
    n: int
    spearman: float | None  # None when undefined (fewer than 2 pairs or a constant side)
    kappa: float | None  # None when undefined (both raters constant on one and the same class)
    accuracy: float  # raw share of agreeing binarised labels


def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks; ties share the mean of the ranks they span (as scipy.stats.rankdata)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for j in range(start, end + 1):
            ranks[order[j]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    if len(x) < 2:
        return None
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    return pearson(average_ranks(x), average_ranks(y))


def cohen_kappa(a: Sequence[bool], b: Sequence[bool]) -> float | None:
    n = len(a)
    if n == 0:
        return None
    observed = sum(x == y for x, y in zip(a, b, strict=True)) / n
    pa, pb = sum(a) / n, sum(b) / n
    expected = pa * pb + (1 - pa) * (1 - pb)
    if expected == 1:
        return None
    return (observed - expected) / (1 - expected)


def aspect_agreement(
    rows: Iterable[tuple[str, float, float]], threshold: float = 0.5, human_threshold: float | None = None
) -> dict[str, Agreement]:
    """rows: (aspect, judge score, human score). A score >= threshold binarises to "good"."""
    by_aspect: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for aspect, judge, human in rows:
        by_aspect[aspect].append((float(judge), float(human)))
    cut_h = threshold if human_threshold is None else human_threshold
    return {aspect: _agreement(aspect, pairs, threshold, cut_h) for aspect, pairs in sorted(by_aspect.items())}


def _agreement(aspect: str, pairs: list[tuple[float, float]], cut_j: float, cut_h: float) -> Agreement:
    judge, human = [p[0] for p in pairs], [p[1] for p in pairs]
    bj, bh = [j >= cut_j for j in judge], [h >= cut_h for h in human]
    accuracy = sum(x == y for x, y in zip(bj, bh, strict=True)) / len(pairs)
    return Agreement(aspect, len(pairs), spearman(judge, human), cohen_kappa(bj, bh), accuracy)
