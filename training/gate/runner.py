"""Runs an eval suite: n samples per prompt from candidate and production through an inference
Engine, scored with the suite's verifiable checks and judge, then compared (`evaluate`) into the
GateReport's check rows. No Django; torch only through the engines passed in.

    samples = suite_collect(spec, candidate_engine, production_engine)
    rows = evaluate(samples, GateThresholds())
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from training.gate import detectors, stats
from training.gate.config import GateThresholds, SuiteSpec
from training.gate.defaults import base_measure
from training.gate.naturalness import naturalness_rows
from training.gate.samples import CheckRow, Sample, SuiteSamples, by_prompt
from training.rewards.checks import Check, check_from_config
from training.rewards.judges import Judge, make_judge
from training.rewards.spec import RewardSpecData, compute_reward

if TYPE_CHECKING:
    from inference.engines import Completion, SamplingParams


class Policy(Protocol):
    """What the runner needs of an engine: `inference.engines.Engine` plus `score` (TorchEngine)."""

    def generate(self, prompts: Sequence[str], n: int = 1, sampling: SamplingParams | None = None) -> list[Completion]: ...

    def score_many(self, pairs: Sequence[tuple[list[int], list[int]]],
                   sampling: SamplingParams | None = None) -> list[tuple[list[float], Any]]: ...

    def encode(self, text: str) -> list[int]: ...


# ---------------------------------------------------------------------------------- scoring


class SuiteScorer:
    """Checks + judge + reward weights of one suite, applied to a completion."""

    def __init__(self, spec: SuiteSpec) -> None:
        self.checks: list[tuple[Check, float, str]] = [
            (check_from_config(c), float(c.get("weight", 1.0)), c["name"]) for c in spec.checks
        ]
        self.judge: Judge | None = make_judge(spec.judge) if spec.judge else None
        self.reward_spec = RewardSpecData.from_json({}, list(spec.checks), list(spec.aspects))

    def score(self, prompt: str, completion: str, context: Mapping[str, Any]) -> dict[str, Any]:
        return self.score_many([(prompt, completion, context)])[0]

    def score_many(self, items: Sequence[tuple[str, str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
        """Scores many completions; each check runs over all of them at once (fewer sandboxes)."""
        by_check = {name: check.run_many([(completion, context) for _, completion, context in items])
                    for check, _, name in self.checks}
        return [self._total(prompt, completion, context, {n: r[i] for n, r in by_check.items()})
                for i, (prompt, completion, context) in enumerate(items)]

    def _total(self, prompt: str, completion: str, context: Mapping[str, Any],
               results: dict[str, Any]) -> dict[str, Any]:
        aspects: dict[str, float] = {}
        if self.judge is not None:
            aspects = {a: s for a, s in self.judge.judge(prompt, completion, context).values().items() if s is not None}
        reward, _ = compute_reward(self.reward_spec, [], results, aspects)
        total_w = sum(w for _, w, _ in self.checks)
        verifiable = sum(results[n].score * w for _, w, n in self.checks) / total_w if total_w else None
        judge = sum(aspects.values()) / len(aspects) if aspects else None
        return {"reward": reward, "verifiable": verifiable, "judge": judge, "aspects": aspects}


# ---------------------------------------------------------------------------------- sampling


def suite_collect(spec: SuiteSpec, candidate: Policy, production: Policy, scorer: SuiteScorer | None = None,
                  reference: Policy | None = None) -> SuiteSamples:
    """Sample both policies on the suite and score every completion; candidate samples also carry
    production's log-probs of the same tokens (for the KL estimate) and the reference's (for the
    naturalness rows). `reference`: the project's base when it is not production (None: it is);
    it samples the suite too, with the same seeds."""
    scorer = scorer or SuiteScorer(spec)
    sampling = suite_sampling(spec)
    texts = [p.prompt for p in spec.prompts]
    cand = candidate.generate(texts, n=spec.n_samples, sampling=sampling)
    prod = production.generate(texts, n=spec.n_samples, sampling=sampling)
    scores = scorer.score_many([(spec.prompts[c.prompt_index].prompt, c.text, spec.prompts[c.prompt_index].context)
                                for c in [*cand, *prod]])
    # production's log-probs of the candidate's tokens, in batched forwards (one per length)
    pairs = [(c.prompt_token_ids, c.token_ids) for c in cand]
    other = [lp for lp, _ in production.score_many(pairs, sampling)]
    on_ref = other if reference is None else [lp for lp, _ in reference.score_many(pairs, sampling)]
    intended = intended_lines(spec)
    return SuiteSamples(
        candidate=[_sample(spec, s, c, lp, ref) for c, s, lp, ref in zip(cand, scores, other, on_ref, strict=False)],
        production=[_sample(spec, s, c, None) for c, s in zip(prod, scores[len(cand):], strict=True)],
        reference=None if reference is None else suite_sample(spec, reference),
        prompts={p.id: p.prompt for p in spec.prompts},
        intended=intended,
        intended_logprobs=intended_scores(spec, cand, intended, candidate, reference or production),
    )


def intended_lines(spec: SuiteSpec) -> dict[str, str]:
    """Prompt id -> what the user was about to type (context["rest"]), on the prompts cut from real lines."""
    return {p.id: p.context["rest"] for p in spec.prompts if isinstance(p.context.get("rest"), str)
            and p.context["rest"].strip()}


def aligned_continuation(encode: Callable[[str], list[int]], prompt_ids: Sequence[int], prompt: str,
                         line: str) -> tuple[list[int], list[int]]:
    """(context, target) token ids for scoring `line` as the continuation of `prompt`, on the
    tokens the model sees when the two are one text. A prompt cut mid-word ends in a token that
    the whole text does not have (`@clas` + `smethod` is one `classmethod` token when written out),
    and the rest tokenized alone is a split no training text ever had: both a base and a model
    that knows the code score it near chance. So the prompt's last tokens that the joined text
    tokenizes otherwise are scored too, as part of the line; when the prompt's tokens are not the
    end of `prompt_ids` (a template around them), the line is scored tokenized alone."""
    own, joined = encode(prompt), encode(prompt + line)
    if not own or list(prompt_ids[len(prompt_ids) - len(own):]) != own:
        return list(prompt_ids), encode(line)
    keep = 0
    while keep < len(own) and keep < len(joined) and own[keep] == joined[keep]:
        keep += 1
    context = list(prompt_ids[: len(prompt_ids) - len(own) + keep])
    if not context:  # never score with no context at all
        return list(prompt_ids), encode(line)
    return context, joined[keep:]


def intended_scores(spec: SuiteSpec, completions: Sequence[Completion], intended: Mapping[str, str],
                    candidate: Policy, base: Policy) -> dict[str, tuple[list[float], list[float]]]:
    """Teacher-forced log-probs (temperature 1) of what the user was about to type — the intended
    text's first line, tokenized alone — after each prompt's tokens, under the candidate and under
    the base: one batched scoring per side, no sampling noise (the matched-characters row reads
    sampled suggestions; this one reads every prompt's real line)."""
    prompt_ids = {c.prompt_index: list(c.prompt_token_ids) for c in completions}
    rows: list[tuple[str, list[int], list[int]]] = []
    for index, p in enumerate(spec.prompts):
        line = intended.get(p.id, "").split("\n", 1)[0]
        if line.strip() and index in prompt_ids:
            context, tokens = aligned_continuation(candidate.encode, prompt_ids[index], p.prompt, line)
            if tokens:
                rows.append((p.id, context, tokens))
    if not rows:
        return {}
    pairs = [(ids, toks) for _, ids, toks in rows]
    ours = [lp for lp, _ in candidate.score_many(pairs)]
    theirs = [lp for lp, _ in base.score_many(pairs)]
    return {pid: (list(a), list(b)) for (pid, _, _), a, b in zip(rows, ours, theirs, strict=True)}


def suite_sampling(spec: SuiteSpec, seed: int | None = None) -> SamplingParams:
    # Imported here: the runner's scoring and statistics stay importable without torch.
    from inference.engines import SamplingParams

    return SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature,
                          seed=spec.seed if seed is None else seed)


