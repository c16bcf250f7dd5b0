"""Triton kernels vs the plain-torch references (interpreter on CPU; real kernels on CUDA).

Run: `TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/test_triton_ops.py -q`
(conftest sets TRITON_INTERPRET=1 itself when there is no CUDA device). Shapes stay small: the
interpreter runs each program in numpy.
"""

from __future__ import annotations

import pytest
import torch

from kernels import triton_ops as T
from kernels.batch_invariant import rms_norm
from kernels.logprobs import selective_log_softmax_reference

pytestmark = pytest.mark.skipif(not T.HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(("m", "k", "n"), [(1, 8, 8), (37, 48, 40), (64, 70, 33)])
def test_matmul_matches_torch_and_is_batch_invariant(m: int, k: int, n: int) -> None:
    a = torch.randn(m, k, generator=_g(m)).to(DEVICE)
    b = torch.randn(k, n, generator=_g(k)).to(DEVICE)
    c = T.matmul(a, b)
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-4)
    for rows in (slice(0, 1), slice(m // 2, m), slice(0, m)):
        assert torch.equal(T.matmul(a[rows], b), c[rows])


def test_matmul_row_bits_do_not_depend_on_the_rows_position_in_its_tile() -> None:
    # Slicing off s leading rows moves every row to each position of a BLOCK_M tile in turn.
    # (Under the interpreter, tl.dot is numpy's matmul: OpenBLAS's Haswell sgemm gives a row moved
    # from position 18 to 0 different bits, so this fails if the kernel uses tl.dot there.)
    m, k, n = T.BLOCK_M + 5, 48, 40
    scale = 2.0 ** torch.randint(-6, 7, (m, k), generator=_g(3))  # spread exponents: rounding shows
    a = (torch.randn(m, k, generator=_g(4)) * scale).to(DEVICE)
    b = torch.randn(k, n, generator=_g(5)).to(DEVICE)
    full = T.matmul(a, b)
    torch.testing.assert_close(full, a @ b, rtol=1e-4, atol=1e-3)
    for s in range(T.BLOCK_M + 1):
        assert torch.equal(T.matmul(a[s:], b), full[s:]), f"rows {s}: changed bits"


@pytest.mark.parametrize("v", [5, 300])
def test_log_softmax_and_selective_match_torch(v: int) -> None:
    x = (torch.randn(6, v, generator=_g(v)) * 5).to(DEVICE)
    ids = torch.randint(0, v, (6,), generator=_g(v + 1)).to(DEVICE)
    y = T.log_softmax(x)
    torch.testing.assert_close(y, torch.log_softmax(x, -1), rtol=1e-5, atol=1e-5)
    sel = T.selective_log_softmax(x, ids)
    torch.testing.assert_close(sel, selective_log_softmax_reference(x, ids), rtol=1e-5, atol=1e-5)
    assert torch.equal(T.log_softmax(x[2:3]), y[2:3])
    assert torch.equal(T.selective_log_softmax(x[4:], ids[4:]), sel[4:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference(dtype: torch.dtype) -> None:
    x = torch.randn(5, 300, generator=_g(1)).to(dtype).to(DEVICE)
    w = torch.randn(300, generator=_g(2)).to(dtype).to(DEVICE)
    y = T.rms_norm(x, w)
    ref = rms_norm(x, w, 1e-6)
    # The interpreter emulates bf16 rounding in numpy; allow one bf16 ulp there.
    tol = 2**-6 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol)
    assert torch.equal(T.rms_norm(x[1:2], w), y[1:2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: compiled Triton kernels")
def test_compiled_matmul_is_bitwise_invariant_from_batch_1_to_64_on_gpu() -> None:
    a = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    full = T.matmul(a, b)
    for m in range(1, 65):
        assert torch.equal(T.matmul(a[:m], b), full[:m])
