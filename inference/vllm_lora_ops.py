"""LoRA on vLLM's CPU engine: tokens without an adapter get none, and no weight copy per token.
Installed in each vLLM worker of a Flywheel engine (inference/vllm_worker.py imports it).

**Tokens without an adapter.** vLLM marks a token of a request without an adapter (the base
model's, or another project's base on a shared engine) with the adapter index -1. Its GPU kernels
skip such tokens; its CPU punica ops (`vllm.lora.ops.torch_ops`) index the stacked weights with it
(`weights[indices]`), and -1 is the *last* adapter slot. A prefill step whose tokens all lack an
adapter returns early, so a base request served alone was right; batched with adapter requests it
was computed through the last slot's adapter (measured: 0.37 nats a token from the base, other
tokens). Here a negative index adds nothing, on every path: the linear layers, the logits, the
other `bgmv_*` callers.

**No weight copy per token.** vLLM's CPU ops gather every token's adapter matrix (a (tokens,
rank, hidden) copy) and contract it with an einsum, slice by slice (q, k and v are three), each
prefill op re-expanding the per-sequence indices to tokens first: about 45 tensor ops per LoRA
layer per engine step on the q/k/v layer, most of the cost of serving adapters on a small model.
`add_lora_linear` here runs three products a layer whatever the step's mix of adapters, for up to
`MAX_FUSED` adapters holding weights in the layer: every token through all of their A at once,
a mask (built once per step) keeping each token's own adapter's columns, and one expand over all
slices into the output. Past that (many projects on one engine) it groups the step's tokens by
adapter once per step and runs, per adapter present, one shrink product for all of a layer's
slices (their A stacked) and one expand product per slice whose B is not zero. The step's
`update_metadata` builds vLLM's index buffers from the mapping's Python lists in one pass. The `bgmv_*` ops take the same grouping per call for prefill-sized calls and keep
vLLM's gather for small ones (below `MIN_GATHER`).

vLLM also wraps every linear layer of the model for LoRA (q/k/v, o, gate/up, down), whichever
modules the loaded adapters train, and runs the LoRA products on all of them every step: for an
adapter on q and v (PEFT's default), the o, gate/up and down layers add zeros. A layer whose
adapter slots all hold zero B matrices (`set_lora`/`reset_lora` say when that changes) returns
its base output unchanged (`_skip_idle_layers`): the same bits, since its LoRA term is x A^T 0.

The results are vLLM's for every token with an adapter (the same rows of the same slots, the
same padding and `add_inputs` rules, the shrink in float32 as vLLM's buffer, the expand in the
output's dtype), the sums in another order, so within float rounding; zero for a token without.
A call whose shapes these do not cover goes to vLLM's own.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

_ORIGINAL: dict[str, Any] = {}
# Below this many gathered weights (tokens x rank x hidden) vLLM's gather costs less than finding
# the adapters present. Measured on 2 cores, ours against vLLM's per call: 0.8-1.0x at 16-32 tokens
# of hidden 896 or 64 of hidden 128 (rank 8: 65-230k), 2.3-2.5x at 64 tokens of hidden 896 (460k),
# 2.8-4.5x at 128-256, 26-31x at 2,048 tokens with rank 16. So decode steps of a few sequences
# keep vLLM's gather and prefills take these.
MIN_GATHER = 300_000

Groups = list[tuple[int, "torch.Tensor | None"]]


def groups_of(indices: torch.Tensor) -> Groups:
    """The adapter slots `indices` use, each with its rows (None: every row); negative indices
    (no adapter) are left out."""
    if indices.numel() == 0:
        return []
    lo, hi = int(indices.min()), int(indices.max())
    if lo == hi:
        return [] if lo < 0 else [(lo, None)]
    return [(slot, (indices == slot).nonzero(as_tuple=True)[0])
            for slot in torch.unique(indices).tolist() if slot >= 0]


def _slot(weights: torch.Tensor, slot: int) -> torch.Tensor:
    w = weights[slot]
    return w[0] if w.dim() == 3 else w  # (max_loras, 1, out, in) or (max_loras, out, in)


def _products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(T, out): row t is weights[indices[t]] @ inputs[t], zero where indices[t] < 0."""
    w = weights.squeeze(1) if weights.dim() == 4 else weights  # (slots, out, in)
    x = inputs.to(dtype)
    if inputs.shape[0] * w[0].numel() < MIN_GATHER:  # vLLM's gather, the no-adapter rows zeroed
        outputs = torch.einsum("bi, boi -> bo", x, w[indices.clamp(min=0)].to(dtype))
        return outputs.masked_fill_((indices < 0).unsqueeze(1), 0)
    groups = groups_of(indices)
    if len(groups) == 1 and groups[0][1] is None:
        return x @ w[groups[0][0]].to(dtype).T
    out = x.new_zeros((x.shape[0], w.shape[1]))
    for slot, rows in groups:
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
            and weights.dim() in (3, 4) and (weights.dim() == 3 or weights.shape[1] == 1))


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
            _GENERATION[0] += 1

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