def suite_sample(spec: SuiteSpec, policy: Policy, seed: int | None = None) -> list[Sample]:
    """The policy's own samples of the suite (at the suite's seed, or `seed`), not scored: what the
    naturalness rows and the base's measurements read (text, tokens, own log-probs)."""
    out = policy.generate([p.prompt for p in spec.prompts], n=spec.n_samples, sampling=suite_sampling(spec, seed))
    unscored = {"reward": math.nan, "verifiable": None, "judge": None, "aspects": {}}
    return [_sample(spec, unscored, c, None) for c in out]


def _sample(spec: SuiteSpec, scored: dict[str, Any], c: Completion, other_lp: list[float] | None,
            ref_lp: list[float] | None = None) -> Sample:
    return Sample(spec.prompts[c.prompt_index].id, c.text, len(c.token_ids), logprobs=list(c.logprobs),
                  other_logprobs=other_lp, token_ids=tuple(c.token_ids), ref_logprobs=ref_lp, **scored)


# ---------------------------------------------------------------------------------- evaluation


def evaluate(samples: SuiteSamples, t: GateThresholds, known: frozenset[str] | None = None) -> list[CheckRow]:
    """The gate's check rows: reward improvement, per-aspect non-regression, KL, detectors,
    naturalness and collapse against the base. Thresholds left "auto" are derived from the base's
    samples here (one seed); the gate service derives them once per base, from two, and stores them.
    `known`: the project's names (default: the suite's prompts' and the language's)."""
    if t.automatic:
        t = t.resolved(base_measure([samples.base], intended=[b for _, b in samples.intended_logprobs.values()])
                       .derived())
    boot = {"confidence": t.confidence, "resamples": t.resamples, "seed": t.seed}
    cand, prod = by_prompt(samples.candidate), by_prompt(samples.production)
    shared = sorted(set(cand) & set(prod))
    if not shared:
        raise ValueError("candidate and production samples share no prompt; nothing to compare")
    rows = [_reward_row(cand, prod, shared, t, boot)]
    rows += _aspect_rows(cand, prod, shared, t, boot)
    rows.append(_kl_row(samples.candidate, t))
    rows += _detector_rows(samples, t)
    rows += naturalness_rows(samples, t, known, boot)
    return rows


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _reward_row(cand: dict, prod: dict, shared: list[str], t: GateThresholds, boot: dict) -> CheckRow:
    ci = stats.paired_bootstrap(
        [_mean([s.reward for s in cand[p]]) for p in shared], [_mean([s.reward for s in prod[p]]) for p in shared], **boot
    )
    return CheckRow("reward_improvement", ci.mean, t.margin, ci.as_list(), ci.low > t.margin,
                    f"mean(candidate − production) over {ci.n} prompts; the interval's lower bound must exceed the margin")


