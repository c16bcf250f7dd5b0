"""Typed gate configuration (thresholds, suites): torch- and Django-free, so the admin and the
API validate a GatePolicy or an EvalSuite without importing either."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

AUTO = "auto"  # a threshold derived from measurements of the project's base (training/gate/defaults.py)
DERIVED = ("kl_budget", "length_ratio_max", "min_median_chars", "logprob_tolerance", "intended_logprob_tolerance")

@dataclass(frozen=True)
class GateThresholds:
    """What a candidate must show against production on an eval suite (GatePolicy.thresholds)."""

    margin: float = 0.0  # lower bound of the reward-improvement interval must exceed this
    aspect_tolerance: float = 0.05  # an aspect may lose at most this (interval lower bound)
    aspect_tolerances: dict[str, float] = field(default_factory=dict)  # per-aspect overrides
    # "auto" (the default of the four below): derived from the project's own base at the gate's
    # first run (training/gate/defaults.py; the report's policy["base"] shows the figures); a
    # number overrides it.
    kl_budget: float | str | None = AUTO  # nats per token, KL(candidate ‖ production); None: not checked
    length_ratio_max: float | str = AUTO  # candidate/production mean length within [1/x, x]
    silence_jump_max: float = 0.05  # empty/refusal/clarifying-question rate increase
    # The candidate's shown suggestions must keep a median of at least this many characters (or
    # production's median, if that is lower): no gain by shrinking. None: not checked.
    min_median_chars: float | str | None = AUTO
    # Naturalness: the candidate's suite completions' mean log-prob per token under the project's
    # reference (its base) may fall below the reference's own completions' by at most this
    # (interval lower bound, nats/token). None: not checked.
    logprob_tolerance: float | str | None = AUTO
    # The share of the names its suggestions write that exist neither in the project nor in the
    # language may not exceed the base's by more than this (interval lower bound). None: not checked.
    invented_jump_max: float | None = 0.0
    # Collapse: the most common suggestion's share of the suite's prompts may exceed the base's by
    # at most this, and the distinct-suggestion rate fall below the base's by at most that.
    top_share_jump_max: float | None = 0.1
    # Usefulness: on the suite's prompts cut from real lines (context["rest"]), the characters of
    # the candidate's suggestions that match what the user was about to type may not be shown
    # fewer than the base's by more than this per request (the interval's upper bound decides, as
    # for invented names: noise alone never refuses). None: not checked.
    matched_chars_tolerance: float | None = 0.0
    # The same prompts, teacher-forced: the candidate's mean log-prob per token of what the user was
    # about to type (the real line) may be shown below the base's by at most this many nats/token
    # (the interval's upper bound decides). Every prompt counts, not only those a sample happens to
    # match, so a candidate drifting from what people write is seen on a small suite. None: not checked.
    intended_logprob_tolerance: float | str | None = AUTO
    distinct_drop_max: float | None = 0.2
    repeated_ngram_jump_max: float = 0.05
    ngram: int = 4
    tool_failure_jump_max: float = 0.05
    divergence_max: float = 0.1  # judge improvement beyond the verifiable improvement
    confidence: float = 0.95
    resamples: int = 2000
    seed: int = 0
    # With agent tasks: G rollouts per task for each side (same seeds: common random numbers).
    # None: the agent row is informational; a number: the candidate's mean tests pass share may not
    # fall below production's by more than this (interval lower bound), as an aspect.
    agent_G: int = 2
    agent_tolerance: float | None = None
    # The project's corpus (training/gate/corpus_rows.py): held-out next-token loss may rise by at
    # most corpus_loss_tolerance nats, the greedy accepted characters on held-out line prefixes fall
    # by at most corpus_accept_tolerance (None: informational; a mid-trained candidate must lower the
    # loss and may lose at most 0.5 characters). A mid-trained candidate's users' reward may fall by
    # at most midtrain_reward_tolerance; its KL to production is checked only with midtrain_kl_budget.
    corpus_loss_tolerance: float | None = None
    corpus_accept_tolerance: float | None = None
    midtrain_reward_tolerance: float = 0.05
    midtrain_kl_budget: float | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> GateThresholds:
        """Overrides over the defaults; an unknown key is an error (a typo must not pass silently)."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown gate thresholds {unknown}; known: {sorted(known)}")
        out = cls(**data)
        if not 0 < out.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {out.confidence}")
        if not 1 <= out.agent_G <= 16:
            raise ValueError(f"agent_G must be in [1, 16], got {out.agent_G}")
        for problem in out.problems():
            raise ValueError(problem)
        return out

    def problems(self) -> list[str]:
        """What is wrong with these thresholds (empty when nothing), each saying how to fix it."""
        out = []
        for name in (*DERIVED, "invented_jump_max", "top_share_jump_max", "distinct_drop_max",
                     "matched_chars_tolerance"):
            value, floor = getattr(self, name), 1 if name == "length_ratio_max" else 0
            if (name in DERIVED and value == AUTO) or (value is None and floor == 0):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value < floor:
                allowed = [f"a number >= {floor}", *([repr(AUTO)] if name in DERIVED else []),
                           *(["null (not checked)"] if floor == 0 else [])]
                out.append(f"{name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {value!r}")
        return out

    @property
    def automatic(self) -> list[str]:
        """The thresholds left to the base's measurements."""
        return [name for name in DERIVED if getattr(self, name) == AUTO]

    def resolved(self, derived: Mapping[str, float]) -> GateThresholds:
        """These thresholds with each "auto" one replaced by its value derived from the base."""
        missing = sorted(set(self.automatic) - set(derived))
        if missing:
            raise ValueError(f"no derived value for {missing}: measure the base first (training/gate/defaults.py)")
        return replace(self, **{name: None if derived[name] is None else float(derived[name])
                                for name in self.automatic})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def tolerance(self, aspect: str) -> float:
        return float(self.aspect_tolerances.get(aspect, self.aspect_tolerance))


