"""A run's compute precision in torch: what "auto" resolves to on this hardware, the autocast
context an update runs under, and the dtype a candidate's weights are saved (served, delta'd) in.

Mixed precision as TRL, prime-rl and torchtitan run it: the weights and AdamW's moments stay
float32 (the master copy: an update smaller than half a bf16 ulp still accumulates), the forward
and backward run under `torch.autocast(bfloat16)` (matmuls in bf16, reductions such as log-softmax
in float32), and the weights leave the run cast to bf16. A small update leaves most bf16 values
unchanged, so a version's delta against its bf16 parent is small (bench/delta.py).

    .venv/bin/python -m pytest tests/training/rl/test_precision.py -q -p no:django
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager

import torch

from training.rl.config import precision_value

SERVING_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bf16_native(device: str | torch.device = "cpu") -> bool:
    """Whether `device` computes bf16 in hardware: a CPU with AVX-512 BF16 or AMX tiles (oneDNN's
    bf16 GEMMs; without them bf16 is emulated, slower than float32), a CUDA GPU of compute
    capability >= 8 (Ampere on)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if kind != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_precision(precision: str | None, device: str | torch.device = "cpu") -> str:
    """"fp32" or "bf16": the setting itself, or for "auto" bf16 where `device` has it natively."""
    value = precision_value(precision)
    if value == "auto":
        return "bf16" if bf16_native(device) else "fp32"
    return value


def serving_dtype(precision: str | None, device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype a run's candidate is served in, so the dtype its own rollouts sample in: a bf16
    run samples from bf16 weights (the served model's numerics, and bf16 matmuls), fp32 otherwise."""
    return SERVING_DTYPES[resolve_precision(precision, device)]


def compute_context(precision: str, device: str | torch.device = "cpu") -> AbstractContextManager[None]:
    """The context a forward and backward run in: bf16 autocast for "bf16", nothing for "fp32"."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16")


def serving_state_dict(state: Mapping[str, torch.Tensor], precision: str) -> dict[str, torch.Tensor]:
    """A copy of `state` with its floating tensors in the serving dtype (bf16 for a bf16 run); the
    master weights are left as they are (and later steps do not change the copy)."""
    dtype = SERVING_DTYPES[precision]
    return {k: v.detach().to(dtype if v.is_floating_point() else v.dtype, copy=True) for k, v in state.items()}