def _step_groups(wrapper: Any, indices: torch.Tensor) -> Groups:
    """The step's tokens grouped by adapter, computed once per mapping (vLLM updates the wrapper's
    indices only in `update_metadata`, which drops this)."""
    groups = getattr(wrapper, "_flywheel_groups", None)
    if groups is None:
        groups = wrapper._flywheel_groups = groups_of(indices)
    return groups


def _step_slots(wrapper: Any, indices: torch.Tensor) -> tuple[tuple[int, ...], bool]:
    """The adapter slots the step's tokens use (sorted) and whether every token uses the same
    one: from the step's mapping as `update_metadata` read it in Python, without a tensor op;
    from the indices where the mapping was set some other way."""
    found = getattr(wrapper, "_flywheel_slots", None)
    if found is not None:
        return found
    groups = _step_groups(wrapper, indices)
    return tuple(slot for slot, _ in groups), len(groups) == 1 and groups[0][1] is None


# Bumped by every set_lora/reset_lora (the stacked weights changed): the plans below are rebuilt.
_GENERATION = [0]
# At most this many adapter slots holding weights in a layer are served by one fused product (every
# token through every live slot's A, a mask keeping its own); more go slot by slot, each product
# on its own tokens (many projects on one engine: a step holds a few of them).
MAX_FUSED = 4

# A layer's live slots (those with a non-zero B in some slice), then the fused weights over them:
# A stacked over (slot, live slice) in float32, (slots x width, hidden); B laid out as
# (all output columns, slots x width) in the output's dtype, zero outside each slice's own block;
# and the block width (live slices x rank). Or, past MAX_FUSED slots, per slot the unfused plan.
Fused = tuple[tuple[int, ...], "torch.Tensor | None", "torch.Tensor | None", int]
Plan = tuple["torch.Tensor | None", list[tuple[int, int, torch.Tensor, int]]]


def _cached(wrapper: Any, key: tuple, b_first: torch.Tensor, build: Any) -> Any:
    """`build()` kept per layer (`b_first`, the layer's first stacked B: its id is the key's first
    part) until the stacked weights change (a set_lora or reset_lora anywhere)."""
    plans = getattr(wrapper, "_flywheel_plans", None)
    if plans is None or plans[0] != _GENERATION[0]:
        plans = wrapper._flywheel_plans = (_GENERATION[0], {})
    found = plans[1].get(key)
    if found is not None and found[0] is b_first:
        return found[1]
    value = build()
    plans[1][key] = (b_first, value)  # the tensor kept: its id is not reused while cached
    return value


def _plan(wrapper: Any, a_stacked: tuple[torch.Tensor, ...], b_stacked: tuple[torch.Tensor, ...],
          sizes: tuple[int, ...], slot: int, dtype: torch.dtype) -> Plan:
    """One layer's adapter in `slot`: its live slices' A stacked (one shrink product for all of
    them, float32; None if no slice is live) and, for each slice whose B is not zero, (output
    column offset, columns, B in the output's dtype, its rows in the shrink's output); a q/v
    adapter's k slice drops out. Kept until the stacked weights change."""

    def build() -> Plan:
        live, offset = [], 0
        for i, (b, size) in enumerate(zip(b_stacked, sizes, strict=True)):
            weights = _slot(b, slot)
            if weights.any():
                live.append((i, offset, size, weights.to(dtype)))
            offset += size
        rank = a_stacked[0].shape[-2]
        stacked = torch.cat([_slot(a_stacked[i], slot).to(torch.float32) for i, *_ in live]) if live else None
        return stacked, [(off, size, b, k * rank) for k, (_, off, size, b) in enumerate(live)]

    return _cached(wrapper, (id(b_stacked[0]), slot, dtype), b_stacked[0], build)


