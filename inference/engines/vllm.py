"""vLLM in-process (kind "vllm"): the uni executor, eager, sampled-token log-probs, in-place weight
reload, and LoRA adapters over the base (`enable_lora=True`: a PEFT adapter folder loads as a new
LoRARequest, never reusing a name). The request and answer translation here is shared with the
async engine (`vllm_async`)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from inference.engines.base import (
    Completion,
    Engine,
    FinishReason,
    SamplingParams,
    WeightsSource,
    read_state_dict,
    register_engine,
)
from inference.engines.patches import patch_cpu_moe_reload, patch_flat_sample_logprobs

# Loaded by vLLM in its own processes (by import path): the worker's sampled-token gather
# (inference/vllm_worker.py).
WORKER_EXTENSION = "inference.vllm_worker.SampledLogprobs"
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: a folder holding it is an adapter, loaded as a LoRA


def _set_vllm_env(kv_cache_gib: int) -> None:
    # In-process engine: starts in ~2 s instead of 20-40 s and lets us reach the model object.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")



@register_engine("vllm")
class VLLMEngine(Engine):
    """vLLM in-process (uni executor, eager), sampled-token log-probs, in-place weight reload.

    MoE routing: vLLM returns routed experts only with its Model Runner V2, which needs Triton
    and so is unavailable on CPU; here routing is None and the trainer recomputes it (or the
    torch engine's `score` does).
    """

    def __init__(
        self,
        model_dir: str | Path,
        version: int = 0,
        seed: int = 0,
        max_model_len: int = 512,
        kv_cache_gib: int = 1,
        dtype: str = "float32",
        logprobs_mode: str = "processed_logprobs",
        **llm_kwargs: Any,
    ) -> None:
        super().__init__(model_dir, version)
        _set_vllm_env(kv_cache_gib)
        from vllm import LLM

        patch_cpu_moe_reload()
        patch_flat_sample_logprobs()
        self.llm = LLM(
            model=str(model_dir), dtype=dtype, seed=seed, max_model_len=max_model_len,
            enforce_eager=True, distributed_executor_backend="uni",
            logprobs_mode=logprobs_mode, worker_extension_cls=WORKER_EXTENSION, **llm_kwargs,
        )
        self._tokenizer = self.llm.get_tokenizer()
        # LoRA (with enable_lora=True): the adapter served over the base weights, None: the base.
        # Every load gets a new name and id, never reused: vLLM keys its LoRA cache and the
        # prefix cache's blocks by them, so a reused id would serve the old adapter's weights or KV.
        self.lora: Any = None
        self._lora_ids = itertools.count(1)
        self.held_loras: dict[str, Any] = {}  # adapters held beside it by name (`adapter_add`)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams, lora: Any = None,
    ) -> list[Completion]:
        params = self._vllm_params(n, sampling)
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=lora or self.lora)
        completions = [c for i, out in enumerate(outputs) for c in self._completions(i, out)]
        if not params.detokenize:  # the text once per completion, as the torch engine decodes it
            for c in completions:
                c.text = self._tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return completions

    def _vllm_params(self, n: int, sampling: SamplingParams) -> Any:
        # Stop strings need vLLM's incremental detokenizer; without them its per-token work
        # (decoding every sampled token, and again for its log-prob entry) was a quarter of a CPU
        # generate, so the text is decoded once at the end instead (_generate).
        return vllm_params(n, sampling, lean_text=True)

    def _completions(self, index: int, out: Any) -> Iterator[Completion]:
        return vllm_completions(index, out, self.version)

    def _load_weights(self, source: WeightsSource) -> None:
        if not isinstance(source, Mapping) and (Path(source) / ADAPTER_CONFIG).is_file():
            self._load_adapter(Path(source))
            return
        if self.held_loras:
            raise ValueError(f"adapters {sorted(self.held_loras)} are held over these weights; unload them first")
        self._unload_adapter()  # new base weights: an adapter of the old ones means nothing over them
        state = read_state_dict(source)
        # reload_weights restores each layer's checkpoint-shaped params, loads, and re-runs
        # process_weights_after_loading, so CPU linear layers get fresh oneDNN handles and
        # (with patch_cpu_moe_reload) MoE experts are re-packed.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def _load_adapter(self, folder: Path) -> None:
        """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) over the base
        weights this engine holds, under a new name and id; the previous adapter is unloaded."""
        request = self._lora_request(folder)
        if not self.llm.llm_engine.add_lora(request):
            raise ValueError(f"vLLM refused the adapter in {folder}")
        previous, self.lora = self.lora, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)

    # --- several adapters held at once (inference/engines/adapters.py AdapterView) -----------------
    def adapter_add(self, folder: Path) -> str:
        with self._lock:
            request = self._lora_request(Path(folder))
            if not self.llm.llm_engine.add_lora(request):
                raise ValueError(f"vLLM refused the adapter in {folder}")
            self.held_loras[request.lora_name] = request
            return str(request.lora_name)

    def adapter_remove(self, name: str) -> None:
        with self._lock:
            request = self.held_loras.pop(name)
            self.llm.llm_engine.remove_lora(request.lora_int_id)

    def adapters_held(self) -> list[str]:
        return list(self.held_loras)

    def generate_on(self, adapter: str | None, prompts: Any, n: int = 1,
                    sampling: SamplingParams | None = None) -> list[Completion]:
        with self._lock:
            lora = self.held_loras[adapter] if adapter is not None else None
            return self._generate(self._encode(prompts), n, sampling or SamplingParams(), lora)

    def _lora_request(self, folder: Path) -> Any:
        from vllm.lora.request import LoRARequest

        if self.llm.llm_engine.vllm_config.lora_config is None:
            raise ValueError(f"{folder} is a LoRA adapter but this engine was started without LoRA; "
                             "start it with enable_lora=True (and max_lora_rank >= the adapter's rank), "
                             "or load the adapter merged into its base")
        lora_id = next(self._lora_ids)
        return LoRARequest(f"adapter-{lora_id}-{folder.name}", lora_id, str(folder))

    def _unload_adapter(self) -> None:
        if self.lora is not None:
            self.llm.llm_engine.remove_lora(self.lora.lora_int_id)
            self.lora = None

    def _close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del self.llm
        _destroy_vllm_distributed()



def vllm_params(n: int, sampling: SamplingParams, final_only: bool = False, lean_text: bool = False) -> Any:
    from vllm import SamplingParams as VParams
    from vllm.sampling_params import RequestOutputKind

    from inference.vllm_scheduler import HOLD_LOGPROBS

    # final_only (the async engine): the answer comes once, finished; without stop strings the
    # frontend skips per-step detokenisation (of the text and of every log-prob's token, the
    # behaviour log-probs being asked for every token) and the text is decoded once at the end.
    # lean_text (the offline engine): the same, the caller decoding the text once.
    lean = (final_only or lean_text) and not sampling.stop
    return VParams(
        n=n, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p, top_k=sampling.top_k if sampling.top_k > 0 else -1,
        seed=sampling.seed, stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        ignore_eos=sampling.ignore_eos, logprobs=0,  # 0: the sampled token's own log-prob
        output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE,
        detokenize=not lean, flat_logprobs=final_only,
        # Read once, at the end, and no stop string for this process to end it early: the engine
        # core sends its log-probs with its last token (inference/vllm_scheduler.py).
        extra_args={HOLD_LOGPROBS: True} if final_only and lean else None,
    )


def vllm_completions(index: int, out: Any, version: int, tokenizer: Any = None) -> Iterator[Completion]:
    """Completions of one vLLM RequestOutput; `tokenizer` decodes the text when vLLM did not."""
    for c in out.outputs:
        if hasattr(c.logprobs, "start_indices"):  # FlatLogprobs: the sampled token first at each position
            logprobs = [c.logprobs.logprobs[i] for i in c.logprobs.start_indices]
        else:
            logprobs = [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids, strict=True)]
        reason: FinishReason = "stop" if c.finish_reason == "stop" else "length"
        text = c.text if tokenizer is None else tokenizer.decode(c.token_ids, skip_special_tokens=True)
        yield Completion(
            index, list(out.prompt_token_ids), list(c.token_ids), logprobs, reason,
            text, version, None,
        )


def _destroy_vllm_distributed() -> None:
    # Lets a later VLLMEngine in the same process initialise its (gloo, world 1) group again.
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()