def _aspect_means(groups: dict[str, list[Sample]], shared: list[str]) -> dict[str, list[float]]:
    names = set.intersection(*[set(s.aspects) for p in shared for s in groups[p]]) if shared else set()
    return {a: [_mean([s.aspects[a] for s in groups[p]]) for p in shared] for a in names}


def _aspect_rows(cand: dict, prod: dict, shared: list[str], t: GateThresholds, boot: dict) -> list[CheckRow]:
    intervals = stats.aspect_intervals(_aspect_means(cand, shared), _aspect_means(prod, shared), **boot)
    return [
        CheckRow(f"aspect:{name}", ci.mean, -t.tolerance(name), ci.as_list(), ci.low >= -t.tolerance(name),
                 "may not regress beyond its tolerance (interval lower bound)")
        for name, ci in intervals.items()
    ]


def _kl_row(candidate: Sequence[Sample], t: GateThresholds) -> CheckRow:
    pairs = [(s.logprobs, s.other_logprobs) for s in candidate if s.logprobs is not None and s.other_logprobs is not None]
    if t.kl_budget is None:
        return CheckRow("kl", None, None, None, True, "not checked (no KL budget in the gate policy)")
    if not pairs:
        return CheckRow("kl", None, t.kl_budget, None, False, "not measured: the engine gave no log-probs")
    kl = stats.kl_estimate([a for a, _ in pairs], [b for _, b in pairs])
    return CheckRow("kl", kl, t.kl_budget, None, kl <= t.kl_budget, "KL(candidate ‖ production), nats/token (k3)")


def _detector_rows(samples: SuiteSamples, t: GateThresholds) -> list[CheckRow]:
    c_txt, p_txt = [s.text for s in samples.candidate], [s.text for s in samples.production]
    ratio = detectors.length_drift_ratio([s.tokens for s in samples.candidate], [s.tokens for s in samples.production])
    silence = detectors.silence_rate(c_txt) - detectors.silence_rate(p_txt)
    ngram = detectors.mean_repeated_ngram_rate(c_txt, t.ngram) - detectors.mean_repeated_ngram_rate(p_txt, t.ngram)
    tools = detectors.tool_call_failure_rate(c_txt) - detectors.tool_call_failure_rate(p_txt)
    bounds = [1 / t.length_ratio_max, t.length_ratio_max]
    return [
        CheckRow("length_drift", ratio, bounds, None, bounds[0] <= ratio <= bounds[1],
                 "mean completion length, candidate / production"),
        _jump_row("silence_jump", silence, t.silence_jump_max, "empty, refusal or clarifying-question rate"),
        _jump_row("repeated_ngram_jump", ngram, t.repeated_ngram_jump_max, f"repeated {t.ngram}-gram rate"),
        _jump_row("tool_call_failure_jump", tools, t.tool_failure_jump_max, "broken tool-call rate"),
        _divergence_row(samples, t),
        *_shrink_rows(c_txt, p_txt, t),
    ]


