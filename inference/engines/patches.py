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



def patch_flat_sample_logprobs() -> None:
    """Fold a request's sampled-token log-probs into its flat container in one go (the frontend).

    vLLM's output processor folds an engine output's log-prob arrays in position by position
    (three `tolist` calls and an append each, about 3 µs). A request whose log-probs are held to
    its end (inference/vllm_scheduler.py) brings all of them at once: with 16 requests in flight
    on the tiny policy that loop cost the frontend 28 µs an engine step (bench/logprob_cost.py).
    Where the container is flat, no token is decoded and only the sampled token's log-prob is
    asked for (what Flywheel's engines ask), the same lists are extended at once: the same token
    ids, log-probs, ranks, empty texts, position bounds, and the cumulative log-prob summed in the
    same order. Anything else takes vLLM's loop.
    """
    from vllm.logprobs import FlatLogprobs
    from vllm.v1.engine.logprobs import LogprobsProcessor

    if getattr(LogprobsProcessor, "_flywheel_flat_patch", False):
        return
    original = LogprobsProcessor._update_sample_logprobs

    def _update_sample_logprobs(self: Any, lists: Any) -> None:
        flat = self.logprobs
        if (type(flat) is not FlatLogprobs or self.num_logprobs != 0 or self.tokenizer is not None
                or lists.cu_num_generated_tokens is not None or lists.logprobs.ndim != 2
                or lists.logprobs.shape[1] != 1):
            return original(self, lists)
        logprobs = lists.logprobs[:, 0].tolist()
        count, start = len(logprobs), len(flat.logprobs)
        flat.start_indices.extend(range(start, start + count))
        flat.end_indices.extend(range(start + 1, start + count + 1))
        flat.token_ids.extend(lists.logprob_token_ids[:, 0].tolist())
        flat.logprobs.extend(logprobs)
        flat.ranks.extend(lists.sampled_token_ranks.tolist())
        flat.decoded_tokens.extend([None] * count)
        total = self.cumulative_logprob
        for value in logprobs:
            total += value
        self.cumulative_logprob = total
        return None

    LogprobsProcessor._update_sample_logprobs = _update_sample_logprobs
    LogprobsProcessor._vllms_update_sample_logprobs = original
    LogprobsProcessor._flywheel_flat_patch = True
