"""The gate's rows on the project's corpus: every version scored on the corpus's held-out files
(never trained on, never replayed), candidate against production, through the same engines as the
suite. No Django; the held-out texts are handed in (training.corpora.selectors.corpus_heldout_texts).

- `corpus_loss`: next-token loss (nats/token) on packed held-out tokens, candidate − production;
- `corpus_continuation`: on held-out line prefixes (a few characters to half the line), the greedy
  suggestion's accepted characters against the rest of the real line (usefulness.accepted_chars),
  candidate − production, paired by prompt; the detail gives both sides' share with accepted > 0.

A mid-training candidate exists to lower the first: it must (value < 0), and the second may not
fall beyond `corpus_accept_tolerance` (0.5 characters unless set); its users' reward must not
regress (`midtrain_reward_row`) instead of having to improve. For other candidates the rows are
informational unless the gate policy sets `corpus_loss_tolerance` / `corpus_accept_tolerance`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from training.corpora.lines import Continuation, continuation_prompts
from training.gate import stats
from training.gate.config import GateThresholds
from training.gate.runner import CheckRow, Policy
from training.rewards.usefulness import accepted_chars

EVAL_TOKENS = 4096  # held-out tokens scored per version (rows of EVAL_ROW)
EVAL_ROW = 128
EVAL_PROMPTS = 64
MAX_TOKENS = 16
MIDTRAIN_ACCEPT_TOLERANCE = 0.5


def heldout_loss(engine: Policy, texts: Sequence[tuple[str, str]], max_tokens: int = EVAL_TOKENS) -> float | None:
    """Mean next-token loss (nats) of the engine's weights on the held-out files' first
    `max_tokens` tokens, packed in rows of EVAL_ROW after an EOS (each row's first token counts)."""
    tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    flat: list[int] = []
    for _, text in texts:
        flat += list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [eos]
        if len(flat) >= max_tokens:
            break
    rows = [flat[i : i + EVAL_ROW] for i in range(0, min(len(flat), max_tokens) - EVAL_ROW + 1, EVAL_ROW)]
    if not rows:
        return None
    scored = engine.score_many([([eos], row) for row in rows])
    logprobs = [lp for row, _ in scored for lp in row]
    return -sum(logprobs) / len(logprobs)


def continuation_scores(engine: Policy, prompts: Sequence[Continuation]) -> list[int]:
    """Accepted characters of the engine's greedy suggestion for each prompt."""
    from inference.engines import SamplingParams  # imported here: the engines import torch

    completions = engine.generate([p.prompt for p in prompts], n=1,
                                  sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=0))
    return [accepted_chars(c.text, prompts[c.prompt_index].rest) for c in completions]


def corpus_rows(candidate: Policy, production: Policy, texts: Sequence[tuple[str, str]], t: GateThresholds,
                midtrain: bool) -> tuple[list[CheckRow], dict[str, Any]]:
    """The two corpus rows and what the report shows of them (both sides' figures)."""
    prompts = continuation_prompts(texts, n=EVAL_PROMPTS, seed=t.seed)
    loss = {side: heldout_loss(e, texts) for side, e in (("candidate", candidate), ("production", production))}
    accepts = {side: continuation_scores(e, prompts) for side, e in (("candidate", candidate), ("production", production))}
    info = {"files": len(texts), "prompts": len(prompts), **{
        side: {"loss": loss[side], "accept_share": _share(accepts[side]), "accepted_chars": _mean(accepts[side])}
        for side in ("candidate", "production")}}
    return [_loss_row(loss["candidate"], loss["production"], t, midtrain),
            _accept_row(accepts["candidate"], accepts["production"], t, midtrain)], info


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _share(values: Sequence[int]) -> float:
    return sum(v > 0 for v in values) / len(values) if values else 0.0


def _loss_row(cand: float | None, prod: float | None, t: GateThresholds, midtrain: bool) -> CheckRow:
    if cand is None or prod is None:
        return CheckRow("corpus_loss", None, None, None, True, "not measured: the held-out files are shorter than a row")
    value, what = cand - prod, f"held-out next-token loss, candidate {cand:.3f} − production {prod:.3f} nats/token"
    if midtrain:
        return CheckRow("corpus_loss", value, 0.0, None, value < 0, f"{what}; a mid-trained candidate must lower it")
    if t.corpus_loss_tolerance is None:
        return CheckRow("corpus_loss", value, None, None, True, f"{what}; informational (set corpus_loss_tolerance)")
    tol = float(t.corpus_loss_tolerance)
    return CheckRow("corpus_loss", value, tol, None, value <= tol, f"{what}; may not rise beyond {tol:g}")