@dataclass(frozen=True)
class SuitePrompt:
    id: str
    prompt: str
    context: dict[str, Any] = field(default_factory=dict)  # check inputs: prefix, tests, ...


@dataclass(frozen=True)
class SuiteSpec:
    """An eval suite: prompts, verifiable checks, a judge rubric, and how to sample."""

    prompts: tuple[SuitePrompt, ...]
    checks: tuple[dict[str, Any], ...] = ()  # [{"name", "weight", **params}] (make_check)
    judge: dict[str, Any] | None = None  # make_judge config
    aspects: tuple[dict[str, Any], ...] = ()  # [{"name", "weight"}]: judge aspects in the reward
    n_samples: int = 4
    max_tokens: int = 32
    temperature: float = 1.0
    seed: int = 0

    @classmethod
    def from_json(cls, prompts: Sequence[Mapping[str, Any]], **rest: Any) -> SuiteSpec:
        if not prompts:
            raise ValueError("an eval suite needs at least one prompt")
        parsed = tuple(_prompt(i, p) for i, p in enumerate(prompts))
        ids = [p.id for p in parsed]
        if len(set(ids)) != len(ids):
            raise ValueError("prompt ids in an eval suite must be unique")
        checks = tuple(dict(c) for c in rest.pop("checks", ()) or ())
        aspects = tuple(dict(a) for a in rest.pop("aspects", ()) or ())
        return cls(parsed, checks, aspects=aspects, **rest)


def _prompt(index: int, item: Mapping[str, Any]) -> SuitePrompt:
    if "prompt" not in item:
        raise ValueError(f"suite prompt {index} has no 'prompt': {dict(item)!r}")
    return SuitePrompt(str(item.get("id", index)), str(item["prompt"]), dict(item.get("context", {})))
