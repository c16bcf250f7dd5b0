"""Advantages: group-relative for prompts sampled G times, a running baseline for live samples.

    .venv/bin/python -m pytest tests/training/rl/test_advantages.py -q -p no:django
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """r - mean(group), optionally / std(group); a group of one gets advantage 0.

    rewards: (B,) float; group_ids: (B,) int, any labels (they need not be contiguous).
    std is the population std (correction 0), so a group of two is defined.
    """
    mean, scale = group_baselines(rewards, group_ids, normalize_std, eps)
    return ((rewards.to(torch.float64) - mean) / scale).to(rewards.dtype)


def group_baselines(
    rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = False, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element (B,) float64: its group's mean reward and the scale an advantage is divided by
    (std + eps with normalize_std, else 1). Agent turns use them with their own return-to-go:
    A_k = (R_k - mean) / scale, the group compared on its trajectories' returns."""
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (B,) labels in [0, G)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    r = rewards.to(torch.float64)  # float64: mean/var of small groups without round-off drift
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, r) / count  # (G,)
    scale = torch.ones_like(r)
    if normalize_std:
        centred = r - mean[inverse]  # (B,)
        var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, centred**2) / count
        scale = var.sqrt()[inverse] + eps
    return mean[inverse], scale


def turn_returns(outcome: float, step_rewards: Sequence[float | None], turns: Sequence[int]) -> list[float]:
    """The reward of each trained turn of an agent trajectory: the trajectory's outcome reward
    plus the per-step rewards from that turn on (reward-to-go, undiscounted).

    step_rewards: one entry per step of the trajectory (None: no reward on that step); turns: the
    step indices of the trained (assistant) turns. Without per-step rewards every turn gets the
    outcome; a step reward reaches the turn that earned it and every turn before it."""
    rest = [0.0] * (len(step_rewards) + 1)
    for j in range(len(step_rewards) - 1, -1, -1):  # suffix sums: rest[j] = sum of rewards at >= j
        rest[j] = rest[j + 1] + float(step_rewards[j] or 0.0)
    return [float(outcome) + rest[t] for t in turns]


class RunningBaseline:
    """Per task bucket EMA of reward: advantage = reward - baseline before this reward.

    Live traffic gives one sample per prompt, so there is no group to compare with; the bucket's
    recent mean reward stands in. State is a plain dict so a Django service can persist it as JSON.
    """

    def __init__(self, decay: float = 0.9, initial: float = 0.0) -> None:
        if not 0 <= decay < 1:
            raise ValueError("decay must be in [0, 1)")
        self.decay = decay
        self.initial = initial
        self.values: dict[str, float] = {}

    def baseline(self, bucket: str) -> float:
        return self.values.get(bucket, self.initial)

    def update(self, bucket: str, reward: float) -> float:
        """Return the advantage of `reward`, then fold it into the bucket's baseline."""
        base = self.baseline(bucket)
        self.values[bucket] = self.decay * base + (1 - self.decay) * reward
        return reward - base

    def advantages(self, buckets: list[str], rewards: torch.Tensor) -> torch.Tensor:
        """(B,) advantages, updating in order; each sample sees only the samples before it."""
        out = [self.update(b, float(r)) for b, r in zip(buckets, rewards.tolist(), strict=True)]
        return torch.tensor(out, dtype=rewards.dtype)

    def state_dict(self) -> dict[str, object]:
        return {"decay": self.decay, "initial": self.initial, "values": dict(self.values)}

    @classmethod
    def from_state_dict(cls, state: dict[str, object]) -> RunningBaseline:
        out = cls(decay=float(state["decay"]), initial=float(state["initial"]))  # type: ignore[arg-type]
        out.values = {str(k): float(v) for k, v in dict(state["values"]).items()}  # type: ignore[call-overload]
        return out