def _accept_row(cand: Sequence[int], prod: Sequence[int], t: GateThresholds, midtrain: bool) -> CheckRow:
    if not cand or len(cand) != len(prod):
        return CheckRow("corpus_continuation", None, None, None, True, "not measured: no held-out line")
    ci = stats.paired_bootstrap([float(c) for c in cand], [float(p) for p in prod], confidence=t.confidence,
                                resamples=t.resamples, seed=t.seed)
    what = (f"greedy accepted characters on {len(cand)} held-out line prefixes, candidate {_mean(cand):.2f} "
            f"({_share(cand):.0%} > 0) vs production {_mean(prod):.2f} ({_share(prod):.0%} > 0)")
    tol = t.corpus_accept_tolerance if t.corpus_accept_tolerance is not None else (
        MIDTRAIN_ACCEPT_TOLERANCE if midtrain else None)
    if tol is None:
        return CheckRow("corpus_continuation", ci.mean, None, ci.as_list(), True,
                        f"{what}; informational (set corpus_accept_tolerance)")
    return CheckRow("corpus_continuation", ci.mean, -float(tol), ci.as_list(), ci.low >= -float(tol),
                    f"{what}; may not fall beyond {float(tol):g} (interval lower bound)")


def midtrain_reward_row(row: CheckRow, t: GateThresholds) -> CheckRow:
    """The users' reward for a mid-trained candidate: it must not regress beyond
    `midtrain_reward_tolerance` (interval lower bound), where an RL candidate must improve it."""
    tol = float(t.midtrain_reward_tolerance)
    low = row.interval[0] if row.interval else None
    passed = low is not None and low >= -tol
    return CheckRow(row.name, row.value, -tol, row.interval, passed,
                    f"{row.detail.split(';')[0]}; a mid-trained candidate may not regress beyond {tol:g}")


def midtrain_kl_row(row: CheckRow, t: GateThresholds) -> CheckRow:
    """KL to production for a mid-trained candidate: moving towards the project's code is its
    purpose, so the budget is `midtrain_kl_budget` (None: informational)."""
    if t.midtrain_kl_budget is None:
        return CheckRow(row.name, row.value, None, None, True,
                        f"{row.detail}; informational for a mid-trained candidate (set midtrain_kl_budget)")
    passed = row.value is not None and row.value <= t.midtrain_kl_budget
    return CheckRow(row.name, row.value, t.midtrain_kl_budget, None, passed, row.detail)


def midtrain_adjusted(rows: Sequence[CheckRow], t: GateThresholds) -> list[CheckRow]:
    """A mid-trained candidate's suite rows: its users' reward must not regress (instead of
    improve), and the rows that measure distance from the old base (KL, log-prob under it, its
    mean length) are informational, since moving towards the project's code is the point; the
    corpus rows judge that. So is the judge-vs-checks divergence: it catches a candidate optimised
    against its reward that pleases the judge, and a mid-trained one never saw the reward. The
    invented-name, collapse, silence, repetition and median-length rows stand as they are."""
    out = []
    for row in rows:
        if row.name == "reward_improvement":
            row = midtrain_reward_row(row, t)
        elif row.name == "kl":
            row = midtrain_kl_row(row, t)
        elif row.name in MIDTRAIN_INFORMATIONAL:
            row = CheckRow(row.name, row.value, row.threshold, row.interval, True,
                           f"{row.detail}; informational for a mid-trained candidate ({MIDTRAIN_INFORMATIONAL[row.name]})")
        out.append(row)
    return out


MIDTRAIN_INFORMATIONAL = {
    "naturalness_logprob": "the reference is the old base",
    "length_drift": "the old base's length on code it never saw; the median-length floor and silence still stand",
    "judge_verifiable_divergence": "it never trained against the reward the judge is part of",
}
