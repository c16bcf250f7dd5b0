"""Whether a policy writes what a person would: the figures behind the gate's naturalness and
collapse rows, each compared with the same figure of the project's base. Pure Python.

A suggestion here is what a tab-completion user sees: the completion's first line, stripped.

- `invented_counts`: the names a suggestion writes, and how many of them exist neither in the
  project nor in the language (`training.rewards.usefulness`, the one home of that rule).
- `top_share`: the most common suggestion's share of the suite's prompts (a policy that answers
  `(self)` to two prompts in three has 0.67; a base writing code has a few percent).
- `distinct_rate`: distinct suggestions over the prompts answered (1.0: every prompt its own).

Both collapse figures are taken across prompts at one sample index and averaged over the indices:
a policy that answers each prompt the same way every time (a sharp, good one) is not collapsed;
one that answers every prompt the same way is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from training.gate import stats
from training.gate.config import GateThresholds
from training.gate.samples import CheckRow, Sample, SuiteSamples, by_prompt
from training.rewards.usefulness import accepted_chars, first_line, invented_names, known_names, written_names


def shown(text: str) -> str:
    """The suggestion a tab-completion user sees: the first line, stripped ('' when none is shown)."""
    return first_line(text).strip()


def invented_counts(text: str, prompt: str, known: frozenset[str]) -> tuple[int, int]:
    """(invented, written) names of the suggestion's first line; its last name counts as cut (only
    the start of a known name needed) when the completion ends on that line."""
    line = first_line(text)
    truncated = "\n" not in text
    return len(invented_names(line, prompt, known, truncated)), len(written_names(line, prompt))


def invented_share(items: Sequence[tuple[str, str]], known: frozenset[str]) -> float:
    """Invented names over written names of (completion, prompt) pairs; 0 when none writes a name."""
    counts = [invented_counts(text, prompt, known) for text, prompt in items]
    written = sum(w for _, w in counts)
    return sum(i for i, _ in counts) / written if written else 0.0


def inventing_share(items: Sequence[tuple[str, str]], known: frozenset[str]) -> float:
    """The share of shown suggestions that write at least one invented name."""
    flags = [invented_counts(text, prompt, known)[0] > 0 for text, prompt in items if shown(text)]
    return sum(flags) / len(flags) if flags else 0.0


def _columns(groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """groups[p][j]: prompt p's j-th completion → one column per sample index j of the shown
    suggestions across prompts."""
    width = min((len(g) for g in groups), default=0)
    return [[shown(g[j]) for g in groups] for j in range(width)]


def top_share(groups: Sequence[Sequence[str]]) -> float:
    """The most common shown suggestion's share of the prompts, per sample index, averaged."""
    shares = []
    for column in _columns(groups):
        counts = Counter(s for s in column if s)
        shares.append(counts.most_common(1)[0][1] / len(column) if counts else 0.0)
    return sum(shares) / len(shares) if shares else 0.0


def top_suggestion(groups: Sequence[Sequence[str]]) -> str:
    """The most common shown suggestion over all samples ('' when none is shown)."""
    counts = Counter(s for column in _columns(groups) for s in column if s)
    return counts.most_common(1)[0][0] if counts else ""


def distinct_rate(groups: Sequence[Sequence[str]]) -> float:
    """Distinct shown suggestions over the prompts shown one, per sample index, averaged."""
    rates = []
    for column in _columns(groups):
        answered = [s for s in column if s]
        if answered:
            rates.append(len(set(answered)) / len(answered))
    return sum(rates) / len(rates) if rates else 0.0


def mean_logprob(logprobs: Sequence[Sequence[float]]) -> float | None:
    """Token-mean log-prob (nats/token) of completions; None when they hold no token."""
    flat = [lp for row in logprobs for lp in row]
    return sum(flat) / len(flat) if flat else None


# ---------------------------------------------------------------------------------- rows


