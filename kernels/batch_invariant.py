"""Batch-invariant matmul, log_softmax and rms_norm, and a switch that routes a model through them.

Why: RL needs the trainer and the inference engine to compute the *same bits* for a sequence's
log-probs. Default CPU/GPU libraries pick a kernel, blocking and thread split from the shape of
the whole call, so a row's reduction order (and thus its rounding) changes with the batch size:
on this machine MKL's fp32 GEMM gives different bits for M=1..15 rows than inside a batch of
128, and oneDNN's bf16 GEMM differs at M=33..36 for K=1024.

How: every op here runs its library kernel on fixed-size row tiles. Rows are padded to a
multiple of `ROW_TILE` and each tile is one call of identical shape (ROW_TILE, K), so the library
makes the same choice for every call; within a tile a row's reduction runs over its own K (or
V, or hidden) elements only, so its bits depend on its own values and not on its neighbours, the
batch size or its position. Tests check this bitwise for batch sizes 1..64 and every position.
The Triton versions (`kernels.triton_ops`) get the same property by construction: one program
per row tile with a fixed BLOCK_K loop and no split-K.

    from kernels.batch_invariant import batch_invariant_mode
    with batch_invariant_mode(model):
        logits = model(input_ids).logits      # bitwise equal per sequence for any batch

ROW_TILE is part of the numerics contract: the trainer and the engine must use the same value
(a different tile shape may pick a different kernel). Padding costs compute when a call has far
fewer rows than a tile (decode at batch 1); bench/numerics.py prints both regimes. RMSNorm rows
need no tiling (see rms_norm).

Patching is process-wide while the context is open (F.linear, torch.matmul with a 2-D right
operand, log_softmax, and `*RMSNorm` modules of the models passed in); don't open it in one
thread while another thread runs unrelated torch code. Batched-by-batched matmuls (eager
attention scores) and SDPA are left to torch: they run one GEMM per (sequence, head) whose
shape does not depend on the batch size. Elementwise ops (SiLU, rotary cos/sin) are left to
torch too: torch evaluates the last few elements of each thread's range of exp-like ops with the
scalar routine, which may round differently from the vector one; with hidden widths that are
multiples of 32 (every model here) those ranges end on whole vectors, so no element takes it.

Run its tests: `.venv/bin/python -m pytest tests/kernels/test_batch_invariant.py -q -p no:django`
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROW_TILE = 256  # bench/numerics.py: 64 costs ~1.4x at batch 64 (bf16 GEMMs too small), 256 ~1.2x
_SERIAL_REDUCTION = 32768  # at::internal::GRAIN_SIZE

# Originals captured at import: the routed versions call these, so patching cannot recurse.
_ORIG: dict[str, Callable[..., Any]] = {
    "linear": F.linear,
    "matmul": torch.matmul,
    "F.log_softmax": F.log_softmax,
    "torch.log_softmax": torch.log_softmax,
    "Tensor.log_softmax": torch.Tensor.log_softmax,
}


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _tile_starts(m: int, tile: int) -> range:
    return range(0, m - m % tile, tile)


def _last_tile(x: torch.Tensor, tile: int) -> torch.Tensor | None:
    """The trailing partial tile of x (M, C), zero-padded to (tile, C); None if M % tile == 0."""
    rest = x.shape[0] % tile
    return F.pad(x[x.shape[0] - rest :], (0, 0, 0, tile - rest)) if rest else None


def _tiled(
    fn: Callable[[torch.Tensor], torch.Tensor],
    fn_out: Callable[[torch.Tensor, torch.Tensor], Any],
    x: torch.Tensor,
    out_shape: tuple[int, int],
    out_dtype: torch.dtype,
    tile: int,
    grad: bool,
) -> torch.Tensor:
    """Apply a row op to each (tile, C) slice of x (M, C); every library call sees one shape.

    fn_out writes into a preallocated slice (no copy); fn is the autograd-friendly variant.
    """
    m = x.shape[0]
    last = _last_tile(x, tile)  # (tile, C) | None
    if grad:
        parts = [fn(x[i : i + tile]) for i in _tile_starts(m, tile)]
        parts += [fn(last)[: m % tile]] if last is not None else []
        return torch.cat(parts)  # (M, N)
    out = torch.empty(out_shape, dtype=out_dtype, device=x.device)  # (M, N)
    for i in _tile_starts(m, tile):
        fn_out(x[i : i + tile], out[i : i + tile])
    if last is not None:
        out[m - m % tile :] = fn(last)[: m % tile]
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """a (..., K) @ b (K, N) -> (..., N), bitwise the same for a row whatever else is in a."""
    if b.dim() != 2 or a.dim() < 2:
        return _ORIG["matmul"](a, b)
    lead, k, n = a.shape[:-1], a.shape[-1], b.shape[1]
    rows = a.reshape(-1, k)  # (M, K)
    out = _tiled(
        lambda t: torch.mm(t, b),
        lambda t, o: torch.mm(t, b, out=o),
        rows,
        (rows.shape[0], n),
        torch.result_type(a, b),
        tile or ROW_TILE,
        _needs_grad(a, b),
    )  # (M, N)
    return out.reshape(*lead, n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Drop-in for F.linear: x (..., K), weight (N, K) -> (..., N)."""
    out = matmul(x, weight.t())  # (..., N)
    # The bias is added after the GEMM (not fused as in addmm) so it cannot change the order.
    return out + bias if bias is not None else out