def _fused(wrapper: Any, a_stacked: tuple[torch.Tensor, ...], b_stacked: tuple[torch.Tensor, ...],
           sizes: tuple[int, ...], dtype: torch.dtype) -> Fused:
    """One layer's fused weights over its live slots (`Fused`); (slots, None, None, 0) when there
    are more than MAX_FUSED of them or none."""

    def build() -> Fused:
        nonzero = [[bool(_slot(b, s).any()) for b in b_stacked] for s in range(b_stacked[0].shape[0])]
        slots = tuple(s for s, row in enumerate(nonzero) if any(row))
        live = [i for i in range(len(b_stacked)) if any(nonzero[s][i] for s in slots)]
        if not slots or len(slots) > MAX_FUSED:
            return slots, None, None, 0
        rank = a_stacked[0].shape[-2]
        width = len(live) * rank
        a = torch.cat([_slot(a_stacked[i], s).to(torch.float32) for s in slots for i in live])
        b = torch.zeros(sum(sizes), len(slots) * width, dtype=dtype)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        for k, s in enumerate(slots):
            for j, i in enumerate(live):
                column = k * width + j * rank
                b[starts[i] : starts[i] + sizes[i], column : column + rank] = _slot(b_stacked[i], s)
        return slots, a, b, width

    return _cached(wrapper, (id(b_stacked[0]), "fused", dtype), b_stacked[0], build)


def _step_mask(wrapper: Any, indices: torch.Tensor, slots: tuple[int, ...], width: int,
               scale: float) -> torch.Tensor:
    """(tokens, slots x width): `scale` where the column's slot is the token's adapter, else 0 (a
    token without one, or whose adapter has no weights in the layer, gets a row of zeros). Kept
    for the step (dropped with its grouping)."""
    masks = getattr(wrapper, "_flywheel_masks", None)
    if masks is None:
        masks = wrapper._flywheel_masks = {}
    key = (slots, width, scale)
    mask = masks.get(key)
    if mask is None:
        columns = torch.tensor(slots, dtype=indices.dtype).repeat_interleave(width)
        mask = masks[key] = (indices.unsqueeze(1) == columns.unsqueeze(0)).to(torch.float32)
        if scale != 1.0:
            mask.mul_(scale)
    return mask


def add_lora_linear(self: Any, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                    lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...],
                    *, buffer: Any = None, **kwargs: Any) -> None:
    """vLLM's CPU `add_lora_linear` (y[t, slice i] += (x[t] A_i^T * scale) B_i^T with the token's
    adapter). Up to MAX_FUSED live slots, three products whatever the adapters and slices: every
    token through all live slots' A at once, a mask keeping each token's own (and `scale`), and one
    expand over all slices into y. Past that, grouped by adapter: per adapter present, one shrink
    product for all slices and one expand product per slice with a non-zero B."""
    indices = self.token_lora_indices
    x2, y2 = x.view(-1, x.shape[-1]), y.view(-1, y.shape[-1])
    if (buffer is not None or kwargs or x2.shape[0] != indices.shape[0] or y2.shape[0] != x2.shape[0]
            or any(b.shape[-2] != size for b, size in zip(lora_b_stacked, output_slices, strict=True))
            or len({a.shape[-2] for a in lora_a_stacked}) != 1):
        return _ORIGINAL["add_lora_linear"](self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices,
                                            buffer=buffer, **kwargs)
    present, uniform = _step_slots(self, indices)
    if not present:
        return None
    xf = x2.to(torch.float32)  # vLLM's shrink writes a float32 buffer
    slots, a, b, width = _fused(self, lora_a_stacked, lora_b_stacked, output_slices, y2.dtype)
    if not slots:
        return None
    if a is not None:
        shrunk = xf @ a.T
        if uniform and present == slots:  # every token through the one live slot
            if scale != 1.0:
                shrunk.mul_(scale)
        else:
            shrunk.mul_(_step_mask(self, indices, slots, width, scale))
        y2.addmm_(shrunk.to(y2.dtype), b.T)
        return None
    rank = lora_a_stacked[0].shape[-2]
    for slot, rows in _step_groups(self, indices):
        stacked, slices = _plan(self, lora_a_stacked, lora_b_stacked, output_slices, slot, y2.dtype)
        if stacked is None:
            continue
        shrunk = (xf if rows is None else xf.index_select(0, rows)) @ stacked.T
        if scale != 1.0:
            shrunk = shrunk * scale
        shrunk = shrunk.to(y2.dtype)
        for offset, size, b_, column in slices:
            term = shrunk[:, column : column + rank] @ b_.T
            target = y2[:, offset : offset + size]
            if rows is None:
                target += term
            else:
                target.index_add_(0, rows, term)
    return None