def naturalness_rows(samples: SuiteSamples, t: GateThresholds, known: frozenset[str] | None,
                     boot: dict) -> list[CheckRow]:
    """The candidate against the base (`samples.base`) on the prompts both answered: log-prob under
    the reference, invented-name share, and the two collapse figures."""
    cand, base = by_prompt(samples.candidate), by_prompt(samples.base)
    shared = sorted(set(cand) & set(base))
    known = known if known is not None else known_names(samples.prompts.values())
    return [_logprob_row(samples, cand, base, shared, t, boot),
            _invented_row(samples.prompts, cand, base, shared, known, t, boot),
            *_collapse_rows(cand, base, shared, t),
            _matched_row(samples.intended, cand, base, shared, t, boot),
            _intended_row(samples.intended_logprobs, t, boot)]


def _on_reference(s: Sample, production_is_reference: bool) -> list[float] | None:
    if s.ref_logprobs is not None:
        return s.ref_logprobs
    return s.other_logprobs if production_is_reference else None


def _logprob_row(samples: SuiteSamples, cand: dict[str, list[Sample]], base: dict[str, list[Sample]],
                 shared: list[str], t: GateThresholds, boot: dict) -> CheckRow:
    name = "naturalness_logprob"
    if t.logprob_tolerance is None:
        return CheckRow(name, None, None, None, True, "not checked (no logprob_tolerance in the gate policy)")
    tolerance = -float(t.logprob_tolerance)
    lists = {p: [_on_reference(s, samples.reference is None) for s in cand[p]] for p in shared}
    if any(lp is None for rows in lists.values() for lp in rows):
        return CheckRow(name, None, tolerance, None, False, "not measured: the reference gave no log-probs")
    pairs = [(mean_logprob(lists[p]), mean_logprob([s.logprobs or [] for s in base[p]])) for p in shared]
    pairs = [(c, b) for c, b in pairs if c is not None and b is not None]
    if not pairs:
        return CheckRow(name, None, tolerance, None, False, "not measured: no tokens on both sides")
    ci = stats.paired_bootstrap([c for c, _ in pairs], [b for _, b in pairs], **boot)
    c_mean, b_mean = (sum(x) / len(x) for x in zip(*pairs, strict=True))
    return CheckRow(name, ci.mean, tolerance, ci.as_list(), ci.low >= tolerance,
                    f"mean log-prob per token under the reference: candidate {c_mean:.3f}, the reference's own "
                    f"{b_mean:.3f} nats over {ci.n} prompts; the interval's lower bound may not fall below "
                    "the threshold")


def _invented_row(prompts: dict[str, str], cand: dict[str, list[Sample]], base: dict[str, list[Sample]],
                  shared: list[str], known: frozenset[str], t: GateThresholds, boot: dict) -> CheckRow:
    name = "invented_names"
    if t.invented_jump_max is None or not shared:
        return CheckRow(name, None, t.invented_jump_max, None, True, "not checked")

    def shares(groups: dict[str, list[Sample]]) -> list[float]:
        return [invented_share([(s.text, prompts.get(p, "")) for s in groups[p]], known) for p in shared]

    c, b = shares(cand), shares(base)
    ci = stats.paired_bootstrap(c, b, **boot)
    items = {side: [(s.text, prompts.get(s.prompt_id, "")) for p in shared for s in groups[p]]
             for side, groups in (("candidate", cand), ("base", base))}
    limit = float(t.invented_jump_max)
    return CheckRow(name, ci.mean, limit, ci.as_list(), ci.low <= limit,
                    f"share of the names its suggestions write that exist neither in the project nor in the "
                    f"language: candidate {sum(c) / len(c):.3f}, base {sum(b) / len(b):.3f} (per prompt, "
                    f"{ci.n} prompts); suggestions inventing a name: candidate "
                    f"{inventing_share(items['candidate'], known):.3f}, base {inventing_share(items['base'], known):.3f}; "
                    "the interval's lower bound may not exceed the threshold")