def log_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Row-tiled log_softmax over `dim`; same semantics as torch.log_softmax."""
    if dtype is not None:
        x = x.to(dtype)
    moved = x.movedim(dim, -1)  # (..., V)
    rows = moved.reshape(-1, moved.shape[-1])  # (M, V)
    out = _tiled(
        lambda t: _ORIG["torch.log_softmax"](t, -1),
        lambda t, o: torch.ops.aten._log_softmax.out(t, -1, False, out=o),
        rows,
        tuple(rows.shape),
        rows.dtype,
        ROW_TILE,
        _needs_grad(rows),
    )  # (M, V)
    return out.reshape(moved.shape).movedim(-1, dim)


def _rms_tile(t: torch.Tensor, eps: float) -> torch.Tensor:
    tf = t.float()  # (tile, H)
    variance = tf.pow(2).mean(-1, keepdim=True)  # (tile, 1)
    return (tf * torch.rsqrt(variance + eps)).to(t.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """HF-style RMSNorm (fp32 statistics, cast back, then scale)."""
    rows = x.reshape(-1, x.shape[-1])  # (M, H)
    if rows.shape[1] < _SERIAL_REDUCTION:
        # torch reduces each row's H contiguous elements serially in an order fixed by H alone
        # (it splits a reduction across threads only past 32k elements per output), and the
        # elementwise steps are exactly rounded (mul, add, sqrt, div), so no tiling is needed.
        return weight * _rms_tile(x, eps) if weight is not None else _rms_tile(x, eps)
    out = _tiled(
        lambda t: _rms_tile(t, eps),
        lambda t, o: o.copy_(_rms_tile(t, eps)),
        rows,
        tuple(rows.shape),
        rows.dtype,
        ROW_TILE,
        _needs_grad(rows),
    ).reshape(x.shape)  # (..., H)
    return weight * out if weight is not None else out


def _log_softmax_patch(x: torch.Tensor, dim: int | None = None, *args: Any, **kwargs: Any) -> torch.Tensor:
    dtype = kwargs.get("dtype")
    if dim is None:
        return _ORIG["F.log_softmax"](x, dim, *args, **kwargs)
    return log_softmax(x, dim, dtype=dtype)


def _matmul_patch(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is not None:
        return _ORIG["matmul"](a, b, out=out)
    return matmul(a, b)


def _rms_forward(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)) or 1e-6)

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, module.weight, eps)

    return forward


def _rms_modules(models: tuple[nn.Module, ...]) -> list[nn.Module]:
    return [m for model in models for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


@contextlib.contextmanager
def batch_invariant_mode(*models: nn.Module) -> Iterator[None]:
    """Route F.linear, torch.matmul (2-D right side), log_softmax and the models' RMSNorms, and
    run HF MoE experts eagerly (per-expert F.linear calls, routed here): the default grouped_mm
    experts kernel is not batch invariant (a row's bits depend on how many tokens share its expert)."""
    patches: list[tuple[Any, str, Any]] = [
        (F, "linear", linear),
        (torch, "matmul", _matmul_patch),
        (F, "log_softmax", _log_softmax_patch),
        (torch, "log_softmax", _log_softmax_patch),
        (torch.Tensor, "log_softmax", _log_softmax_patch),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    norms = _rms_modules(models)
    experts = _moe_configs(models)
    experts_saved = {k: getattr(c, "_experts_implementation", None) for k, c in experts.items()}
    try:
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        for module in norms:
            module.forward = _rms_forward(module)  # type: ignore[method-assign]
        for config in experts.values():
            config._experts_implementation = "eager"
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        for module in norms:
            del module.forward  # back to the class's forward
        for key, config in experts.items():
            config._experts_implementation = experts_saved[key]


def _moe_configs(models: tuple[nn.Module, ...]) -> dict[int, Any]:
    """The configs of the HF MoE expert blocks in `models` (they read _experts_implementation)."""
    return {id(m.config): m.config for model in models for m in model.modules()
            if hasattr(m, "has_gate") and hasattr(m, "config")}
