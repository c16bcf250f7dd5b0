"""The torch reference engine (kind "torch"): HF transformers, batched KV-cached sampling, fp32
log-probs recomputed batch-invariantly, so they match the trainer's forward bit for bit."""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from inference.decoder import Decoder, dense_decoder
from inference.engines.base import (
    Completion,
    Engine,
    FinishReason,
    SamplingParams,
    WeightsSource,
    read_state_dict,
    register_engine,
)
from kernels.batch_invariant import batch_invariant_mode
from kernels.routing import capture_routing, moe_routers

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
        self._peft: Any = None  # a PeftModel over self.model once an adapter is held
        self._held: list[str] = []
        self._adapter_ids = itertools.count(1)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    # --- LoRA adapters: PEFT's named adapters over the one model, the request's made active ---------
    def adapter_add(self, folder: Path) -> str:
        """The PEFT adapter in `folder` as one more named adapter of the model (PEFT injects its
        LoRA layers once; each adapter's A and B live beside the others); the trainer's forward
        of a LoRA run is this one, so the log-probs are the trainer's."""
        from peft import PeftModel

        with self._lock:
            name = f"adapter-{next(self._adapter_ids)}-{Path(folder).name}"
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(self.model, str(folder), adapter_name=name)
            else:
                self._peft.load_adapter(str(folder), adapter_name=name)
            self.model.eval()
            self._held.append(name)
            return name

    def adapter_remove(self, name: str) -> None:
        with self._lock:
            self._held.remove(name)
            assert self._peft is not None
            if self._held:
                self._peft.set_adapter(self._held[0])  # PEFT deletes only an inactive adapter cleanly
                self._peft.delete_adapter(name)
            else:  # the last one: the plain layers back (PEFT's unload keeps the base weights)
                self._peft.unload()
                self._peft = None

    def adapters_held(self) -> list[str]:
        return list(self._held)

    def generate_on(self, adapter: str | None, prompts: Any, n: int = 1,
                    sampling: SamplingParams | None = None) -> list[Completion]:
        with self._lock:
            if self._peft is None:
                if adapter is not None:
                    raise KeyError(adapter)
                return self._generate(self._encode(prompts), n, sampling or SamplingParams())
            if adapter is None:
                with self._peft.disable_adapter():
                    return self._generate(self._encode(prompts), n, sampling or SamplingParams())
            if adapter not in self._held:
                raise KeyError(adapter)
            self._peft.set_adapter(adapter)
            return self._generate(self._encode(prompts), n, sampling or SamplingParams())

    def generate(self, prompts: Any, n: int = 1, sampling: SamplingParams | None = None) -> list[Completion]:
        return self.generate_on(None, prompts, n, sampling)

    def _load_weights(self, source: WeightsSource) -> None:
        if self._held:
            raise ValueError(f"adapters {self._held} are held over these weights; unload them first")
        state = read_state_dict(source)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if "rotary" not in k and not self._tied_to(k, state)]
        if unexpected or missing:
            raise ValueError(f"weights do not fit the model: {missing=} {unexpected=}")

    def _tied_to(self, name: str, state: Mapping[str, torch.Tensor]) -> bool:
        """Whether parameter `name` is the same tensor as one `state` loaded (a tied LM head:
        Qwen2-0.5B's and most small models' folders hold only the embedding, as transformers saves
        them), so loading that one loaded it."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        if name not in params:
            return False
        ptr = params[name].data_ptr()
        return any(k in params and params[k].data_ptr() == ptr for k in state if k != name)

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
        if self._peft is not None:  # the fused matrices would leave the adapters' layers out
            return None
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