def update_metadata(self: Any, mapping: Any, lora_index_to_id: list[int | None], max_loras: int, vocab_size: int,
                    **kwargs: Any) -> None:
    """vLLM's CPU punica wrapper's `update_metadata`, run at every step whose adapter mapping
    changed: the same index buffers (token and sampler slots, -1 without an adapter; the padded
    sampler rows; the embedding offsets; the prefill ops' runs of equal slots), from Python lists
    in one pass instead of vLLM's three list copies and a dozen small tensor ops per step. The
    step's grouping and masks above are dropped (the token indices may have changed)."""
    self._flywheel_groups = self._flywheel_masks = None
    slot_of = {lora_id: i for i, lora_id in enumerate(lora_index_to_id) if lora_id is not None}
    tokens = [slot_of[x] if x > 0 else -1 for x in mapping.index_mapping]
    used = set(tokens)
    self._flywheel_slots = (tuple(sorted(slot for slot in used if slot >= 0)), len(used) == 1)
    prompts = [slot_of[x] if x > 0 else -1 for x in mapping.prompt_mapping]
    n, m = len(tokens), len(prompts)
    token_slots = torch.tensor(tokens, dtype=torch.long)
    prompt_slots = torch.tensor(prompts, dtype=torch.long)
    self._token_lora_indices[:n] = token_slots
    self._embeddings_indices[:n] = token_slots.clamp(min=0) * vocab_size
    self._sampler_indices[:m] = prompt_slots
    # a prompt without an adapter reads the last slot's row of the padded logits (vLLM's rule)
    self._sampler_indices_padded[:m] = torch.arange(m) + prompt_slots.where(prompt_slots != -1, max_loras - 1) * m
    self.indices_len[:] = [n, m, m, n]
    self.is_prefill = bool(mapping.is_prefill)
    if self.is_prefill:  # runs of tokens with the same slot, as vLLM's compute_meta
        values, lengths = [], []
        for value, run in itertools.groupby(tokens):
            values.append(value)
            lengths.append(sum(1 for _ in run))
        starts = list(itertools.accumulate(lengths[:-1], initial=0))
        k = len(values)
        self._seq_start_locs[:k] = torch.tensor(starts, dtype=torch.long)
        self._seq_lengths[:k] = torch.tensor(lengths, dtype=torch.long)
        self._lora_indices_per_batch[:k] = torch.tensor(values, dtype=torch.long)
        self.batch_size, self.max_length, self.token_nums = k, max(lengths, default=0), n
        self.no_lora = k == 1 and values[0] == -1


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
        wrapper = punica_cpu.PunicaWrapperCPU
        _ORIGINAL["add_lora_linear"] = wrapper.add_lora_linear
        wrapper.add_lora_linear = add_lora_linear
        _ORIGINAL["update_metadata"] = wrapper.update_metadata
        wrapper.update_metadata = update_metadata
    for name, ours in (("bgmv_shrink", bgmv_shrink), ("bgmv_expand", bgmv_expand),
                       ("bgmv_expand_slice", bgmv_expand_slice)):
        _ORIGINAL[name] = getattr(lora_ops, name)
        setattr(lora_ops, name, ours)  # the sgmv_* (prefill) ops call these
        setattr(punica_cpu, name, ours)  # the decode steps and the logits call them directly
