"""Fixes to vLLM's own code, applied before an engine is built."""

from __future__ import annotations

from typing import Any


def patch_cpu_moe_reload() -> None:
    """Make in-place weight reloads re-pack CPU MoE expert weights.

    The trap: on a weight update vLLM's unquantized MoE method copies the *unpacked* new expert
    weights into the storage of the *prepacked* ones and skips the CPU experts' prepack (it keeps
    the storage for CUDA graphs), so the CPU grouped GEMM reads garbage-laid-out weights: no
    error, log-probs off by ~0.2. CPU has no CUDA graphs to protect, so on CPU every
    `_setup_kernel` call takes the first-load path (rebuild the kernel, prepack); the layerwise
    reloader then copies the packed tensors back into the original storage.
    """
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as m
    from vllm.platforms import current_platform

    cls = m.UnquantizedFusedMoEMethod
    if not current_platform.is_cpu() or getattr(cls, "_flywheel_reload_patch", False):
        return
    original = cls._setup_kernel

    def _setup_kernel(self: Any, *args: Any, **kwargs: Any) -> None:
        self.moe_kernel = None  # take the first-load path: prepack again
        original(self, *args, **kwargs)

    cls._setup_kernel = _setup_kernel
    cls._flywheel_reload_patch = True

