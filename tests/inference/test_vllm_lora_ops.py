"""The CPU LoRA ops Flywheel installs in vLLM's workers (inference/vllm_lora_ops.py): vLLM's own
`bgmv_*` ops and `add_lora_linear` output for output within float rounding for every token with an
adapter, on batches of one adapter, of several, adding to or overwriting the output, with the
model's padding; and nothing for a token without an adapter (index -1), which vLLM's CPU ops served
through the last adapter slot. Installed where vLLM's CPU punica wrapper and prefill ops look them
up; the step's grouping computed once per mapping. The served log-probs through them:
tests/inference/test_vllm_lora.py (a base request batched with two adapters' included).

    .venv/bin/python -m pytest tests/inference/test_vllm_lora_ops.py -q
"""

from __future__ import annotations

import pytest
import torch
from vllm.lora.layers import LoRAMapping
from vllm.lora.ops.torch_ops import lora_ops
from vllm.lora.punica_wrapper import punica_cpu

from inference import vllm_lora_ops as ours

SLOTS, RANK, HIDDEN, OUT = 4, 8, 48, 80
INDICES = {
    "one adapter": [2] * 7,
    "production and canary": [0, 1, 0, 0, 1, 0, 0],
    "no adapter and two": [-1, 0, 3, -1, 3, 3, 0],
    "no adapter and the last slot's": [-1, 3, -1, 3],
    "no adapter at all": [-1, -1, -1],
    "one token": [1],
}


def _vllms(name: str):
    return ours._ORIGINAL.get(name) or getattr(lora_ops, name)


