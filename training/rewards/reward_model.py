"""Reward models fitted to users' accept/reject: P(accept | prompt, completion, check outcomes).

Users click on one completion per prompt; the trainer wants many completions per prompt (group
rollouts, G per prompt) and has no users to click on them. This model stands in for the users:
logistic regression over features any taste can be read from — the project's verifiable check
outcomes, the suggestion's shape (shown, length, lines, how it ends) and hashed completion
tokens and character n-grams (what the suggestion says) — fitted on every labelled suggestion
so far, calibrated on a held-out slice (newest clicks, never fitted on), and refitted every run.

Why logistic regression: it fits in milliseconds on thousands of clicks, cannot overfit a few
hundred labels into a reward the policy can game with noise, and its held-out calibration is a
number the rubric page can show. Its weakness is what it cannot see: the suggestion alone says
nothing of whether it continues *its* prompt, so a tab-completion user's taste ("what I was about
to type") is invisible to it (held-out AUC ~0.5 on such clicks: bench/reward_model.py).

`ContextRewardModel` reads the prompt and the completion together: a logistic head over the
frozen policy's view of prompt + completion (`context_features`: the last hidden state at the
prompt's last token and averaged over the completion's tokens, their product, and how likely the
policy finds the completion there: mean / first / min token log-prob, share of argmax tokens),
plus the dense features above. `fit_users_model` fits both and keeps the context model only from
`CONTEXT_MIN_LABELS` (400) clicks on, and only when it ranks the held-out clicks at least as well.
Why 400: its head has ~3 x hidden-size + 20 weights, and below 400 clicks the held-out slice (20%,
under 80 clicks) is too small to tell the two models apart. At 500 clicks it already ranked 0.14 to
0.21 AUC above the features (bench/reward_model.py), so 400 is a conservative floor, not a measured one.

Labels may be graded: a partial accept's label is the share of the accept reward it earned
(training.rewards.selectors.labelled_suggestions), fitted as a soft target; AUC counts any
accept as a positive.

Pure torch; no Django. `training.runs.job` fits it from `training.rewards.selectors.labelled_suggestions`.

    .venv/bin/python -m pytest tests/training/rewards/test_reward_model.py -q -p no:django
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

HASH_BUCKETS = 1024
LENGTH_EDGES = (1, 4, 8, 16, 32, 64)  # characters of the stripped suggestion
MIN_LABELS = 40  # fewer labelled suggestions than this: no model (the run trains on live clicks only)


@dataclass(frozen=True)
class Labelled:
    """One suggestion a user saw: its text, its check outcomes and the click (1 accept, 0 reject)."""

    prompt: str
    completion: str
    checks: Mapping[str, float] = field(default_factory=dict)
    completion_ids: Sequence[int] = ()
    label: float | None = None
    source_id: int | None = None  # the trajectory it came from: what the model learned from (lineage)
    prompt_ids: Sequence[int] = ()  # the ids the policy was fed; () = encode(prompt) when read in context


def _bucket(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=4).digest(), "little") % HASH_BUCKETS


def _shape(prompt: str, completion: str) -> list[float]:
    text = completion.strip()
    chars = len(text)
    lines = completion.rstrip("\n").count("\n")
    closes = sum(completion.count(c) for c in ")]}") - sum(completion.count(c) for c in "([{")
    opens = sum(prompt.count(c) for c in "([{") - sum(prompt.count(c) for c in ")]}")
    return [
        1.0 if text else 0.0,
        math.log1p(chars) / 5,
        *[1.0 if chars >= edge else 0.0 for edge in LENGTH_EDGES],
        min(lines, 4) / 4, 1.0 if lines == 0 else 0.0,
        1.0 if completion.endswith("\n") else 0.0,
        1.0 if closes == opens else 0.0,  # brackets the prompt opened, closed by the suggestion
        1.0 if completion[:1].isspace() else 0.0,
    ]


def featurize(item: Labelled, check_names: Sequence[str]) -> tuple[list[float], list[int]]:
    """(dense features, hashed sparse feature ids) of one suggestion."""
    dense = [float(item.checks.get(name, 0.0)) for name in check_names] + _shape(item.prompt, item.completion)
    text = item.completion
    ids = [int(t) for t in item.completion_ids]
    sparse = [_bucket(f"tok:{t}") for t in ids]
    sparse += [_bucket(f"first:{ids[0]}"), _bucket(f"last:{ids[-1]}")] if ids else [_bucket("empty")]
    sparse += [_bucket(f"c3:{text[i:i + 3]}") for i in range(max(len(text) - 2, 0))]
    sparse.append(_bucket(f"join:{item.prompt[-1:]}|{text[:1]}"))
    sparse.append(_bucket(f"end:{text.rstrip()[-1:]}"))
    return dense, sparse


def _matrix(items: Sequence[Labelled], check_names: Sequence[str]) -> torch.Tensor:
    rows = [featurize(i, check_names) for i in items]
    width = len(rows[0][0]) if rows else len(check_names) + len(_shape("", ""))
    x = torch.zeros(len(items), width + HASH_BUCKETS)
    for r, (dense, sparse) in enumerate(rows):
        x[r, :width] = torch.tensor(dense)
        if sparse:
            counts = torch.bincount(torch.tensor(sparse), minlength=HASH_BUCKETS).float()
            x[r, width:] = counts / math.sqrt(len(sparse))
    return x


@dataclass
class RewardModel:
    """P(accept) = sigmoid(w · features + b); `calibration` is measured on clicks it never saw."""

    check_names: tuple[str, ...]
    weight: torch.Tensor
    bias: float
    calibration: dict[str, Any] = field(default_factory=dict)

    def predict(self, items: Sequence[Labelled]) -> torch.Tensor:
        """(N,) accept probabilities."""
        if not items:
            return torch.zeros(0)
        return torch.sigmoid(_matrix(items, self.check_names) @ self.weight + self.bias)

    def summary(self) -> dict[str, Any]:
        return {"checks": list(self.check_names), **self.calibration}


def _fit(x: torch.Tensor, y: torch.Tensor, l2: float, iters: int = 60) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.zeros(x.shape[1], requires_grad=True)
    prior = float(y.mean().clamp(1e-3, 1 - 1e-3))
    b = torch.tensor(math.log(prior / (1 - prior)), requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=iters, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Area under the ROC curve (rank statistic, ties half), any accept (label > 0, a partial one
    included) a positive; None when one class is missing."""
    pos, neg = scores[labels > 0], scores[labels <= 0]
    if pos.numel() == 0 or neg.numel() == 0:
        return None
    greater = (pos[:, None] > neg[None, :]).float().sum() + 0.5 * (pos[:, None] == neg[None, :]).float().sum()
    return float(greater / (pos.numel() * neg.numel()))


