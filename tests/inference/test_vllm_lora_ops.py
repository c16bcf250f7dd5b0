"""The CPU LoRA ops Flywheel installs in vLLM's workers (inference/vllm_lora_ops.py): output for
output vLLM's own `bgmv_*` ops within float rounding, on batches of one adapter, of several, of
tokens without one (a negative index, the last slot as vLLM's indexing has it), adding to or
overwriting the output, with the model's padding; and installed where vLLM's CPU punica wrapper
and prefill ops look them up. The served log-probs through them: tests/inference/test_vllm_lora.py.

    .venv/bin/python -m pytest tests/inference/test_vllm_lora_ops.py -q
"""

from __future__ import annotations

import pytest
import torch
from vllm.lora.ops.torch_ops import lora_ops
from vllm.lora.punica_wrapper import punica_cpu

from inference import vllm_lora_ops as ours

SLOTS, RANK, HIDDEN, OUT = 4, 8, 48, 80
INDICES = {
    "one adapter": [2] * 7,
    "production and canary": [0, 1, 0, 0, 1, 0, 0],
    "no adapter and two": [-1, 0, 3, -1, 3, 3, 0],
    "one token": [1],
}


def _vllms(name: str):
    return ours._ORIGINAL.get(name) or getattr(lora_ops, name)


@pytest.fixture
def gen(monkeypatch: pytest.MonkeyPatch) -> torch.Generator:
    monkeypatch.setattr(ours, "MIN_GATHER", 0)  # these small batches take our ops, not vLLM's
    return torch.Generator().manual_seed(0)


def test_a_small_decode_batch_keeps_vllms_ops_and_a_prefill_takes_ours() -> None:
    calls = []
    original = ours._products
    ours._products = lambda *a: calls.append(a[0].shape[0]) or original(*a)
    try:
        for tokens in (16, 512):
            x, w = torch.randn(tokens, 896), torch.randn(2, 1, 8, 896)
            ours.bgmv_shrink(x, w, torch.zeros(tokens, 8), torch.zeros(tokens, dtype=torch.long), 1.0)
    finally:
        ours._products = original
    assert calls == [512]


@pytest.mark.parametrize("case", list(INDICES))
@pytest.mark.parametrize("stacked", [3, 4])
def test_shrink_equals_vllms(case: str, stacked: int, gen: torch.Generator) -> None:
    idx = torch.tensor(INDICES[case])
    x = torch.randn(len(idx), HIDDEN, generator=gen)
    w = torch.randn(SLOTS, RANK, HIDDEN, generator=gen)
    w = w[:, None] if stacked == 4 else w
    theirs, mine = torch.zeros(len(idx), RANK + 2), torch.zeros(len(idx), RANK + 2)
    _vllms("bgmv_shrink")(x, w, theirs, idx, 0.5)
    ours.bgmv_shrink(x, w, mine, idx, 0.5)
    assert torch.allclose(mine, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(INDICES))
@pytest.mark.parametrize("add", [True, False])
def test_expand_and_expand_slice_equal_vllms(case: str, add: bool, gen: torch.Generator) -> None:
    idx = torch.tensor(INDICES[case])
    x = torch.randn(len(idx), RANK, generator=gen)
    w = torch.randn(SLOTS, 1, OUT, RANK, generator=gen)
    start = torch.randn(len(idx), OUT - 16, generator=gen)  # the model pads less than the adapter
    theirs, mine = start.clone(), start.clone()
    _vllms("bgmv_expand")(x, w, theirs, idx, add)
    ours.bgmv_expand(x, w, mine, idx, add)
    assert torch.allclose(mine, theirs, atol=1e-5, rtol=1e-5)
    wide = torch.randn(len(idx), 3 * OUT, generator=gen)
    theirs, mine = wide.clone(), wide.clone()
    _vllms("bgmv_expand_slice")(x, w, theirs, idx, OUT, OUT, add)
    ours.bgmv_expand_slice(x, w, mine, idx, OUT, OUT, add)
    assert torch.allclose(mine, theirs, atol=1e-5, rtol=1e-5)
    assert torch.equal(mine[:, :OUT], wide[:, :OUT]) and torch.equal(mine[:, 2 * OUT :], wide[:, 2 * OUT :])


def test_prefill_ops_reach_ours_once_installed(gen: torch.Generator) -> None:
    ours.install()
    assert punica_cpu.bgmv_shrink is ours.bgmv_shrink and lora_ops.bgmv_expand is ours.bgmv_expand
    calls = []
    original = ours._products
    ours._products = lambda *a: calls.append(1) or original(*a)
    try:
        x = torch.randn(5, HIDDEN, generator=gen)
        w = torch.randn(SLOTS, RANK, HIDDEN, generator=gen)
        y = torch.zeros(5, RANK)
        # two sequences (3 and 2 tokens) of adapters 1 and 0, as a prefill batch is described
        punica_cpu.sgmv_shrink(x, w, y, torch.tensor([0, 3]), torch.tensor([3, 2]), torch.tensor([1, 0]), 2, 3, 5, 1.0)
    finally:
        ours._products = original
    assert calls == [1]
    assert torch.allclose(y[:3], x[:3] @ w[1].T, atol=1e-5) and torch.allclose(y[3:], x[3:] @ w[0].T, atol=1e-5)


def test_a_lora_layer_whose_adapters_have_zero_b_returns_its_base_output_until_one_is_set() -> None:
    """vLLM wraps every linear layer for LoRA; one no loaded adapter trains (o, gate/up, down for a
    q/v adapter) adds x A^T 0. Installed, it returns the base output untouched and skips the
    products, until set_lora gives it weights (and again after reset_lora)."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.row_parallel_linear import RowParallelLinearWithLoRA

    ours.install()

    class Punica:
        calls = 0

        def add_lora_linear(self, output, *args):  # in place, as vLLM's CPU wrapper adds
            Punica.calls += 1
            output += 1
            return output

    layer = object.__new__(RowParallelLinearWithLoRA)  # the state the wrappers read, no model
    object.__setattr__(layer, "_modules", {})
    layer.__dict__.update(lora_a_stacked=(torch.zeros(2, 1, 8, 16),), lora_b_stacked=(torch.zeros(2, 1, 16, 8),),
                          punica_wrapper=Punica(), output_slices=(16,), n_slices=1, tp_size=1, tp_rank=0)
    x, out = torch.randn(3, 16), torch.randn(3, 16)
    assert BaseLinearLayerWithLoRA._apply_lora_to_output(layer, x, out) is out and Punica.calls == 0
    BaseLinearLayerWithLoRA.set_lora(layer, 1, torch.ones(8, 16), torch.ones(16, 8))
    before = out.clone()
    assert torch.equal(BaseLinearLayerWithLoRA._apply_lora_to_output(layer, x, out), before + 1) and Punica.calls == 1
    BaseLinearLayerWithLoRA.reset_lora(layer, 1)
    assert BaseLinearLayerWithLoRA._apply_lora_to_output(layer, x, out) is out and Punica.calls == 1
