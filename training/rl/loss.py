"""The policy loss: PPO-clip on pi_theta/pi_old x truncated IS weight vs behaviour + beta * k3 KL.

The KL term is bounded (`k3_bounded`, veRL's `low_var_kl`): k3 is an estimator under samples of
pi_theta, and the rows a run trains on were mostly sampled by a served version. On a token pi_theta
has moved away from, log(pi_ref / pi_theta) is large and exp() of it exploded: a demo run's
`kl_ref` read 22,767,958 nats at one step (and its gradient, beta x (1 - pi_ref / pi_theta), with it).

Pure function over tensors (prime-rl style `LossInputs` -> `LossOutputs`); no model inside.

    .venv/bin/python -m pytest tests/training/rl/test_loss.py -q -p no:django
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class LossInputs:
    """Per-token tensors are (B, T) and aligned: entry [b, t] is about token t of row b."""

    logprobs: torch.Tensor  # (B, T) log pi_theta, carries the gradient
    old_logprobs: torch.Tensor  # (B, T) log pi_old: trainer's log-probs at the pre-update weights
    advantages: torch.Tensor  # (B,)
    mask: torch.Tensor  # (B, T) bool, True on completion tokens that count
    behaviour_logprobs: torch.Tensor | None = None  # (B, T) log mu from inference; None: mu = pi_old
    ref_logprobs: torch.Tensor | None = None  # (B, T) log pi_ref; None: no KL term
    # (B,) bool: the row's mu came from the weights pi_old is (served by the run's base version, or
    # sampled by the run itself); None: every row. Only those rows measure the engine mismatch.
    same_weights: torch.Tensor | None = None
    entropy: torch.Tensor | None = None  # (B, T) per-token entropy, metric only
    normalizer: float | None = None  # token count to divide by; micro-batches pass the batch total


@dataclass
class LossOutputs:
    loss: torch.Tensor  # scalar, differentiable
    kl_ref: torch.Tensor  # token-mean bounded k3 KL(pi_theta || pi_ref)
    clip_fraction: torch.Tensor  # share of tokens whose clipped branch is active (no gradient)
    # token-mean k3 KL(mu || pi_old) on the same-weights rows: the engine mismatch (~0 in fp32)
    mismatch_kl: torch.Tensor
    is_truncated: torch.Tensor  # share of tokens with pi_old / mu > C
    entropy: torch.Tensor | None  # token-mean entropy when given
    # token-mean k3 KL(mu || pi_old) on the other rows: how far the run's base is from the version
    # that served them (staleness, corrected by the IS weight), not an engine fault
    staleness_kl: torch.Tensor | None = None
    mismatch_tokens: int = 0  # tokens each of the two means is over (to average micro-batches)
    staleness_tokens: int = 0


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(p || q) from log(q/p) at samples of p: always >= 0."""
    return torch.expm1(log_ratio) - log_ratio


KL_LOG_RATIO_BOUND = 20.0  # veRL's low_var_kl bounds: log-ratio to +-20, the estimate to [-10, 10]
KL_TOKEN_BOUND = 10.0


def k3_bounded(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 with the log-ratio clamped to +-20 and the estimate to <= 10 nats a token (veRL's
    `low_var_kl`). Where a clamp is active the gradient is 0; elsewhere |d k3 / d log_ratio| =
    |exp(x) - 1| < e^2.53 ~ 12.5 (k3 reaches 10 at x ~ 2.53): bounded, whatever the row's origin."""
    x = log_ratio.clamp(-KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
    return k3(x).clamp(max=KL_TOKEN_BOUND)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, x, 0.0).sum() / mask.sum().clamp(min=1)


def policy_loss(
    inputs: LossInputs, eps: float, eps_high: float, is_cap: float, beta: float
) -> LossOutputs:
    mask = inputs.mask.to(inputs.logprobs.dtype)  # (B, T)
    adv = inputs.advantages.to(inputs.logprobs.dtype).unsqueeze(1)  # (B, 1)
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs.detach())  # (B, T)
    unclipped = ratio * adv  # (B, T)
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps_high) * adv  # (B, T)
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)

    behaviour = inputs.old_logprobs if inputs.behaviour_logprobs is None else inputs.behaviour_logprobs
    # Zeroed off the mask first: padding may carry any mu, and inf * 0 would poison the sums.
    mismatch_log = torch.where(inputs.mask, inputs.old_logprobs - behaviour, 0.0).detach()  # (B, T)
    # Detached: the IS weight corrects the sampling distribution, it is not a thing to optimise.
    is_weight = torch.exp(mismatch_log).clamp(max=is_cap)  # (B, T)
    per_token = per_token * is_weight

    kl = torch.zeros_like(per_token)
    if inputs.ref_logprobs is not None:
        kl = k3_bounded(inputs.ref_logprobs.detach() - inputs.logprobs)  # (B, T)
        if beta > 0:  # with beta 0 the KL is only measured (a trust region's stop, kl_stop)
            per_token = per_token + beta * kl

    normalizer = inputs.normalizer if inputs.normalizer is not None else mask.sum().clamp(min=1)
    loss = torch.where(inputs.mask, per_token, 0.0).sum() / normalizer
    with torch.no_grad():
        clip_active = ((ratio < 1 - eps) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
        entropy = None if inputs.entropy is None else _masked_mean(inputs.entropy, mask)
        same = torch.ones_like(inputs.advantages, dtype=torch.bool) if inputs.same_weights is None \
            else inputs.same_weights.to(torch.bool)  # (B,)
        fresh, stale = inputs.mask & same[:, None], inputs.mask & ~same[:, None]  # (B, T)
        drift = k3(mismatch_log)  # (B, T)
        return LossOutputs(
            loss=loss,
            kl_ref=_masked_mean(kl.detach(), mask),
            clip_fraction=_masked_mean(clip_active.to(mask.dtype), mask),
            mismatch_kl=_masked_mean(drift, fresh.to(mask.dtype)),
            is_truncated=_masked_mean((mismatch_log > math.log(is_cap)).to(mask.dtype), mask),
            entropy=entropy,
            # bounded: a stale row's mu may be far from pi_old on a rare token (a measurement, never inf)
            staleness_kl=_masked_mean(k3_bounded(mismatch_log), stale.to(mask.dtype)),
            mismatch_tokens=int(fresh.sum()), staleness_tokens=int(stale.sum()),
        )