def _log_loss(p: torch.Tensor, y: torch.Tensor) -> float:
    p = p.clamp(1e-6, 1 - 1e-6)
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def fit_reward_model(
    items: Sequence[Labelled], check_names: Sequence[str] = (), *, holdout: float = 0.2, l2: float = 1e-3,
) -> RewardModel | None:
    """Fits on the oldest (1 - holdout) of `items` (in arrival order), measures calibration on the
    newest `holdout`, then refits on everything. None with fewer than MIN_LABELS labelled items."""
    labelled = [i for i in items if i.label is not None]
    if len(labelled) < MIN_LABELS:
        return None
    names = tuple(check_names)
    x = _matrix(labelled, names)
    y = torch.tensor([float(i.label) for i in labelled])  # type: ignore[arg-type]
    cut = int(len(labelled) * (1 - holdout))
    calibration: dict[str, Any] = {"kind": "features", "labels": len(labelled),
                                   "accept_rate": round(float((y > 0).float().mean()), 4)}
    if 0 < cut < len(labelled) and 0 < float(y[:cut].mean()) < 1:
        w, b = _fit(x[:cut], y[:cut], l2)
        calibration.update(_heldout(torch.sigmoid(x[cut:] @ w + b), y[cut:], y[:cut]))
    if not 0 < float(y.mean()) < 1:
        return None  # one class only: nothing to tell apart
    w, b = _fit(x, y, l2)
    return RewardModel(names, w, float(b), calibration)