def _with_empty_slot(w: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference for vLLM's op: one more slot of zeros, where the tokens without an adapter
    point (what the GPU kernels compute by skipping them)."""
    return torch.cat([w, torch.zeros_like(w[:1])]), torch.where(idx < 0, w.shape[0], idx)


@pytest.fixture(params=["gathered", "grouped"])
def gen(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> torch.Generator:
    # These batches are small: both of our paths, the small calls' gather and the grouping
    monkeypatch.setattr(ours, "MIN_GATHER", 10**12 if request.param == "gathered" else 0)
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("case", list(INDICES))
@pytest.mark.parametrize("stacked", [3, 4])
def test_shrink_equals_vllms_and_adds_nothing_without_an_adapter(case: str, stacked: int,
                                                                  gen: torch.Generator) -> None:
    idx = torch.tensor(INDICES[case])
    x = torch.randn(len(idx), HIDDEN, generator=gen)
    w = torch.randn(SLOTS, RANK, HIDDEN, generator=gen)
    w = w[:, None] if stacked == 4 else w
    ref_w, ref_idx = _with_empty_slot(w, idx)
    theirs, mine = torch.zeros(len(idx), RANK + 2), torch.zeros(len(idx), RANK + 2)
    _vllms("bgmv_shrink")(x, ref_w, theirs, ref_idx, 0.5)
    ours.bgmv_shrink(x, w, mine, idx, 0.5)
    assert torch.allclose(mine, theirs, atol=1e-5, rtol=1e-5)
    assert not mine[idx < 0].any()


@pytest.mark.parametrize("case", list(INDICES))
@pytest.mark.parametrize("add", [True, False])
def test_expand_and_expand_slice_equal_vllms(case: str, add: bool, gen: torch.Generator) -> None:
    idx = torch.tensor(INDICES[case])
    x = torch.randn(len(idx), RANK, generator=gen)
    w = torch.randn(SLOTS, 1, OUT, RANK, generator=gen)
    ref_w, ref_idx = _with_empty_slot(w, idx)
    start = torch.randn(len(idx), OUT - 16, generator=gen)  # the model pads less than the adapter
    theirs, mine = start.clone(), start.clone()
    _vllms("bgmv_expand")(x, ref_w, theirs, ref_idx, add)
    ours.bgmv_expand(x, w, mine, idx, add)
    assert torch.allclose(mine, theirs, atol=1e-5, rtol=1e-5)
    wide = torch.randn(len(idx), 3 * OUT, generator=gen)
    theirs, mine = wide.clone(), wide.clone()
    _vllms("bgmv_expand_slice")(x, ref_w, theirs, ref_idx, OUT, OUT, add)
    ours.bgmv_expand_slice(x, w, mine, idx, OUT, OUT, add)
    assert torch.allclose(mine, theirs, atol=1e-5, rtol=1e-5)
    assert torch.equal(mine[:, :OUT], wide[:, :OUT]) and torch.equal(mine[:, 2 * OUT :], wide[:, 2 * OUT :])


def _wrapper(idx: list[int]) -> punica_cpu.PunicaWrapperCPU:
    """vLLM's CPU punica wrapper given a step's mapping (slot s holds the adapter of id 10 + s; a
    token without one has id 0), as vLLM's LoRA manager gives it."""
    wrapper = punica_cpu.PunicaWrapperCPU(64, 8, "cpu")
    ids = tuple(0 if i < 0 else 10 + i for i in idx)
    wrapper.update_metadata(LoRAMapping(ids, ids, is_prefill=True), [10 + s for s in range(SLOTS)], SLOTS, 2048)
    return wrapper


@pytest.mark.parametrize("case", list(INDICES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [4, 1], ids=["fused", "slot by slot"])
def test_add_lora_linear_adds_each_tokens_adapter_over_three_slices(case: str, dtype: torch.dtype, fused: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """q, k and v: y[t, slice i] += (x[t] A_i^T scale) B_i^T with token t's adapter, nothing
    without one; against the product in float64. Both paths: all four slots in one fused product,
    and slot by slot (more live slots than MAX_FUSED)."""
    ours.install()
    monkeypatch.setattr(ours, "MAX_FUSED", fused)
    gen = torch.Generator().manual_seed(1)
    idx = INDICES[case]
    slices = (64, 32, 32)
    a = tuple(torch.randn(SLOTS, 1, RANK, HIDDEN, generator=gen).to(dtype) for _ in slices)
    b = tuple(torch.randn(SLOTS, 1, n, RANK, generator=gen).to(dtype) for n in slices)
    b[1][0].zero_()  # slot 0's adapter leaves k alone (q/v), the others train it
    x = torch.randn(len(idx), HIDDEN, generator=gen).to(dtype)
    y = torch.randn(len(idx), sum(slices), generator=gen).to(dtype)
    expected = y.double().clone()
    for t, s in enumerate(idx):
        if s >= 0:
            expected[t] += torch.cat([(x[t].double() @ a_[s, 0].double().T * 0.5) @ b_[s, 0].double().T
                                      for a_, b_ in zip(a, b, strict=True)])
    got = y.clone()
    _wrapper(idx).add_lora_linear(got, x, a, b, 0.5, slices)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(got.double(), expected, atol=tol, rtol=tol * 0.1)
    missing = torch.tensor(idx) < 0
    assert torch.equal(got[missing], y[missing])  # untouched where no adapter is


@pytest.mark.parametrize("fused", [4, 0], ids=["fused", "slot by slot"])
def test_the_steps_grouping_is_computed_once_per_mapping(monkeypatch: pytest.MonkeyPatch, fused: int) -> None:
    """Slot by slot, the tokens are grouped once per mapping, not per layer; fused, never (the
    slots a step uses come from the mapping as update_metadata read it)."""
    ours.install()
    monkeypatch.setattr(ours, "MAX_FUSED", fused)
    calls = []
    original = ours.groups_of
    monkeypatch.setattr(ours, "groups_of", lambda i: calls.append(i.tolist()) or original(i))
    wrapper = _wrapper([0, 1, 1])
    a, b = (torch.ones(SLOTS, 1, RANK, HIDDEN),), (torch.ones(SLOTS, 1, OUT, RANK),)
    for _ in range(3):  # three layers of one step
        wrapper.add_lora_linear(torch.zeros(3, OUT), torch.ones(3, HIDDEN), a, b, 1.0, (OUT,))
    wrapper.update_metadata(LoRAMapping((0, 11), (0, 11), is_prefill=True), [10 + s for s in range(SLOTS)],
                            SLOTS, 2048)
    y = torch.zeros(2, OUT)
    wrapper.add_lora_linear(y, torch.ones(2, HIDDEN), a, b, 1.0, (OUT,))
    assert calls == ([[0, 1, 1], [-1, 1]] if fused == 0 else [])
    assert not y[0].any() and torch.equal(y[1], torch.full((OUT,), float(RANK * HIDDEN)))


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


def test_new_weights_in_a_slot_are_the_ones_applied() -> None:
    """The grouped path keeps each layer's stacked A and live slices until set_lora or reset_lora
    changes a slot: an adapter loaded where another was must be the one served."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.row_parallel_linear import RowParallelLinearWithLoRA

    ours.install()
    layer = object.__new__(RowParallelLinearWithLoRA)  # the state set_lora touches, no model
    object.__setattr__(layer, "_modules", {})
    layer.__dict__.update(lora_a_stacked=(torch.zeros(2, 1, RANK, HIDDEN),),
                          lora_b_stacked=(torch.zeros(2, 1, OUT, RANK),), output_slices=(OUT,), n_slices=1,
                          tp_size=1, tp_rank=0)
    wrapper, x = _wrapper([1, 1]), torch.randn(2, HIDDEN)

    def applied() -> torch.Tensor:
        y = torch.zeros(2, OUT)
        wrapper.add_lora_linear(y, x, layer.lora_a_stacked, layer.lora_b_stacked, 1.0, layer.output_slices)
        return y

    assert not applied().any()  # zero B: nothing
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        a, b = torch.randn(RANK, HIDDEN, generator=gen), torch.randn(OUT, RANK, generator=gen)
        BaseLinearLayerWithLoRA.set_lora(layer, 1, a, b)
        assert torch.allclose(applied(), x @ a.T @ b.T, atol=1e-4)
    BaseLinearLayerWithLoRA.reset_lora(layer, 1)
    assert not applied().any()


@pytest.mark.parametrize("prefill", [True, False])
@pytest.mark.parametrize("case", list(INDICES))
def test_update_metadata_sets_what_vllms_sets(case: str, prefill: bool) -> None:
    """The step's index buffers (token, sampler, padded sampler and embedding indices, their
    lengths, the prefill ops' runs) are vLLM's own, from a mapping whose prompts differ from its
    tokens; and a later mapping replaces them."""
    ours.install()
    slots = [10 + s for s in range(SLOTS)]
    slots[2] = None  # an empty slot between loaded ones
    ids = tuple(0 if i < 0 else 10 + (i if i != 2 else 1) for i in INDICES[case])
    prompts = ids[::2]
    for mapping in (LoRAMapping(ids, prompts, is_prefill=prefill), LoRAMapping(ids[:1], ids[:1], is_prefill=prefill)):
        got, want = (punica_cpu.PunicaWrapperCPU(64, 8, "cpu") for _ in range(2))
        for w in (got, want):  # the same stale contents in both
            for name in ("_token_lora_indices", "_sampler_indices", "_sampler_indices_padded", "_embeddings_indices",
                         "_seq_start_locs", "_seq_lengths", "_lora_indices_per_batch"):
                getattr(w, name).fill_(7)
        got.update_metadata(mapping, slots, SLOTS, 2048)
        ours._ORIGINAL["update_metadata"](want, mapping, slots, SLOTS, 2048)
        for name in ("_token_lora_indices", "_sampler_indices", "_sampler_indices_padded", "_embeddings_indices",
                     "indices_len", "is_prefill"):
            assert torch.equal(torch.as_tensor(getattr(got, name)), torch.as_tensor(getattr(want, name))), name
        if prefill:
            assert got.prefill_metadata[3:] == want.prefill_metadata[3:] and got.no_lora == want.no_lora
            for mine, theirs in zip(got.prefill_metadata[:3], want.prefill_metadata[:3], strict=True):
                assert torch.equal(mine, theirs)
        assert torch.equal(got.token_lora_indices, want.token_lora_indices)
        assert torch.equal(got.sampler_indices_padded, want.sampler_indices_padded)


def test_one_live_adapter_on_every_token_is_scaled_without_a_mask() -> None:
    """The fused path's shortcut: one slot holds weights and every token uses it (a project's
    production adapter alone): the product scaled, as with a mask, and no mask built."""
    ours.install()
    gen = torch.Generator().manual_seed(5)
    a = (torch.randn(SLOTS, 1, RANK, HIDDEN, generator=gen),)
    b = (torch.zeros(SLOTS, 1, OUT, RANK),)
    b[0][1] = torch.randn(1, OUT, RANK, generator=gen)
    x, y = torch.randn(3, HIDDEN, generator=gen), torch.randn(3, OUT, generator=gen)
    wrapper = _wrapper([1, 1, 1])
    got = y.clone()
    wrapper.add_lora_linear(got, x, a, b, 0.5, (OUT,))
    expected = y.double() + (x.double() @ a[0][1, 0].double().T * 0.5) @ b[0][1, 0].double().T
    assert torch.allclose(got.double(), expected, atol=1e-4) and not wrapper._flywheel_masks
