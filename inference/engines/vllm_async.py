"""vLLM's AsyncLLM (kind "vllm-async", what the serving process runs): concurrent requests share
the engine core's batches, and a weight swap is made between them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from inference.engines.affinity import enabled as pin_enabled
from inference.engines.affinity import pin_off_worker, unbind_thread
from inference.engines.base import (
    Completion,
    Engine,
    Prompts,
    SamplingParams,
    WeightsSource,
    new_event_loop,
    register_engine,
)
from inference.engines.patches import patch_flat_sample_logprobs
from inference.engines.vllm import ADAPTER_CONFIG, WORKER_EXTENSION, vllm_completions, vllm_params

# Loaded by vLLM in the engine core's process (by import path): inference/vllm_scheduler.py.
SCHEDULER = "inference.vllm_scheduler.HeldLogprobsScheduler"


def _scheduler() -> dict[str, str]:
    """The async engine's scheduler: ours where vLLM runs its synchronous one (CPU). Elsewhere vLLM
    picks an asynchronous scheduler, which a custom class would turn off: its default stays."""
    from vllm.platforms import current_platform

    return {"scheduler_cls": SCHEDULER} if current_platform.is_cpu() else {}


@register_engine("vllm-async")
class AsyncVLLMEngine(Engine):
    """vLLM's AsyncLLM (the engine `vllm serve` runs): the engine core steps in its own process
    and batches every request in flight continuously, so concurrent `agenerate` calls share
    batches. Callable from any thread or event loop: AsyncLLM lives on this engine's own loop
    (a daemon thread), which also turns engine outputs into answers.

    A swap is made between batches: `load_weights` holds new requests back, waits until the
    requests in flight have finished (on the old weights), reloads, then lets the held ones in.
    So every request runs on one version from its first token to its last, and
    `Completion.version` is the version it was admitted under. `close` drains the same way.

    Batching is observable engine-side: each engine step's running requests are observed into
    `inference.metrics.SERVING_BATCH` (and `peak_batch`), from vLLM's scheduler stats.
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
        drain_timeout_s: float = 300.0,
        **engine_kwargs: Any,
    ) -> None:
        super().__init__(model_dir, version)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.drain_timeout_s = drain_timeout_s
        self.peak_batch = 0
        self.pinned: set[int] = set()  # the cores its scheduler and loop thread were bound to (`_pin`)
        pin_enabled()  # a bad FLYWHEEL_ENGINE_PIN is refused before any process starts
        self._in_flight, self._swapping, self._closed = 0, False, False
        # LoRA (enable_lora=True): the adapter served over the base, None: the base. A new name
        # and id per load, never reused (vLLM keys its adapter and prefix caches by them).
        self.lora: Any = None
        self._lora_ids = itertools.count(1)
        self.held_loras: dict[str, Any] = {}  # adapters held beside it by name (`adapter_add`)
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-async-engine", daemon=True)
        self._thread.start()
        settings = dict(model=str(model_dir), dtype=dtype, seed=seed, max_model_len=max_model_len,
                        enforce_eager=True, logprobs_mode=logprobs_mode, disable_log_stats=True,
                        worker_extension_cls=WORKER_EXTENSION, **_scheduler(), **engine_kwargs)
        try:
            with _multiprocessing_on():
                self.llm = self._call(self._start(settings))
        except BaseException:
            self._stop_loop()
            raise
        self._tokenizer = self.llm.get_tokenizer()

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    # --- the engine loop ----------------------------------------------------------------------
    def home_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a blocking engine call on the engine's own loop would wait for itself; "
                               "await the engine's async methods there (agenerate, agenerate_on)")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _on_loop(self, coro: Any) -> Any:
        """`coro` run on the engine's loop: awaited in place when the caller is on it already
        (a server whose listeners run there), else handed over to it."""
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def _start(self, settings: dict[str, Any]) -> Any:
        # Built on this loop so that AsyncLLM's output handler runs here.
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        patch_flat_sample_logprobs()  # the output processor runs in this process
        unbind_thread()  # its processes start on the process's cores, whichever thread built it

        self._cond = asyncio.Condition()
        # No local holds the AsyncLLM: an import above leaves this frame referenced by a kept
        # traceback, and a local of it would outlive close() until the interpreter's exit, where
        # vLLM's __del__ fails.
        return self._pin(AsyncLLM.from_engine_args(AsyncEngineArgs(**settings), stat_loggers=[_batch_logger(self)]))

    def _pin(self, llm: Any) -> Any:
        """On CPU, `llm`'s engine core and this (the engine's loop) thread off its worker's cores
        (inference/engines/affinity.py), the cores kept in `pinned`; `llm` returned."""
        from vllm.platforms import current_platform

        manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None), "engine_manager", None)
        processes = getattr(manager, "processes", None)
        if current_platform.is_cpu() and processes:
            self.pinned = pin_off_worker([p.pid for p in processes])
        return llm

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    # --- generation ---------------------------------------------------------------------------
    def generate(
        self, prompts: Prompts, n: int = 1, sampling: SamplingParams | None = None
    ) -> list[Completion]:
        return self._call(self._run(self._encode(prompts), n, sampling or SamplingParams()))

    async def agenerate(
        self, prompts: Prompts, n: int = 1, sampling: SamplingParams | None = None
    ) -> list[Completion]:
        return await self._on_loop(self._run(self._encode(prompts), n, sampling or SamplingParams()))

    def generate_on(self, adapter: str | None, prompts: Prompts, n: int = 1,
                    sampling: SamplingParams | None = None) -> list[Completion]:
        return self._call(self._run(self._encode(prompts), n, sampling or SamplingParams(), adapter))

    async def agenerate_on(self, adapter: str | None, prompts: Prompts, n: int = 1,
                           sampling: SamplingParams | None = None) -> list[Completion]:
        return await self._on_loop(self._run(self._encode(prompts), n, sampling or SamplingParams(), adapter))

    # --- several adapters held at once (inference/engines/adapters.py AdapterView) -----------------
    def adapter_add(self, folder: Path) -> str:
        with self._lock:
            request = self._lora_request(Path(folder))
            if not self._call(self.llm.add_lora(request)):
                raise ValueError(f"vLLM refused the adapter in {folder}")
            self.held_loras[request.lora_name] = request
            return str(request.lora_name)

    def adapter_remove(self, name: str) -> None:
        with self._lock:
            request = self.held_loras.pop(name)
            self._call(self.llm.remove_lora(request.lora_int_id))

    def adapters_held(self) -> list[str]:
        return list(self.held_loras)

    def _lora_request(self, folder: Path) -> Any:
        from vllm.lora.request import LoRARequest

        if self.llm.vllm_config.lora_config is None:
            raise ValueError(f"{folder} is a LoRA adapter but this engine was started without LoRA; "
                             "start it with enable_lora=True (and max_lora_rank >= the adapter's rank), "
                             "or load the adapter merged into its base")
        lora_id = next(self._lora_ids)
        return LoRARequest(f"adapter-{lora_id}-{folder.name}", lora_id, str(folder))

    def _generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[Completion]:
        return self._call(self._run(prompts, n, sampling))

    async def _run(self, prompts: list[list[int]], n: int, sampling: SamplingParams,
                   adapter: str | None = None) -> list[Completion]:
        version = await self._admit()
        # Fixed for the call: a swap waits for it (the swap gate); a held adapter is removed only
        # once no call uses it (inference/engines/adapters.py AdapterView).
        lora = self.held_loras[adapter] if adapter is not None else self.lora
        try:
            params = vllm_params(n, sampling, final_only=True)
            outs = await asyncio.gather(*(self._one(p, params, lora) for p in prompts))
        finally:
            await self._release()
        decoder = None if params.detokenize else self._tokenizer
        return [c for i, out in enumerate(outs) for c in vllm_completions(i, out, version, decoder)]

    async def _one(self, prompt: list[int], params: Any, lora: Any = None) -> Any:
        final = None
        async for out in self.llm.generate({"prompt_token_ids": prompt}, params, uuid.uuid4().hex, lora_request=lora):
            final = out
        return final

    # --- the swap gate (all on the engine loop) -------------------------------------------------
    async def _admit(self) -> int:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            if self._closed:
                raise RuntimeError("this engine was closed")
            self._in_flight += 1
            return self._version

    async def _release(self) -> None:
        async with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    async def _drained(self) -> None:
        """Holds new requests back (they wait in `_admit`) until the ones in flight are done."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._swapping = True
            await asyncio.wait_for(self._cond.wait_for(lambda: self._in_flight == 0), self.drain_timeout_s)

    async def _reopen(self) -> None:
        async with self._cond:
            self._swapping = False
            self._cond.notify_all()

    # --- weights ------------------------------------------------------------------------------
    def load_weights(self, source: WeightsSource, version: int) -> None:
        # The engine core (another process) reads the weights from a folder: tensors sent over
        # its RPC arrive as nested lists. A state dict is written to a temporary folder first,
        # before requests are held back.
        with contextlib.ExitStack() as stack:
            if isinstance(source, Mapping):
                folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="flywheel-swap-")))
                _save_safetensors(source, folder / "model.safetensors")
                source = folder
            with self._lock:
                self._call(self._swap(str(source), version))

    async def _swap(self, folder: str, version: int) -> None:
        try:
            await self._drained()
            if (Path(folder) / ADAPTER_CONFIG).is_file():
                await self._swap_adapter(Path(folder))
            else:
                if self.held_loras:
                    raise ValueError(f"adapters {sorted(self.held_loras)} are held over these weights; "
                                     "unload them first")
                if self.lora is not None:  # new base weights: an adapter of the old ones means nothing
                    await self.llm.remove_lora(self.lora.lora_int_id)
                    self.lora = None
                # Same in-place reload as VLLMEngine (re-runs process_weights_after_loading).
                await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
                await self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
            self._version = version
        finally:
            await self._reopen()

    async def _swap_adapter(self, folder: Path) -> None:
        """A PEFT adapter folder over the base this engine holds, as a new LoRA (requests held
        back meanwhile); the previous adapter unloaded once nothing uses it."""
        request = self._lora_request(folder)
        if not await self.llm.add_lora(request):
            raise ValueError(f"vLLM refused the adapter in {folder}")
        previous, self.lora = self.lora, request
        if previous is not None:
            await self.llm.remove_lora(previous.lora_int_id)

    def _load_weights(self, source: WeightsSource) -> None:  # load_weights is overridden
        raise NotImplementedError

    def close(self) -> None:
        with self._lock:
            if getattr(self, "llm", None) is None:
                return
            with contextlib.suppress(Exception):
                self._call(self._close_gate())
            with contextlib.suppress(Exception):
                self._call(self._stop_output_handler(), timeout=30)
            self.llm.shutdown()
            self.llm = None
            self._stop_loop()

    async def _stop_output_handler(self) -> None:
        """AsyncLLM's output handler cancelled before its engine core stops: vLLM's `shutdown`
        stops the core first, and the handler, still reading from it, logged an EngineDeadError at
        every close."""
        handler = getattr(self.llm, "output_handler", None)
        if handler is not None and not handler.done():
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)

    async def _close_gate(self) -> None:
        try:
            await self._drained()
        finally:
            self._closed = True
            await self._reopen()



# vLLM's CPU guide: preload tcmalloc in the engine's processes (vLLM warns at start-up without it).
# glibc's malloc maps and unmaps each allocation of 128 KiB or more afresh, so an engine step's
# activations and sampler tensors fault in new pages every step; measured with
# bench/logprob_cost.py at 16 requests in flight: 3.21 -> 2.49 and 3.72 -> 2.78 CPU ms a step.
TCMALLOC = ("tcmalloc_minimal", "tcmalloc")  # Debian's libtcmalloc-minimal4, then gperftools' full one


def engine_preload() -> str | None:
    """The allocator to preload in the engine's processes: FLYWHEEL_ENGINE_PRELOAD ("off" for
    none, or a library path), else the first tcmalloc the dynamic linker knows (`ldconfig`, as
    `make malloc` checks), else None (glibc's malloc)."""
    from ctypes.util import find_library

    chosen = os.environ.get("FLYWHEEL_ENGINE_PRELOAD", "").strip()
    if chosen.lower() == "off":
        return None
    if chosen:
        if not Path(chosen).is_file():
            raise ValueError(f"FLYWHEEL_ENGINE_PRELOAD={chosen!r} is not a file; set the path of a malloc "
                             "library (e.g. libtcmalloc_minimal.so.4), or 'off' for glibc's malloc")
        return chosen
    return next((found for name in TCMALLOC if (found := find_library(name))), None)


@contextlib.contextmanager
def _multiprocessing_on() -> Iterator[None]:
    # On CPU, vLLM sets up OpenMP (bound threads, a core left to the frontend) only in its
    # multiprocess executor, as `vllm serve` runs it; with VLLMEngine's
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine core runs the model itself without that set-up,
    # and here stepped 3-5x slower. The flag is read while the engine is built and inherited by
    # its processes; restored afterwards for in-process engines. The allocator preload
    # (`engine_preload`) is inherited by the engine's processes the same way, and this process
    # keeps its own.
    saved = {name: os.environ.get(name) for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "LD_PRELOAD")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    preload = engine_preload()
    if preload and preload not in (saved["LD_PRELOAD"] or ""):
        os.environ["LD_PRELOAD"] = " ".join(p for p in (preload, saved["LD_PRELOAD"]) if p)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _save_safetensors(state: Mapping[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    # Copies: safetensors refuses tensors that share storage (tied embeddings) or are strided.
    save_file({name: t.detach().contiguous().clone() for name, t in state.items()}, str(path))


def _batch_logger(engine: AsyncVLLMEngine) -> Callable[..., Any]:
    """A vLLM stat-logger factory that observes each engine step's running requests."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    from inference import metrics

    class BatchLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is None or not scheduler_stats.num_running_reqs:
                return
            running = scheduler_stats.num_running_reqs
            metrics.SERVING_BATCH.observe(running)
            engine.peak_batch = max(engine.peak_batch, running)

        def log_engine_initialized(self) -> None:
            pass

    return BatchLogger

