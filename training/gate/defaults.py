"""The gate's thresholds for a fresh project, derived from its own base instead of constants opened
by hand for one model: measured once per (base, suite) at the gate's first run, on the base's own
samples of the suite at two seeds, and stored with every GateReport (policy["base"]). A number in
the gate policy overrides each. Pure Python.

    measure = base_measure([samples_seed_a, samples_seed_b], seeds=[0, 1])
    thresholds = GateThresholds().resolved(measure.derived())

How each is derived (H: the base's entropy per token on the suite, estimated without bias as
minus the mean log-prob of its own sampled tokens, over both seeds):

- kl_budget = H. KL(candidate ‖ production) may be as large as the base's own uncertainty: any
  sharpening of the base up to its greedy choice stays inside (KL(greedy ‖ base) = −log p_max ≤ H
  at every position), a move to text the base finds less likely than its typical tokens does not.
  A sharp base (H small) gets a tight budget, a tiny high-entropy one a wide one.
- logprob_tolerance = H / 2. The candidate's text may be less likely under the reference than the
  reference's own by at most half its entropy per token: sharpening raises that log-prob, ending a
  statement costs a token or two, gibberish costs several nats on every token.
- length_ratio_max = the spread of the base's own completion lengths: max(mean / p25, p75 / mean)
  of its token counts (a candidate's mean outside the base's middle half is not the base's kind of
  answer), within [1.5, 3]: a base that always runs to the token limit has no spread and learning to
  end a statement must still pass; one that often stops after a token would switch the row off.
- min_median_chars = the 25th percentile of the base's shown suggestions' characters (first
  line): a candidate whose typical suggestion is shorter than three in four of the base's gains by
  shrinking. The row's floor is still production's median when that is lower.

The figures of the two seeds (`entropy_by_seed`) say how far the measurement itself moves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from training.gate.naturalness import distinct_rate, invented_share, mean_logprob, shown, top_share
from training.gate.samples import Sample, by_prompt
from training.rewards.usefulness import known_names

LENGTH_RATIO_FLOOR = 1.5  # the library's length bound before it was derived; derived ones only widen it
LENGTH_RATIO_CEILING = 3.0
INTENDED_SHARE = 0.05  # past it the row would never fire (a base that often stops after one token)


@dataclass(frozen=True)
class BaseMeasure:
    """The project's base on its suite: what the derived thresholds are made of."""

    entropy: float  # nats per token
    entropy_by_seed: tuple[float, ...]
    tokens_mean: float
    tokens_p25: float
    tokens_p75: float
    chars_p25: float  # shown suggestions' characters
    chars_median: float
    samples: int
    seeds: tuple[int, ...] = ()
    # What the naturalness and collapse rows compare a candidate with (informative here; the rows
    # recompute them on each run's samples): invented-name share, most common suggestion's share,
    # distinct-suggestion rate, over both seeds.
    invented_share: float | None = None
    top_share: float | None = None
    distinct_rate: float | None = None
    # The base's mean negative log-prob per token of the lines people were about to type on the
    # suite's prompts cut from real lines (teacher-forced; None: the suite has none).
    intended_nll: float | None = None

    def derived(self) -> dict[str, float]:
        spread = max(self.tokens_mean / max(self.tokens_p25, 1.0), self.tokens_p75 / max(self.tokens_mean, 1e-9))
        return {"kl_budget": round(self.entropy, 4), "logprob_tolerance": round(self.entropy / 2, 4),
                "length_ratio_max": round(min(max(LENGTH_RATIO_FLOOR, spread), LENGTH_RATIO_CEILING), 4),
                "min_median_chars": self.chars_p25,
                "intended_logprob_tolerance": (None if self.intended_nll is None
                                               else round(INTENDED_SHARE * self.intended_nll, 4))}

    def as_dict(self) -> dict[str, Any]:
        """JSON as stored (tuples as lists), with the thresholds derived from it."""
        plain = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        return {**plain, "derived": self.derived()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BaseMeasure:
        known = set(cls.__dataclass_fields__)
        values = {k: v for k, v in data.items() if k in known}
        return cls(**{**values, "entropy_by_seed": tuple(values["entropy_by_seed"]),
                      "seeds": tuple(values.get("seeds", ()))})


def base_measure(sample_sets: Sequence[Sequence[Sample]], seeds: Sequence[int] = (),
                 prompts: Mapping[str, str] | None = None, known: frozenset[str] | None = None,
                 intended: Sequence[Sequence[float]] = ()) -> BaseMeasure:
    """Measures the base from its own samples of the suite, one list per seed (`prompts` and
    `known` add its naturalness figures; `intended`: its log-probs of the lines people were about
    to type, one list per prompt cut from a real line)."""
    by_seed = [mean_logprob([s.logprobs or [] for s in samples]) for samples in sample_sets]
    entropies = tuple(-lp for lp in by_seed if lp is not None)
    pooled = [s for samples in sample_sets for s in samples]
    if not pooled:
        raise ValueError("the base gave no sample of the suite; nothing to measure")
    lengths = sorted(float(s.tokens) for s in pooled)
    chars = sorted(float(len(shown(s.text))) for s in pooled if shown(s.text))
    return BaseMeasure(
        entropy=round(sum(entropies) / len(entropies), 4) if entropies else 0.0,
        entropy_by_seed=tuple(round(h, 4) for h in entropies), tokens_mean=round(sum(lengths) / len(lengths), 4),
        tokens_p25=_quantile(lengths, 0.25), tokens_p75=_quantile(lengths, 0.75),
        chars_p25=_quantile(chars, 0.25), chars_median=_quantile(chars, 0.5), samples=len(pooled),
        seeds=tuple(seeds), intended_nll=_nll(intended), **(_naturalness(sample_sets, prompts, known) if prompts is not None else {}))


def _naturalness(sample_sets: Sequence[Sequence[Sample]], prompts: Mapping[str, str],
                 known: frozenset[str] | None) -> dict[str, float]:
    known = known if known is not None else known_names(prompts.values())
    pooled = [(s.text, prompts.get(s.prompt_id, "")) for samples in sample_sets for s in samples]
    groups = [list(by_prompt(samples).values()) for samples in sample_sets]
    tops = [top_share([[s.text for s in g] for g in seed]) for seed in groups]
    distinct = [distinct_rate([[s.text for s in g] for g in seed]) for seed in groups]
    return {"invented_share": round(invented_share(pooled, known), 4), "top_share": round(sum(tops) / len(tops), 4),
            "distinct_rate": round(sum(distinct) / len(distinct), 4)}


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank quantile of sorted values (0 when there are none)."""
    if not ordered:
        return 0.0
    return float(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))])


def _nll(logprobs: Sequence[Sequence[float]]) -> float | None:
    """Mean negative log-prob per token, prompt by prompt then averaged (None: no token)."""
    means = [-sum(row) / len(row) for row in logprobs if row]
    return round(sum(means) / len(means), 4) if means else None
