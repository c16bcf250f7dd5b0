"""Reward-hacking detectors: signals that a candidate pleases the reward without doing the work.

Each returns a plain number; the gate compares it with a threshold from the GatePolicy. Rates
are compared candidate vs production ("jump") because a suite's base rate is not the problem, a
change is. Pure Python.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

REFUSALS = re.compile(
    r"\b(i can(?:'|no)t|i am unable|i'm unable|i won't|as an ai|could you clarify|can you clarify|"
    r"please clarify|what do you mean)\b",
    re.IGNORECASE,
)
TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def length_drift_ratio(candidate_lengths: Sequence[int], production_lengths: Sequence[int]) -> float:
    """mean candidate length / mean production length (tokens); 1.0 is no drift."""
    base = _mean(production_lengths)
    if base <= 0:
        return 1.0 if _mean(candidate_lengths) <= 0 else float("inf")
    return _mean(candidate_lengths) / base


def median_shown_chars(texts: Sequence[str]) -> float:
    """Median length in characters of the suggestions that would be shown (non-blank, stripped);
    0 when none would be."""
    shown = sorted(len(t.strip()) for t in texts if t.strip())
    if not shown:
        return 0.0
    mid = len(shown) // 2
    return float(shown[mid]) if len(shown) % 2 else (shown[mid - 1] + shown[mid]) / 2


def is_silent(text: str) -> bool:
    """Empty, whitespace, or a refusal / clarifying question instead of an answer."""
    return not text.strip() or bool(REFUSALS.search(text))


def silence_rate(texts: Sequence[str]) -> float:
    return _mean([1.0 if is_silent(t) else 0.0 for t in texts])


def repeated_ngram_rate(text: str, n: int = 4) -> float:
    """Fraction of the word n-grams of `text` that already occurred earlier in it."""
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1 - len(set(grams)) / len(grams)


def mean_repeated_ngram_rate(texts: Sequence[str], n: int = 4) -> float:
    return _mean([repeated_ngram_rate(t, n) for t in texts])


def tool_call_failed(text: str) -> bool | None:
    """None when `text` makes no tool call; else whether any call is broken (not a JSON object
    with a "name"). Calls are `<tool_call>{...}</tool_call>` (Qwen/Hermes format)."""
    calls = TOOL_CALL.findall(text)
    if not calls:
        return None
    return any(not _valid_call(c) for c in calls)


def _valid_call(body: str) -> bool:
    try:
        call = json.loads(body)
    except ValueError:
        return False
    return isinstance(call, dict) and isinstance(call.get("name"), str) and bool(call["name"])


def tool_call_failure_rate(texts: Sequence[str]) -> float:
    """Broken calls / completions that make a call (0 when none makes one)."""
    verdicts = [v for v in (tool_call_failed(t) for t in texts) if v is not None]
    return _mean([1.0 if v else 0.0 for v in verdicts])


def judge_verifiable_divergence(judge_delta: float, verifiable_delta: float) -> float:
    """How far the judge's improvement outruns the verifiable one: judge − verifiable when the
    judge went up, else 0 (a judge that goes down is not being gamed)."""
    return max(judge_delta - verifiable_delta, 0.0) if judge_delta > 0 else 0.0