def _shrink_rows(candidate: Sequence[str], production: Sequence[str], t: GateThresholds) -> list[CheckRow]:
    if t.min_median_chars is None:
        return []
    value = detectors.median_shown_chars(candidate)
    floor = min(float(t.min_median_chars), detectors.median_shown_chars(production))
    return [CheckRow("median_chars", value, floor, None, value >= floor,
                     "median characters of the candidate's shown suggestions (no gain by shrinking)")]


def _jump_row(name: str, value: float, limit: float, what: str) -> CheckRow:
    return CheckRow(name, value, limit, None, value <= limit, f"{what}, candidate − production")


def _divergence_row(samples: SuiteSamples, t: GateThresholds) -> CheckRow:
    def delta(attr: str) -> float | None:
        c = [getattr(s, attr) for s in samples.candidate if getattr(s, attr) is not None]
        p = [getattr(s, attr) for s in samples.production if getattr(s, attr) is not None]
        return _mean(c) - _mean(p) if c and p else None

    judge, verifiable = delta("judge"), delta("verifiable")
    if judge is None or verifiable is None:
        return CheckRow("judge_verifiable_divergence", None, t.divergence_max, None, True,
                        "not measured: the suite needs both a judge and verifiable checks")
    value = detectors.judge_verifiable_divergence(judge, verifiable)
    return CheckRow("judge_verifiable_divergence", value, t.divergence_max, None, value <= t.divergence_max,
                    f"judge Δ {judge:+.3f} vs verifiable Δ {verifiable:+.3f}")


# ---------------------------------------------------------------------------------- agent tasks

AGENT_MAX_TURNS, AGENT_MAX_TOKENS = 6, 96


def agent_collect(tasks: Sequence[Any], candidate: Policy, production: Policy, G: int, seed: int
                  ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each side plays G rollouts of every agent task with the same seeds (common random numbers:
    a difference is the weights', not the dice's); returns task -> the rollouts' tests pass shares."""
    from training.rewards.agents import run_agent_rollouts  # imported here: its tools import torch

    def shares(engine: Policy) -> dict[str, list[float]]:
        events = run_agent_rollouts(engine, tasks, G, max_turns=AGENT_MAX_TURNS,  # type: ignore[arg-type]
                                    max_tokens=AGENT_MAX_TOKENS, seed=seed)
        out: dict[str, list[float]] = defaultdict(list)
        for e in events:
            out[e["task"]].append(float(e["agent"]["tests_share"]))
        return dict(out)

    return shares(candidate), shares(production)


def agent_row(candidate: Mapping[str, Sequence[float]], production: Mapping[str, Sequence[float]],
              t: GateThresholds) -> CheckRow:
    """Candidate − production mean tests pass share over the agent tasks (paired by task). A pass
    criterion only with `agent_tolerance` (non-regression, interval lower bound); else informational."""
    shared = sorted(set(candidate) & set(production))
    if not shared:
        return CheckRow("agent_tests", None, t.agent_tolerance, None, True, "not measured: no agent task played")
    c, p = [_mean(candidate[k]) for k in shared], [_mean(production[k]) for k in shared]
    ci = stats.paired_bootstrap(c, p, confidence=t.confidence, resamples=t.resamples, seed=t.seed)
    what = (f"tests pass share over {len(shared)} agent tasks x {t.agent_G} rollouts, candidate {_mean(c):.3f} "
            f"vs production {_mean(p):.3f} (same seeds)")
    if t.agent_tolerance is None:
        return CheckRow("agent_tests", ci.mean, None, ci.as_list(), True,
                        f"{what}; informational (set agent_tolerance in the gate policy to require it)")
    tol = float(t.agent_tolerance)
    return CheckRow("agent_tests", ci.mean, -tol, ci.as_list(), ci.low >= -tol,
                    f"{what}; may not regress beyond {tol:g} (interval lower bound)")
