"""A reward model fitted to users' accept/reject: P(accept | prompt, completion, check outcomes).

Users click on one completion per prompt; the trainer wants many completions per prompt (group
rollouts, G per prompt) and has no users to click on them. This model stands in for the users:
logistic regression over features any taste can be read from — the project's verifiable check
outcomes, the suggestion's shape (shown, length, lines, how it ends) and hashed completion
tokens and character n-grams (what the suggestion says) — fitted on every labelled suggestion
so far, calibrated on a held-out slice (newest clicks, never fitted on), and refitted every run.

Why logistic regression and not a head on the policy: it fits in milliseconds on thousands of
clicks, cannot overfit a few hundred labels into a reward the policy can game with noise, and
its held-out calibration is a number the rubric page can show. Its weakness is what it cannot
see: a taste that is not a function of these features is learned only through live clicks.

Pure torch; no Django. `training.runs.job` fits it from `training.rewards.selectors.labelled_suggestions`.

    .venv/bin/python -m pytest tests/training/test_reward_model.py -q -p no:django
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
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
    """Area under the ROC curve (rank statistic, ties half); None when one class is missing."""
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
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
    calibration: dict[str, Any] = {"labels": len(labelled), "accept_rate": round(float(y.mean()), 4)}
    if 0 < cut < len(labelled) and 0 < float(y[:cut].mean()) < 1:
        w, b = _fit(x[:cut], y[:cut], l2)
        p = torch.sigmoid(x[cut:] @ w + b)
        held = y[cut:]
        base = torch.full_like(held, float(y[:cut].mean()))
        calibration.update(
            heldout=len(held), heldout_auc=auc(p, held),
            heldout_log_loss=round(_log_loss(p, held), 4), base_rate_log_loss=round(_log_loss(base, held), 4),
            heldout_accuracy=round(float(((p > 0.5).float() == held).float().mean()), 4),
            heldout_mean_predicted=round(float(p.mean()), 4), heldout_mean_observed=round(float(held.mean()), 4),
        )
    if not 0 < float(y.mean()) < 1:
        return None  # one class only: nothing to tell apart
    w, b = _fit(x, y, l2)
    return RewardModel(names, w, float(b), calibration)


def expected_signal_reward(p_accept: float, shown: bool, signal_rewards: Mapping[str, float]) -> float:
    """The spec's signal reward a user would give in expectation: accept/reject weighted by the
    model's probability; a suggestion not shown gets the spec's `silent` value (no click)."""
    if not shown:
        return float(signal_rewards.get("silent", 0.0))
    return p_accept * float(signal_rewards.get("accept", 0.0)) + (1 - p_accept) * float(signal_rewards.get("reject", 0.0))
