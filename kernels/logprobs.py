"""Selective log-softmax: log p(id) for the chosen ids without the (B, T, V) log-softmax.

The plain reference materialises log_softmax over the vocabulary (B*T*V floats: 64 x 512 x 32k
is 4 GiB in fp32). Here rows are processed in chunks: per chunk only (chunk, V) fp32 values
live at once, the result keeps (N,) log-probs, and the backward pass recomputes softmax chunk
by chunk from the saved logits (which exist anyway).
Each row is reduced on its own, so a row's log-prob does not depend on the chunking.

    lp = selective_log_softmax(logits, ids)    # logits (B, T, V), ids (B, T) -> (B, T) fp32

`peak_allocated_bytes(fn)` measures the extra tensor memory a call allocates (CPU included),
which `bench/numerics.py` prints and the tests bound.

Run its tests: `.venv/bin/python -m pytest tests/kernels/test_logprobs.py -q -p no:django`
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DEFAULT_CHUNK = 512


def selective_log_softmax_reference(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Plain torch: logits (..., V), ids (...) -> (...) fp32 log-probs."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (..., V)
    return logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (...)


def _chunk_logp(rows: torch.Tensor) -> torch.Tensor:
    # torch's last-dim log_softmax kernel reduces each row on its own with masked vector tails.
    # logsumexp would go through generic elementwise exp, whose scalar tail (at the end of each
    # thread's range) rounds differently from the vector body: a row's bits would then depend
    # on where the batch put it.
    return torch.log_softmax(rows.float(), dim=-1)  # (C, V)


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, ids: torch.Tensor, chunk: int) -> torch.Tensor:
        out = logits.new_empty(logits.shape[0], dtype=torch.float32)  # (N,)
        for i in range(0, logits.shape[0], chunk):
            logp = _chunk_logp(logits[i : i + chunk])  # (C, V)
            out[i : i + chunk] = logp.gather(-1, ids[i : i + chunk].unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(logits, ids)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, ids = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)  # (N, V)
        for i in range(0, logits.shape[0], ctx.chunk):
            sl = slice(i, i + ctx.chunk)
            g = grad[sl].unsqueeze(-1)  # (C, 1)
            # d log p(id) / d logit_j = 1[j == id] - softmax_j; softmax recomputed per chunk
            d = -_chunk_logp(logits[sl]).exp_() * g  # (C, V)
            d.scatter_add_(-1, ids[sl].unsqueeze(-1), g)
            grad_logits[sl] = d.to(logits.dtype)
        return grad_logits, None, None


def selective_log_softmax(
    logits: torch.Tensor, ids: torch.Tensor, chunk_size: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """logits (..., V), ids (...) -> (...) fp32 log-probs; differentiable w.r.t. logits."""
    if logits.shape[:-1] != ids.shape:
        raise ValueError(f"ids shape {tuple(ids.shape)} must equal logits shape without V {tuple(logits.shape[:-1])}")
    rows = logits.reshape(-1, logits.shape[-1])  # (N, V)
    out = _SelectiveLogSoftmax.apply(rows, ids.reshape(-1), int(chunk_size))  # (N,)
    return out.reshape(ids.shape)


class _LiveBytes(TorchDispatchMode):
    """Counts bytes of tensor storages created by ops and still referenced; records the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.refs: dict[int, list[int]] = {}  # storage ptr -> [tensors alive, nbytes]

    def _release(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[ptr]

    def _track(self, t: torch.Tensor, input_ptrs: set[int]) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr in input_ptrs and ptr not in self.refs:
            return  # a view of something that existed before the measured call
        entry = self.refs.setdefault(ptr, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(t, self._release, ptr)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat_in, _ = tree_flatten((args, kwargs or {}))
        input_ptrs = {a.untyped_storage().data_ptr() for a in flat_in if isinstance(a, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                self._track(t, input_ptrs)
        return out


def peak_allocated_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes of new tensor storage alive at once while fn() runs (its result included)."""
    with _LiveBytes() as mode:
        result = fn()
    del result
    return mode.peak
