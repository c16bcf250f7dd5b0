"""MoE router capture and replay for transformers' Qwen3-MoE (`Qwen3MoeTopKRouter`).

Inference records which top-k experts each token used; the trainer's forward must use the same
experts, or pi_old and pi_theta are computed by a different network than the one that sampled
(the train/inference mismatch MoE models are notorious for). A forward hook on each router
replaces its chosen ids by the recorded ones and recomputes the gate weights from the current
router logits, so the router still gets a gradient.

Routing is an int tensor (L, N, k): L MoE layers in module order, N tokens in the order the
router sees them (a (B, T) batch flattened row-major), k experts per token. An id of -1 marks a
token with no recorded routing; that token keeps the router's own choice.

    .venv/bin/python -m pytest tests/kernels/test_routing.py -q -p no:django
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

RouterOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # logits (N, E), weights (N, k), ids (N, k)


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k routers in module order (layer 0 first).

    Matched by shape of interface rather than class, so Qwen3-MoE and its close relatives
    (routers with `top_k`, `num_experts`, `norm_topk_prob` returning logits, weights, ids) work.
    """
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("top_k", "num_experts", "norm_topk_prob"))]


def batch_routing_to_flat(routing: torch.Tensor) -> torch.Tensor:
    """(B, L, T, k) per-sample routing -> (L, B*T, k) in the order the router sees tokens."""
    b, n_layers, t, k = routing.shape
    return routing.permute(1, 0, 2, 3).reshape(n_layers, b * t, k)


def gate_weights(logits: torch.Tensor, ids: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """Gate weights of chosen experts exactly as Qwen3-MoE computes them, for any ids."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # (N, E)
    weights = probs.gather(1, ids)  # (N, k)
    if norm_topk_prob:
        # Same as a softmax over the chosen experts' logits only.
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


@dataclass
class RoutingCapture:
    """Top-k ids each router produced, one list of (N_call, k) chunks per layer."""

    chunks: list[list[torch.Tensor]] = field(default_factory=list)

    def routing(self) -> torch.Tensor:
        """(L, N, k) int64; N sums the tokens of every forward call made while capturing."""
        return torch.stack([torch.cat(layer, dim=0) for layer in self.chunks])


@contextmanager
def capture_routing(model: nn.Module) -> Iterator[RoutingCapture]:
    """Record routing of every forward pass inside the block (after any replay hook)."""
    routers = _require_routers(model)
    capture = RoutingCapture(chunks=[[] for _ in routers])

    def make_hook(layer: int):
        def hook(module: nn.Module, args: tuple, output: RouterOutput) -> None:
            capture.chunks[layer].append(output[2].detach().cpu())

        return hook

    handles = [r.register_forward_hook(make_hook(i)) for i, r in enumerate(routers)]
    try:
        yield capture
    finally:
        for h in handles:
            h.remove()


@dataclass
class ReplayStats:
    """How often the router's own choice differed from the replayed one (a mismatch metric)."""

    tokens: int = 0
    replayed: int = 0
    differed: int = 0  # replayed tokens whose own top-k set differed from the recorded set

    @property
    def mismatch_fraction(self) -> float:
        return self.differed / self.replayed if self.replayed else 0.0


@contextmanager
def replay_routing(model: nn.Module, routing: torch.Tensor) -> Iterator[ReplayStats]:
    """Force recorded expert ids (L, N, k) in every forward inside the block.

    Successive forward calls consume successive tokens (so step-by-step decoding works too).
    """
    routers = _require_routers(model)
    if routing.dim() != 3 or routing.shape[0] != len(routers):
        raise ValueError(f"routing must be (L={len(routers)}, N, k); got {tuple(routing.shape)}")
    stats = ReplayStats()
    offsets = [0] * len(routers)

    def make_hook(layer: int):
        def hook(module: nn.Module, args: tuple, output: RouterOutput) -> RouterOutput:
            logits, _, own_ids = output  # (N, E), (N, k), (N, k)
            n = own_ids.shape[0]
            forced = _take(routing[layer], offsets[layer], n, own_ids)  # (N, k)
            offsets[layer] += n
            recorded = (forced >= 0).all(dim=-1, keepdim=True)  # (N, 1)
            ids = torch.where(recorded, forced, own_ids)  # (N, k)
            _count(stats, own_ids, ids, recorded)
            return logits, gate_weights(logits, ids, module.norm_topk_prob), ids

        return hook

    handles = [r.register_forward_hook(make_hook(i)) for i, r in enumerate(routers)]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()


def _require_routers(model: nn.Module) -> list[nn.Module]:
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE top-k routers to capture or replay")
    return routers


def _take(layer_routing: torch.Tensor, start: int, n: int, own_ids: torch.Tensor) -> torch.Tensor:
    if start + n > layer_routing.shape[0] or layer_routing.shape[1] != own_ids.shape[1]:
        raise ValueError(
            f"recorded routing has {layer_routing.shape[0]} tokens x k={layer_routing.shape[1]}; "
            f"the forward needs tokens {start}..{start + n} x k={own_ids.shape[1]}"
        )
    return layer_routing[start : start + n].to(device=own_ids.device, dtype=own_ids.dtype)


def _count(stats: ReplayStats, own_ids: torch.Tensor, ids: torch.Tensor, recorded: torch.Tensor) -> None:
    own_sorted, ids_sorted = own_ids.sort(dim=-1).values, ids.sort(dim=-1).values  # order-free compare
    differed = (own_sorted != ids_sorted).any(dim=-1) & recorded.squeeze(-1)
    stats.tokens += own_ids.shape[0]
    stats.replayed += int(recorded.sum())
    stats.differed += int(differed.sum())