def _heldout(p: torch.Tensor, held: torch.Tensor, fitted: torch.Tensor) -> dict[str, Any]:
    """Calibration of predictions `p` on held-out labels, against the fitted slice's base rate."""
    base = torch.full_like(held, float(fitted.mean()))
    return dict(
        heldout=len(held), heldout_auc=auc(p, held),
        heldout_log_loss=round(_log_loss(p, held), 4), base_rate_log_loss=round(_log_loss(base, held), 4),
        heldout_accuracy=round(float(((p > 0.5) == (held > 0.5)).float().mean()), 4),
        heldout_mean_predicted=round(float(p.mean()), 4), heldout_mean_observed=round(float(held.mean()), 4),
    )


def expected_signal_reward(p_accept: float, shown: bool, signal_rewards: Mapping[str, float]) -> float:
    """The spec's signal reward a user would give in expectation: accept/reject weighted by the
    model's probability; a suggestion not shown gets the spec's `silent` value (no click)."""
    if not shown:
        return float(signal_rewards.get("silent", 0.0))
    return p_accept * float(signal_rewards.get("accept", 0.0)) + (1 - p_accept) * float(signal_rewards.get("reject", 0.0))


# --------------------------------------------------------------------------------- in context

CONTEXT_MIN_LABELS = 400  # fewer clicks: the feature model only (see the module docstring)
CONTEXT_TOKENS = 32  # completion tokens read (a tab suggestion's first line fits)
CONTEXT_CHUNK = 64  # rows per no-grad forward
Encode = Callable[[str], list[int]]


