"""LoRA on vLLM's CPU engine without a weight copy per token: installed in each vLLM worker of a
Flywheel engine (inference/vllm_worker.py imports it).

vLLM's CPU punica ops (`vllm.lora.ops.torch_ops`) apply a batch's adapters by gathering every
token's adapter matrix (`weights[indices]`, a (tokens, rank, hidden) copy) and contracting it with
an einsum, on every LoRA layer of every engine step. A batch holds few adapters (a project's
production and its canary, a handful of projects), so the same products are one matrix product
per adapter in the batch over that adapter's tokens: no copy, a GEMM instead of a batched GEMV.
On the tiny policy, two adapters (production + a 10% canary) served 0.51x the tokens/s of one
merged model at 16 clients with vLLM's ops (bench/serving.py --adapters).

vLLM also wraps every linear layer of the model for LoRA (q/k/v, o, gate/up, down), whichever
modules the loaded adapters train, and runs the LoRA products on all of them every step: for an
adapter on q and v (PEFT's default), the o, gate/up and down layers add zeros. A layer whose
adapter slots all hold zero B matrices (`set_lora`/`reset_lora` say when that changes) returns
its base output unchanged (`_skip_idle_layers`): the same bits, since its LoRA term is x A^T 0.

The functions here are vLLM's `bgmv_shrink`, `bgmv_expand` and `bgmv_expand_slice`, output for
output (the same rows of the same adapter slots, a negative index meaning the last slot as
Python indexing has it, the same padding and `add_inputs` rules); the sums run in a different
order, so results agree within float rounding. A call whose shapes they do not cover goes to
vLLM's own. The `sgmv_*` (prefill) ops call these through the module they live in.
"""

from __future__ import annotations

from typing import Any

import torch

_ORIGINAL: dict[str, Any] = {}
# Below this many gathered weights (tokens x rank x hidden) vLLM's gather costs less than finding
# the adapters present. Measured on 2 cores, ours against vLLM's per call: 0.8-1.0x at 16-32 tokens
# of hidden 896 or 64 of hidden 128 (rank 8: 65-230k), 2.3-2.5x at 64 tokens of hidden 896 (460k),
# 2.8-4.5x at 128-256, 26-31x at 2,048 tokens with rank 16. So decode steps of a few sequences
# keep vLLM's ops and prefills take these.
MIN_GATHER = 300_000


def _products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(T, out): row t is weights[indices[t]] @ inputs[t], one matrix product per adapter present."""
    w = weights.squeeze(1) if weights.dim() == 4 else weights  # (slots, out, in)
    x = inputs.to(dtype)
    present = torch.unique(indices)
    if present.numel() == 1:
        return x @ w[int(present.item())].to(dtype).T
    out = x.new_empty((x.shape[0], w.shape[1]))
    for slot in present.tolist():
        rows = (indices == slot).nonzero(as_tuple=True)[0]
        out.index_copy_(0, rows, x.index_select(0, rows) @ w[slot].to(dtype).T)
    return out


def _theirs(name: str) -> Any:
    """vLLM's own op `name` (as installed over, or before any install)."""
    if name in _ORIGINAL:
        return _ORIGINAL[name]
    from vllm.lora.ops.torch_ops import lora_ops

    return getattr(lora_ops, name)


def _covered(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> bool:
    return (inputs.dim() == 2 and indices.dim() == 1 and inputs.shape[0] == indices.shape[0] > 0
            and weights.dim() in (3, 4) and (weights.dim() == 3 or weights.shape[1] == 1)
            and inputs.shape[0] * weights[0].numel() >= MIN_GATHER)


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    if not _covered(inputs, lora_b_weights, lora_indices_tensor):
        return _theirs("bgmv_shrink")(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    if not _covered(inputs, lora_b_weights, lora_indices_tensor):
        return _theirs("bgmv_expand")(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    if not _covered(inputs, lora_b_weights, lora_indices_tensor):
        return _theirs("bgmv_expand_slice")(inputs, lora_b_weights, output_tensor, lora_indices_tensor,
                                              slice_offset, slice_size, add_inputs)
    outputs = _products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


def _live(layer: Any) -> bool:
    """Whether any adapter slot of `layer` has a non-zero B (cached until set_lora/reset_lora)."""
    live = getattr(layer, "_flywheel_live", None)
    if live is None:
        live = layer._flywheel_live = any(bool(b.any()) for b in layer.lora_b_stacked)
    return bool(live)


def _marking(method: Any) -> Any:
    def changed(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            self._flywheel_live = None

    return changed


def _skip_idle_layers() -> None:
    """LoRA linear layers with no adapter weights skip the LoRA products (module docstring)."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.layers.row_parallel_linear import RowParallelLinearWithLoRA

    classes, todo = [], [BaseLinearLayerWithLoRA]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo += cls.__subclasses__()
    for cls in classes:
        for name in ("set_lora", "reset_lora"):
            if name in vars(cls):
                setattr(cls, name, _marking(vars(cls)[name]))
    to_output = BaseLinearLayerWithLoRA._apply_lora_to_output

    def _apply_lora_to_output(self: Any, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        return to_output(self, x, output) if _live(self) else output

    BaseLinearLayerWithLoRA._apply_lora_to_output = _apply_lora_to_output
    row_apply = RowParallelLinearWithLoRA.apply

    def apply(self: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.tp_size == 1 and not _live(self):  # its base output, as vLLM's apply starts
            return self._get_quant_method().apply(self.base_layer, x, bias)
        return row_apply(self, x, bias)

    RowParallelLinearWithLoRA.apply = apply


def install() -> None:
    """Put these ops where vLLM's CPU punica wrapper and its prefill ops look them up, and let
    idle LoRA layers skip (once)."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.platforms import current_platform

    if _ORIGINAL:
        return
    if current_platform.is_cpu():
        # CPU only: it decides in Python at every step, which a GPU's captured CUDA graphs would
        # not re-run (a graph captured with no adapter loaded would never apply one).
        _skip_idle_layers()
    for name, ours in (("bgmv_shrink", bgmv_shrink), ("bgmv_expand", bgmv_expand),
                       ("bgmv_expand_slice", bgmv_expand_slice)):
        _ORIGINAL[name] = getattr(lora_ops, name)
        setattr(lora_ops, name, ours)  # the sgmv_* (prefill) ops call these
        setattr(punica_cpu, name, ours)  # the decode steps and the logits call them directly
