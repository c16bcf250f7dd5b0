"""The policy loss: PPO-clip on pi_theta/pi_old x truncated IS weight vs behaviour + beta * k3 KL.

Pure function over tensors (prime-rl style `LossInputs` -> `LossOutputs`); no model inside.

    .venv/bin/python -m pytest tests/training/test_loss.py -q -p no:django
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
    entropy: torch.Tensor | None = None  # (B, T) per-token entropy, metric only
    normalizer: float | None = None  # token count to divide by; micro-batches pass the batch total


@dataclass
class LossOutputs:
    loss: torch.Tensor  # scalar, differentiable
    kl_ref: torch.Tensor  # token-mean k3 KL(pi_theta || pi_ref)
    clip_fraction: torch.Tensor  # share of tokens whose clipped branch is active (no gradient)
    mismatch_kl: torch.Tensor  # token-mean k3 KL(mu || pi_old): train/inference mismatch
    is_truncated: torch.Tensor  # share of tokens with pi_old / mu > C
    entropy: torch.Tensor | None  # token-mean entropy when given


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(p || q) from log(q/p) at samples of p: always >= 0."""
    return torch.expm1(log_ratio) - log_ratio


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
        kl = k3(inputs.ref_logprobs.detach() - inputs.logprobs)  # (B, T)
        if beta > 0:  # with beta 0 the KL is only measured (a trust region's stop, kl_stop)
            per_token = per_token + beta * kl

    normalizer = inputs.normalizer if inputs.normalizer is not None else mask.sum().clamp(min=1)
    loss = torch.where(inputs.mask, per_token, 0.0).sum() / normalizer
    with torch.no_grad():
        clip_active = ((ratio < 1 - eps) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
        entropy = None if inputs.entropy is None else _masked_mean(inputs.entropy, mask)
        return LossOutputs(
            loss=loss,
            kl_ref=_masked_mean(kl.detach(), mask),
            clip_fraction=_masked_mean(clip_active.to(mask.dtype), mask),
            mismatch_kl=_masked_mean(k3(mismatch_log), mask),
            is_truncated=_masked_mean((mismatch_log > math.log(is_cap)).to(mask.dtype), mask),
            entropy=entropy,
        )