def _context_rows(items: Sequence[Labelled], encode: Encode | None, room: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) per item, the prompt cut from the left to fit `room` positions."""
    rows = []
    for item in items:
        prompt = list(item.prompt_ids) or (encode(item.prompt) if encode is not None else [])
        completion = list(item.completion_ids)[:CONTEXT_TOKENS] or (
            encode(item.completion)[:CONTEXT_TOKENS] if encode is not None and item.completion else [])
        prompt = prompt[-max(1, room - len(completion)):] or [0]
        rows.append((prompt, completion))
    return rows


N_SCORES = 13  # completion scores beside the hidden states (`_scores`)


@torch.no_grad()
def context_features(policy: torch.nn.Module, items: Sequence[Labelled], encode: Encode | None = None) -> torch.Tensor:
    """(N, 3H + 13) what the frozen `policy` makes of each completion after its prompt: its last
    hidden state at the prompt's last token (h_p) and averaged over the completion's tokens (h_c),
    h_p * h_c, and scores of the completion: its mean and min token log-prob, share of argmax
    tokens (all, first), the first token's rank, its first three tokens' log-probs, and how much
    more likely the prompt makes it than a bare line start does (pointwise mutual information:
    mean, first three, each of them): a real line of code is likely anywhere, only the right one
    is likelier after its own prompt.
    An empty completion is all zeros."""
    room = int(getattr(policy.config, "max_position_embeddings", 512))
    rows = _context_rows(items, encode, room)
    bare = [_BARE for _ in rows]
    hidden = int(policy.config.hidden_size)
    out = torch.zeros(len(rows), 3 * hidden + N_SCORES)
    order = sorted((i for i, (_, c) in enumerate(rows) if c), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    for start in range(0, len(order), CONTEXT_CHUNK):
        chunk = order[start:start + CONTEXT_CHUNK]
        h_p, h_c, lp, top, rank0 = _read(policy, [rows[i] for i in chunk])
        lp_bare = _read(policy, [(bare[i], rows[i][1]) for i in chunk])[2]
        scores = torch.stack([_scores(*r) for r in zip(lp, lp_bare, top, rank0, strict=True)])  # (b, N_SCORES)
        out[chunk] = torch.cat([h_p, h_c, h_p * h_c, scores], 1)
    return out


_BARE = [0]  # the "context" of the unconditional reading: one id (the tokenizer's first special token)


def _scores(lp: torch.Tensor, lp_bare: torch.Tensor, top: torch.Tensor, rank0: torch.Tensor) -> torch.Tensor:
    """The completion's scores; its first tokens apart, since a tab user judges its start (a partial
    accept keeps a right start whatever follows)."""
    pmi = lp - lp_bare  # (n_c,)
    head, head_pmi = torch.zeros(3), torch.zeros(3)
    head[:min(3, len(lp))], head_pmi[:min(3, len(lp))] = lp[:3], pmi[:3]
    return torch.cat([torch.stack([lp.mean() / 5, lp.min() / 10, top.mean(), top[0], pmi.mean() / 5,
                                   pmi[:3].mean() / 5, torch.log1p(rank0) / 5]), head / 5, head_pmi / 5])


def _read(policy: torch.nn.Module, rows: list[tuple[list[int], list[int]]]
          ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """One forward over right-padded prompt + completion rows: h_p (b, H), h_c (b, H), and per row
    the completion's token log-probs and argmax hits, (n_c,) each, and its first token's rank."""
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)  # (b, T)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (p, c) in enumerate(rows):
        ids[r, :len(p) + len(c)] = torch.tensor(p + c)
        attn[r, :len(p) + len(c)] = 1
    out = policy(input_ids=ids, attention_mask=attn, output_hidden_states=True, use_cache=False)
    h = out.hidden_states[-1].float()  # (b, T, H)
    logp = torch.log_softmax(out.logits.float(), -1)  # (b, T, V)
    h_p, h_c, lps, tops, ranks = [], [], [], [], []
    for r, (p, c) in enumerate(rows):
        n_p, n_c, target = len(p), len(c), torch.tensor(c)
        pred = logp[r, n_p - 1:n_p + n_c - 1]  # (n_c, V): the positions that predict the completion
        h_p.append(h[r, n_p - 1])
        h_c.append(h[r, n_p:n_p + n_c].mean(0))
        lps.append(pred.gather(1, target[:, None])[:, 0])
        tops.append((pred.argmax(-1) == target).float())
        ranks.append((pred[0] > pred[0, c[0]]).sum().float())
    return torch.stack(h_p), torch.stack(h_c), lps, tops, ranks


@dataclass
class ContextRewardModel:
    """P(accept) = sigmoid(w · standardised [context_features, dense features] + b)."""

    check_names: tuple[str, ...]
    policy: torch.nn.Module  # frozen: the weights the features were fitted on
    encode: Encode | None
    mean: torch.Tensor
    std: torch.Tensor
    weight: torch.Tensor
    bias: float
    calibration: dict[str, Any] = field(default_factory=dict)

    def predict(self, items: Sequence[Labelled]) -> torch.Tensor:
        """(N,) accept probabilities."""
        if not items:
            return torch.zeros(0)
        x = (_context_matrix(self.policy, items, self.check_names, self.encode) - self.mean) / self.std
        return torch.sigmoid(x @ self.weight + self.bias)

    def summary(self) -> dict[str, Any]:
        return {"checks": list(self.check_names), **self.calibration}


def _context_matrix(policy: torch.nn.Module, items: Sequence[Labelled], names: Sequence[str],
                    encode: Encode | None) -> torch.Tensor:
    dense = torch.tensor([featurize(i, names)[0] for i in items])  # (N, D)
    return torch.cat([context_features(policy, items, encode), dense], 1)  # (N, 3H + 5 + D)


def fit_context_model(
    items: Sequence[Labelled], policy: torch.nn.Module, encode: Encode | None = None, check_names: Sequence[str] = (),
    *, holdout: float = 0.2,
) -> ContextRewardModel | None:
    """As `fit_reward_model` (oldest 1 - holdout fitted, newest measured, then refitted on all),
    over the policy's reading of prompt + completion. None with fewer than MIN_LABELS or one class."""
    labelled = [i for i in items if i.label is not None]
    # P(accept): a partial accept is an accept. Fitted to the grade as a soft target the head
    # learned the accepted length instead (held-out AUC 0.66 where the binary target gave 0.72).
    y = torch.tensor([1.0 if i.label > 0 else 0.0 for i in labelled])  # type: ignore[operator]
    if len(labelled) < MIN_LABELS or not 0 < float(y.mean()) < 1:
        return None
    names = tuple(check_names)
    policy.eval()
    x = _context_matrix(policy, labelled, names, encode)
    cut = int(len(labelled) * (1 - holdout))
    calibration: dict[str, Any] = {"kind": "context", "labels": len(labelled),
                                   "accept_rate": round(float((y > 0).float().mean()), 4)}
    if 0 < cut < len(labelled) and 0 < float(y[:cut].mean()) < 1:
        l2 = _pick_l2(x[:cut], y[:cut])
        mean, std = x[:cut].mean(0), x[:cut].std(0).clamp(min=1e-4)
        w, b = _fit((x[:cut] - mean) / std, y[:cut], l2)
        calibration.update(_heldout(torch.sigmoid((x[cut:] - mean) / std @ w + b), y[cut:], y[:cut]), l2=l2)
    else:
        l2 = _pick_l2(x, y)
    mean, std = x.mean(0), x.std(0).clamp(min=1e-4)
    w, b = _fit((x - mean) / std, y, l2)
    return ContextRewardModel(names, policy, encode, mean, std, w, float(b), calibration)