def _collapse_rows(cand: dict[str, list[Sample]], base: dict[str, list[Sample]], shared: list[str],
                   t: GateThresholds) -> list[CheckRow]:
    c_groups = [[s.text for s in cand[p]] for p in shared]
    b_groups = [[s.text for s in base[p]] for p in shared]
    rows = []
    if t.top_share_jump_max is not None:
        value, limit = top_share(c_groups), top_share(b_groups) + float(t.top_share_jump_max)
        rows.append(CheckRow("collapse_top_share", value, limit, None, value <= limit,
                             f"the most common suggestion's share of the {len(shared)} prompts "
                             f"({top_suggestion(c_groups)!r}); the base's {top_share(b_groups):.3f} "
                             f"+ {t.top_share_jump_max:g}"))
    if t.distinct_drop_max is not None:
        value, limit = distinct_rate(c_groups), distinct_rate(b_groups) - float(t.distinct_drop_max)
        rows.append(CheckRow("collapse_distinct", value, limit, None, value >= limit,
                             f"distinct suggestions over the prompts answered; the base's "
                             f"{distinct_rate(b_groups):.3f} − {t.distinct_drop_max:g}"))
    return rows


def _matched_row(intended: dict[str, str], cand: dict[str, list[Sample]], base: dict[str, list[Sample]],
                 shared: list[str], t: GateThresholds, boot: dict) -> CheckRow:
    """Characters matching what the user was about to type, per request, candidate − base, on the
    prompts whose rest of the line is known: a candidate that pleases a checker (compiles, is long
    enough) while writing less of what people type is refused here."""
    name = "matched_chars"
    known = [p for p in shared if p in intended]
    if t.matched_chars_tolerance is None:
        return CheckRow(name, None, None, None, True, "not checked (no matched_chars_tolerance in the gate policy)")
    if not known:
        return CheckRow(name, None, None, None, True,
                        "not measured: no suite prompt says what the user was about to type (context['rest'])")

    def per_prompt(groups: dict[str, list[Sample]]) -> list[float]:
        return [sum(accepted_chars(s.text, intended[p]) for s in groups[p]) / len(groups[p]) for p in known]

    c, b = per_prompt(cand), per_prompt(base)
    ci = stats.paired_bootstrap(c, b, **boot)
    limit = -float(t.matched_chars_tolerance)
    return CheckRow(name, ci.mean, limit, ci.as_list(), ci.high >= limit,
                    f"characters matching what the user was about to type, per request: candidate "
                    f"{sum(c) / len(c):.3f}, base {sum(b) / len(b):.3f} over {ci.n} prompts cut from real lines; "
                    "refused when the interval's upper bound falls below the threshold (shown fewer)")


def _intended_row(scored: dict[str, tuple[list[float], list[float]]], t: GateThresholds, boot: dict) -> CheckRow:
    """What the user was about to type, teacher-forced after each prompt cut from a real line: the
    candidate's mean log-prob per token minus the base's, paired by prompt. A candidate that
    learned a checker's taste (any line that compiles, a fixed string) finds people's own lines
    less likely; one that learned what they type finds them more likely."""
    name = "intended_logprob"
    if t.intended_logprob_tolerance is None:
        return CheckRow(name, None, None, None, True, "not checked (no intended_logprob_tolerance in the gate policy, "
                        "or the base's stored measurements predate it)")
    pairs = [(mean_logprob([c]), mean_logprob([b])) for c, b in scored.values()]
    pairs = [(c, b) for c, b in pairs if c is not None and b is not None]
    if not pairs:
        return CheckRow(name, None, None, None, True,
                        "not measured: no suite prompt says what the user was about to type (context['rest'])")
    c, b = [x for x, _ in pairs], [y for _, y in pairs]
    ci = stats.paired_bootstrap(c, b, **boot)
    limit = -float(t.intended_logprob_tolerance)
    return CheckRow(name, ci.mean, limit, ci.as_list(), ci.high >= limit,
                    f"log-prob per token of the line the user was about to type: candidate {sum(c) / len(c):.3f}, "
                    f"base {sum(b) / len(b):.3f} nats over {ci.n} prompts cut from real lines; refused when the "
                    "interval's upper bound falls below the threshold (shown less likely)")
