"""Triton kernels for the GPU: batch-invariant matmul, log_softmax, rms_norm, selective log-softmax.

Batch invariance by construction: one program per output tile (matmul) or per row (the rest),
a fixed BLOCK_K / BLOCK_V / BLOCK_H loop in index order, fp32 accumulation and no split-K or
cross-row reduction, and block sizes that are constants rather than tuned on the batch shape.
So a row's bits depend only on its own values. Plain-torch references live in
`kernels.batch_invariant` and `kernels.logprobs`.

Under the interpreter (TRITON_INTERPRET=1) `tl.dot` is numpy's matmul, i.e. OpenBLAS sgemm, whose
micro-kernel sums a row in an order that depends on the row's position inside the block (on
OpenBLAS's Haswell kernel, which Zen CPUs get too, one row placed at each of the 32 positions of a
tile comes out with 3 different bit patterns; OPENBLAS_NUM_THREADS=1 does not change that). So the matmul kernel takes
`INTERPRETED` (a constexpr): when it is set, each BLOCK_K step is an elementwise product summed over
K (`tl.sum(a[:, :, None] * b[None, :, :], 1)`, numpy adds whole rows lane by lane, the same order
for every row). A compiled kernel gets INTERPRETED=False and keeps `tl.dot`; the branch is pruned
at compile time.

Without triton installed, importing this module works and `HAS_TRITON` is False; calling a
kernel raises RuntimeError. On a CPU-only machine the kernels run under the interpreter:

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/test_triton_ops.py -q -p no:django
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the package must work without triton (CPU installs)
    triton = None
    tl = None
    HAS_TRITON = False

BLOCK_M, BLOCK_N, BLOCK_K = 32, 32, 32
BLOCK_ROW = 256


def _require() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: use kernels.batch_invariant on this machine")


if HAS_TRITON:

    @triton.jit
    def _matmul_kernel(a, b, c, M, N, K, sam, sak, sbk, sbn, scm, scn,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       INTERPRETED: tl.constexpr):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):  # fixed order over K: no split-K, same for every M
            ka = k0 + rk
            ta = tl.load(a + rm[:, None] * sam + ka[None, :] * sak,
                         mask=(rm[:, None] < M) & (ka[None, :] < K), other=0.0)  # fmt: skip
            tb = tl.load(b + ka[:, None] * sbk + rn[None, :] * sbn,
                         mask=(ka[:, None] < K) & (rn[None, :] < N), other=0.0)  # fmt: skip
            ta = ta.to(tl.float32)
            tb = tb.to(tl.float32)
            if INTERPRETED:  # numpy's matmul (OpenBLAS) is not row-independent: see the docstring
                acc += tl.sum(ta[:, :, None] * tb[None, :, :], axis=1)
            else:
                acc += tl.dot(ta, tb, input_precision="ieee")
        tl.store(c + rm[:, None] * scm + rn[None, :] * scn, acc.to(c.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))  # fmt: skip

    @triton.jit
    def _row_lse(x_row, V, BV: tl.constexpr):
        """Online log-sum-exp of one row, blocks in index order (fixed for every batch)."""
        m = tl.full((BV,), float("-inf"), tl.float32)
        s = tl.zeros((BV,), tl.float32)
        for v0 in range(0, V, BV):
            cols = v0 + tl.arange(0, BV)
            x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - safe) + tl.exp(x - safe)
            m = m_new
        mx = tl.max(m, 0)
        total = tl.sum(s * tl.exp(m - mx), 0)
        return mx + tl.log(total)

    @triton.jit
    def _log_softmax_kernel(x, y, V, sx, sy, BV: tl.constexpr):
        row = tl.program_id(0)
        lse = _row_lse(x + row * sx, V, BV)
        for v0 in range(0, V, BV):
            cols = v0 + tl.arange(0, BV)
            val = tl.load(x + row * sx + cols, mask=cols < V, other=0.0).to(tl.float32)
            tl.store(y + row * sy + cols, (val - lse).to(y.dtype.element_ty), mask=cols < V)

    @triton.jit
    def _selective_kernel(x, ids, out, V, sx, BV: tl.constexpr):
        row = tl.program_id(0)
        lse = _row_lse(x + row * sx, V, BV)
        tok = tl.load(ids + row)
        picked = tl.load(x + row * sx + tok).to(tl.float32)
        tl.store(out + row, picked - lse)

    @triton.jit
    def _rms_norm_kernel(x, w, y, H, sx, sy, eps, BH: tl.constexpr):
        row = tl.program_id(0)
        acc = tl.zeros((BH,), tl.float32)
        for h0 in range(0, H, BH):
            cols = h0 + tl.arange(0, BH)
            v = tl.load(x + row * sx + cols, mask=cols < H, other=0.0).to(tl.float32)
            acc += v * v
        rstd = 1.0 / tl.sqrt(tl.sum(acc, 0) / H + eps)
        for h0 in range(0, H, BH):
            cols = h0 + tl.arange(0, BH)
            v = tl.load(x + row * sx + cols, mask=cols < H, other=0.0).to(tl.float32)
            # Round to the input dtype before scaling, like HF RMSNorm; a bf16 x bf16 product
            # done in fp32 and rounded once equals torch's bf16 multiply.
            normed = (v * rstd).to(y.dtype.element_ty).to(tl.float32)
            g = tl.load(w + cols, mask=cols < H, other=0.0).to(tl.float32)
            tl.store(y + row * sy + cols, (g * normed).to(y.dtype.element_ty), mask=cols < H)


def _interpreted() -> bool:
    """True when the kernels run in Triton's interpreter (TRITON_INTERPRET=1 at triton's import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_matmul_kernel, InterpretedFunction)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()  # (M, C)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (..., K) @ b (K, N) -> (..., N), fp32 accumulation, batch-invariant."""
    _require()
    rows = _rows(a)  # (M, K)
    m, k = rows.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)  # (M, N)
    grid: Any = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](rows, b, c, m, n, k, rows.stride(0), rows.stride(1), b.stride(0), b.stride(1),
                         c.stride(0), c.stride(1), BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                         INTERPRETED=_interpreted())  # fmt: skip
    return c.reshape(*a.shape[:-1], n)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, one program per row."""
    _require()
    rows = _rows(x)  # (M, V)
    y = torch.empty_like(rows)
    _log_softmax_kernel[(rows.shape[0],)](rows, y, rows.shape[1], rows.stride(0), y.stride(0), BV=BLOCK_ROW)
    return y.reshape(x.shape)


def selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits (..., V), ids (...) -> (...) fp32 log-probs; never materialises (N, V)."""
    _require()
    rows = _rows(logits)  # (N, V)
    flat_ids = ids.reshape(-1).contiguous()  # (N,)
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=logits.device)  # (N,)
    _selective_kernel[(rows.shape[0],)](rows, flat_ids, out, rows.shape[1], rows.stride(0), BV=BLOCK_ROW)
    return out.reshape(ids.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF-style RMSNorm over the last dim, one program per row."""
    _require()
    rows = _rows(x)  # (M, H)
    y = torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, y, rows.shape[1], rows.stride(0), y.stride(0), eps, BH=BLOCK_ROW)
    return y.reshape(x.shape)
