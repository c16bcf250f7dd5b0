"""Batch invariance: a row's output is bitwise the same alone, in any batch size and position.

Run: `.venv/bin/python -m pytest tests/kernels/test_batch_invariant.py -q`
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.batch_invariant as bi
from kernels.batch_invariant import batch_invariant_mode, linear, log_softmax, matmul, rms_norm
from kernels.logprobs import selective_log_softmax
from tests.kernels import reorder
from tests.kernels.conftest import VOCAB

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=[16, bi.ROW_TILE], ids=["tile16", "tile_default"])
def row_tile(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Also run with a tile smaller than the batch: full tiles plus a padded partial one."""
    monkeypatch.setattr(bi, "ROW_TILE", request.param)
    return request.param
# (K, N): hidden->hidden, hidden->mlp, mlp->hidden (where oneDNN bf16 varies with M), lm head
SHAPES = [(64, 64), (128, 512), (1024, 256), (256, 2048)]


def _assert_rows_invariant(op, x: torch.Tensor, sizes: tuple[int, ...] | None = None) -> None:  # noqa: ANN001
    """op(x[:b]) == op(x)[:b] for b in 1..64 (or `sizes`), and each row equals itself moved elsewhere."""
    full = op(x)  # (64, ...)
    for b in sizes or range(1, x.shape[0] + 1):
        assert torch.equal(op(x[:b]), full[:b]), f"batch size {b} changed the bits"
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    assert torch.equal(op(x[perm]), full[perm]), "position in the batch changed the bits"
    for i in (0, 17, 63):
        assert torch.equal(op(x[i : i + 1]), full[i : i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_matmul_rows_are_batch_invariant(dtype: torch.dtype, k: int, n: int, row_tile: int) -> None:
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(64, k, generator=g).to(dtype)
    _assert_rows_invariant(lambda t: linear(t, w), x)
    ref = F.linear(x.double(), w.double())
    assert torch.allclose(matmul(x, w.t()).double(), ref, rtol=2e-2, atol=2e-2 * k**0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [100, 2048, 8192])
def test_log_softmax_rows_are_batch_invariant(dtype: torch.dtype, v: int, row_tile: int) -> None:
    x = torch.randn(64, v, generator=torch.Generator().manual_seed(v)).to(dtype)
    _assert_rows_invariant(lambda t: log_softmax(t, -1), x)
    assert torch.allclose(log_softmax(x, -1).float(), torch.log_softmax(x.float(), -1).to(dtype).float(), atol=0.1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [64, 256, 4096, 40_000])
def test_rms_norm_rows_are_batch_invariant(dtype: torch.dtype, h: int) -> None:
    g = torch.Generator().manual_seed(h)
    x = torch.randn(64, h, generator=g).to(dtype)
    w = torch.randn(h, generator=g).to(dtype)
    # Rows wider than torch's serial reduction take the tiled path, where every batch below
    # ROW_TILE (256) is padded to one whole tile: a spread of sizes checks it at a sixth of the
    # cost of all 64 (31 s a dtype at 40,000).
    sizes = (1, 2, 3, 8, 17, 31, 32, 33, 47, 63, 64) if h >= 32_768 else None
    _assert_rows_invariant(lambda t: rms_norm(t, w, 1e-6), x, sizes)
    xf = x.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-6), ref)


def test_selective_log_softmax_rows_are_batch_invariant() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 1000, generator=g)
    ids = torch.randint(0, 1000, (64,), generator=g)
    full = selective_log_softmax(logits, ids)  # (64,)
    for b in range(1, 65):
        assert torch.equal(selective_log_softmax(logits[:b], ids[:b]), full[:b])
    perm = torch.randperm(64, generator=g)
    assert torch.equal(selective_log_softmax(logits[perm], ids[perm]), full[perm])


def _seq_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits[:, :-1]  # (B, T-1, V)
    return selective_log_softmax(logits, ids[:, 1:])  # (B, T-1)


@pytest.mark.parametrize("which", ["model_fp32", "model_bf16"])
def test_a_sequence_gets_the_same_logprobs_alone_or_in_a_batch_of_64(
    which: str, request: pytest.FixtureRequest, row_tile: int
) -> None:
    model = request.getfixturevalue(which)
    ids = torch.randint(0, VOCAB, (64, 6), generator=torch.Generator().manual_seed(5))  # short: MKL varies at M < 16
    with torch.no_grad(), batch_invariant_mode(model):
        full = _seq_logprobs(model, ids)  # (64, 11)
        for b in (1, 2, 7, 33):
            assert torch.equal(_seq_logprobs(model, ids[:b]), full[:b]), f"batch {b}"
        for i in (5, 40, 63):
            assert torch.equal(_seq_logprobs(model, ids[i : i + 1]), full[i : i + 1]), f"position {i}"


def test_the_trainer_with_autograd_and_the_engine_without_agree_bitwise(model_bf16: torch.nn.Module) -> None:
    ids = torch.randint(0, VOCAB, (8, 10), generator=torch.Generator().manual_seed(6))
    with batch_invariant_mode(model_bf16):
        with torch.no_grad():
            engine = _seq_logprobs(model_bf16, ids[:1])  # one request served alone
        trainer = _seq_logprobs(model_bf16, ids)  # a training batch, graph recorded
        trainer.sum().backward()
    model_bf16.zero_grad(set_to_none=True)
    assert torch.equal(engine, trainer[:1].detach())


def test_the_mode_restores_torch_and_the_model_on_exit(model_fp32: torch.nn.Module) -> None:
    before = (F.linear, torch.matmul, F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax)
    with batch_invariant_mode(model_fp32):
        assert F.linear is linear
        assert any("forward" in vars(m) for m in model_fp32.modules())
    assert (F.linear, torch.matmul, F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax) == before
    assert not any("forward" in vars(m) for m in model_fp32.modules())


@pytest.mark.parametrize("order", [*reorder.ORDERS, *reorder.ROUNDED_BETWEEN])
def test_the_probe_rejects_a_call_size_whose_reduction_order_differs(order: str) -> None:
    """A stand-in library that sums K in another order whenever a call is not exactly one tile:
    the probe rejects every other size, so every call is one tile (the assertions are in
    reorder.check_probe_rejects; test_probe_isa.py runs them under each ISA setting too)."""
    reorder.check_probe_rejects(order)


@pytest.mark.parametrize("dtype", DTYPES)
def test_planned_calls_cover_the_rows_in_verified_sizes(dtype: torch.dtype) -> None:
    probe = bi._probe(16, bi._mm_probe_ops, 1024, 256, dtype, dtype, torch.device("cpu"), True)
    for m in range(1, 300):
        calls = probe.plan(m)
        assert [i for i, _, _ in calls] == [sum(n for _, n, _ in calls[:j]) for j in range(len(calls))]
        assert sum(n for _, n, _ in calls) == m
        assert all(s >= n and probe.same[s] for _, n, s in calls)
        assert all(n == s for _, n, s in calls[:-1]), "only the last call may be padded"


def test_probing_leaves_the_global_rng_alone() -> None:
    state = torch.get_rng_state()
    bi._probe(bi.ROW_TILE, bi._mm_probe_ops, 96, 40, torch.float32, torch.float32, torch.device("cpu"), True)(7)
    assert torch.equal(torch.get_rng_state(), state)