L2_GRID = (1e-3, 1e-2, 3e-2, 1e-1, 3e-1)


def _pick_l2(x: torch.Tensor, y: torch.Tensor) -> float:
    """The ridge weight whose fit on the oldest 75% ranks the newest 25% best: ~3H weights on a
    few thousand clicks overfit at a fixed small l2 (held-out AUC 0.58 where single scores reach 0.70)."""
    cut = int(len(y) * 0.75)
    if not (0 < float(y[:cut].mean()) < 1 and (y[cut:] > 0).any() and (y[cut:] <= 0).any()):
        return L2_GRID[-1]
    mean, std = x[:cut].mean(0), x[:cut].std(0).clamp(min=1e-4)
    a, b = (x[:cut] - mean) / std, (x[cut:] - mean) / std

    def score(l2: float) -> float:
        w, bias = _fit(a, y[:cut], l2)
        return auc(b @ w + bias, y[cut:]) or 0.0

    return max(L2_GRID, key=score)


UsersModel = RewardModel | ContextRewardModel


def fit_users_model(
    items: Sequence[Labelled], check_names: Sequence[str] = (), policy: torch.nn.Module | None = None,
    encode: Encode | None = None,
) -> UsersModel | None:
    """The model that stands in for the users: the feature model, or from CONTEXT_MIN_LABELS clicks
    on (with a policy to read them with) the context model when its held-out AUC is at least the
    feature model's. The summary tells which, with the other's held-out AUC beside it."""
    features = fit_reward_model(items, check_names)
    labelled = sum(i.label is not None for i in items)
    if features is None or policy is None or labelled < CONTEXT_MIN_LABELS:
        return features
    context = fit_context_model(items, policy, encode, check_names)
    if context is None:
        return features
    ours, theirs = context.calibration.get("heldout_auc"), features.calibration.get("heldout_auc")
    if ours is None or (theirs is not None and ours < theirs):
        features.calibration["context_heldout_auc"] = ours
        return features
    context.calibration["features_heldout_auc"] = theirs
    return context
