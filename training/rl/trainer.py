"""One off-policy RL update on a causal LM: samples -> padded batch -> loss -> optimiser step.

Pure torch; a Django service loads the model and samples, calls `prepare_batch` and `rl_step`,
and writes the returned `StepMetrics` into a `TrainingStep` row.

    .venv/bin/python -m pytest tests/training/rl/test_trainer.py -q -p no:django
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

import torch
from torch import nn

from kernels.batch_invariant import batch_invariant_mode
from kernels.logprobs import selective_log_softmax
from kernels.routing import ReplayStats, batch_routing_to_flat, replay_routing
from training.rl.advantages import RunningBaseline, group_baselines
from training.rl.config import RLConfig
from training.rl.loss import LossInputs, LossOutputs, policy_loss


@dataclass
class Sample:
    """One completion as the trainer needs it; per-token lists are over completion tokens."""

    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float = 0.0
    behaviour_logprobs: list[float] | None = None  # log mu per completion token, from inference
    policy_version: int | None = None  # version that sampled it; None: unknown, never stale
    group: str | int | None = None  # samples of one prompt share a group (group-relative advantage)
    task: str = "default"  # running-baseline bucket for samples without a group
    advantage: float | None = None  # precomputed advantage wins over both rules above
    routing: torch.Tensor | None = None  # (L, T_i, k) recorded expert ids over prompt+completion
    # Agent trajectories: one Sample per trained turn. Turns of one episode share its baseline,
    # compared on the episode's return (its first turn's reward-to-go), counted once.
    episode: str | None = None
    episode_return: float | None = None  # None: `reward`
    turn: int = 0  # index among the episode's trained turns
    retokenised: bool = False  # completion rendered from text by the chat template: mu unknowable


@dataclass
class Batch:
    """Right-padded tensors; per-token entries are aligned with `input_ids` (entry t is token t)."""

    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long
    completion_mask: torch.Tensor  # (B, T) bool, True on completion tokens
    behaviour_logprobs: torch.Tensor  # (B, T) float, 0 where unknown
    behaviour_mask: torch.Tensor  # (B, T) bool, True where log mu is known
    advantages: torch.Tensor  # (B,)
    rewards: torch.Tensor  # (B,)
    routing: torch.Tensor | None = None  # (B, L, T, k), -1 where not recorded
    old_logprobs: torch.Tensor | None = None  # (B, T) pi_old; None: this step's pre-update forward
    # (B,) bool: sampled by the weights pi_old is (served by the current version, or by the run);
    # the others measure staleness, not engine mismatch. None: every row.
    same_weights: torch.Tensor | None = None
    dropped_stale: int = 0

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], pad_id: int, advantages: torch.Tensor) -> Batch:
        width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
        rows = [_pack_row(s, width, pad_id) for s in samples]
        stacked = {k: torch.stack([r[k] for r in rows]) for k in rows[0] if k != "routing"}
        return cls(
            **stacked,
            advantages=advantages.to(torch.float32),
            rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
            routing=_pack_routing(samples, width),
        )

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def micro_batches(self, size: int) -> Iterator[Batch]:
        for start in range(0, self.size, size):
            yield self.rows(slice(start, start + size))

    def rows(self, index: slice | torch.Tensor) -> Batch:
        def cut(x: Any) -> Any:
            return x[index] if isinstance(x, torch.Tensor) else x

        return replace(self, **{f: cut(getattr(self, f)) for f in self.__dataclass_fields__})


def _pack_row(s: Sample, width: int, pad_id: int) -> dict[str, torch.Tensor]:
    n_p, n_c = len(s.prompt_ids), len(s.completion_ids)
    if n_p < 1 or n_c < 1:
        raise ValueError("a sample needs at least one prompt token and one completion token")
    ids = torch.full((width,), pad_id, dtype=torch.long)
    ids[: n_p + n_c] = torch.tensor(s.prompt_ids + s.completion_ids)
    span = torch.zeros(width, dtype=torch.bool)
    span[n_p : n_p + n_c] = True
    mu = torch.zeros(width, dtype=torch.float32)
    known = torch.zeros(width, dtype=torch.bool)
    if s.behaviour_logprobs is not None:
        if len(s.behaviour_logprobs) != n_c:
            raise ValueError(f"{len(s.behaviour_logprobs)} behaviour log-probs for {n_c} completion tokens")
        mu[n_p : n_p + n_c] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        known = span.clone()
    attn = (torch.arange(width) < n_p + n_c).long()
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": span,
            "behaviour_logprobs": mu, "behaviour_mask": known}


def _pack_routing(samples: Sequence[Sample], width: int) -> torch.Tensor | None:
    if all(s.routing is None for s in samples):
        return None
    shape = next(s.routing.shape for s in samples if s.routing is not None)
    out = torch.full((len(samples), shape[0], width, shape[2]), -1, dtype=torch.long)  # (B, L, T, k)
    for i, s in enumerate(samples):
        if s.routing is not None:
            out[i, :, : s.routing.shape[1]] = s.routing
    return out


# ---------------------------------------------------------------------------------- selection

S = TypeVar("S")


class NoFreshSamples(ValueError):
    """Every sample was stale (or none came); `dropped` says how many were thrown away."""

    def __init__(self, dropped: int) -> None:
        super().__init__(f"no samples within the staleness bound ({dropped} dropped as stale)")
        self.dropped = dropped


def _version(sample: Any) -> int | None:
    return sample.get("policy_version") if isinstance(sample, Mapping) else sample.policy_version


def filter_stale(samples: Sequence[S], current_version: int, max_staleness: int) -> tuple[list[S], int]:
    """Keep samples at most K versions behind `current_version`; return (kept, dropped count)."""
    kept = [s for s in samples if _version(s) is None or current_version - _version(s) <= max_staleness]
    return kept, len(samples) - len(kept)


def compute_advantages(
    samples: Sequence[Sample], cfg: RLConfig, baseline: RunningBaseline | None = None
) -> torch.Tensor:
    """(B,): a given advantage, else group-relative within `group`, else reward - running baseline.

    The unit a group or the running baseline compares is the episode (one per sample when
    `episode` is None): its return counts once however many turns it has, and each turn's
    advantage is its own reward-to-go against the episode's baseline, A_k = (R_k - b) / scale."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)  # (B,)
    out = rewards.clone()
    unit, returns = _episodes(samples)
    r64 = rewards.to(torch.float64)
    grouped = [i for i, s in enumerate(samples) if s.advantage is None and s.group is not None]
    if grouped:
        units = sorted({unit[i] for i in grouped})
        first = {u: next(i for i in grouped if unit[i] == u) for u in units}
        labels = {g: n for n, g in enumerate(dict.fromkeys(samples[first[u]].group for u in units))}
        ids = torch.tensor([labels[samples[first[u]].group] for u in units])
        mean, scale = group_baselines(torch.tensor([returns[u] for u in units], dtype=torch.float32), ids,
                                      cfg.group_normalize_std)
        at = {u: n for n, u in enumerate(units)}
        rows = torch.tensor([at[unit[i]] for i in grouped])
        out[grouped] = ((r64[grouped] - mean[rows]) / scale[rows]).to(torch.float32)
    baseline = baseline if baseline is not None else RunningBaseline(cfg.baseline_decay)
    base: dict[int, float] = {}
    for i, s in enumerate(samples):
        if s.advantage is not None:
            out[i] = s.advantage
        elif s.group is None:
            if unit[i] not in base:  # the bucket's baseline before this episode, then the episode folds in
                base[unit[i]] = baseline.baseline(s.task)
                baseline.update(s.task, returns[unit[i]])
            out[i] = s.reward - base[unit[i]]
    return out


def _episodes(samples: Sequence[Sample]) -> tuple[list[int], list[float]]:
    """Each sample's episode number (first appearance order) and each episode's return."""
    numbers: dict[Any, int] = {}
    unit, returns = [], []
    for i, s in enumerate(samples):
        key = ("episode", s.episode) if s.episode is not None else ("sample", i)
        if key not in numbers:
            numbers[key] = len(returns)
            returns.append(s.episode_return if s.episode_return is not None else s.reward)
        unit.append(numbers[key])
    return unit, returns


def prepare_batch(
    samples: Sequence[Sample],
    current_version: int,
    cfg: RLConfig,
    pad_id: int,
    baseline: RunningBaseline | None = None,
) -> Batch:
    """Drop stale samples, compute advantages, pack; raises NoFreshSamples when nothing is left."""
    kept, dropped = filter_stale(samples, current_version, cfg.max_staleness)
    if not kept:
        raise NoFreshSamples(dropped)
    batch = Batch.from_samples(kept, pad_id, compute_advantages(kept, cfg, baseline))
    batch.dropped_stale = dropped
    batch.same_weights = torch.tensor([_version(s) is None or _version(s) == current_version for s in kept])
    return batch


# ---------------------------------------------------------------------------------- log-probs

def _gather_logprobs(logits: torch.Tensor, ids: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """log softmax(logits)[ids] without materialising the (N, V) log-softmax at once: the
    plain-torch reference that kernels.logprobs.selective_log_softmax is tested against.

    logits: (..., V), ids: (...) -> (...) float32. Chunks over rows bound the float32 copy.
    """
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    flat_ids = ids.reshape(-1, 1)  # (N, 1)
    parts = []
    for start in range(0, flat.shape[0], chunk_rows):
        chunk = flat[start : start + chunk_rows].float()  # (n, V)
        picked = chunk.gather(1, flat_ids[start : start + chunk_rows]).squeeze(1)  # (n,)
        parts.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(parts).reshape(ids.shape)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) log-prob of token t given tokens < t; column 0 (no context) is 0."""
    picked = selective_log_softmax(logits[:, :-1], input_ids[:, 1:]).float()  # (B, T-1)
    return nn.functional.pad(picked, (1, 0))  # (B, T)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """(B, T) entropy of the distribution that predicted token t; column 0 is 0."""
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])  # (N, V)
    parts = []
    for start in range(0, flat.shape[0], chunk_rows):
        logp = torch.log_softmax(flat[start : start + chunk_rows].float(), dim=-1)  # (n, V)
        parts.append(-(logp.exp() * logp).sum(-1))
    ent = torch.cat(parts).reshape(logits.shape[0], -1)  # (B, T-1)
    return nn.functional.pad(ent, (1, 0))


def _forward_logits(model: nn.Module, batch: Batch, replay: bool) -> tuple[torch.Tensor, ReplayStats]:
    ctx = replay_routing(model, batch_routing_to_flat(batch.routing)) if replay else nullcontext(ReplayStats())
    with ctx as stats:
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    return out.logits, stats  # (B, T, V)


def exact_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """(B, T) like token_logprobs, but through log_softmax + gather, the inference engine's exact
    arithmetic (under batch_invariant_mode the two agree bit for bit); row chunks keep memory low
    and do not change a row's bits (the invariant log_softmax is row-wise on fixed tiles)."""
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])  # (N, V)
    ids = input_ids[:, 1:].reshape(-1, 1)  # (N, 1)
    parts = [flat[i : i + chunk_rows].float().log_softmax(-1).gather(-1, ids[i : i + chunk_rows])[:, 0]
             for i in range(0, flat.shape[0], chunk_rows)]
    picked = torch.cat(parts).reshape(logits.shape[0], -1)  # (B, T-1)
    return nn.functional.pad(picked, (1, 0))  # (B, T)


@torch.no_grad()
def compute_logprobs(model: nn.Module, batch: Batch, cfg: RLConfig, replay: bool | None = None) -> torch.Tensor:
    """(B, T) token log-probs without gradient: pi_old for multi-epoch updates, or recomputing a
    missing behaviour mu from the behaviour version's checkpoint (replay defaults to cfg).

    With cfg.batch_invariant the forward runs under kernels' batch_invariant_mode, so a sequence's
    log-probs equal the torch engine's bit for bit whatever batch it is in (same-length rows)."""
    use_replay = cfg.router_replay if replay is None else replay
    if not cfg.batch_invariant:
        logits, _ = _forward_logits(model, batch, use_replay and batch.routing is not None)
        return token_logprobs(logits, batch.input_ids)
    with batch_invariant_mode(model):
        logits, _ = _forward_logits(model, batch, use_replay and batch.routing is not None)
        return exact_token_logprobs(logits, batch.input_ids, cfg.logprob_chunk_size)


RECOMPUTE_CHUNK = 64  # rows per no-grad forward when recomputing log-probs


def chunked_logprobs(model: nn.Module, batch: Batch, cfg: RLConfig) -> torch.Tensor:
    """compute_logprobs over the batch in chunks of RECOMPUTE_CHUNK rows (bounded memory); (B, T)."""
    parts = [compute_logprobs(model, mb, cfg) for mb in batch.micro_batches(RECOMPUTE_CHUNK)]
    width = batch.input_ids.shape[1]
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])  # (B, T)


def pi_old(model: nn.Module, batch: Batch, sampled_here: Sequence[bool], cfg: RLConfig) -> torch.Tensor:
    """(B, T) pi_old: the log-probs of `model`, the weights a round starts from. A row an engine
    sampled from these very weights (`sampled_here`) already carries them as its behaviour
    log-probs (the torch engine's, within float rounding of the trainer's forward:
    tests/training/rl/test_engine_parity.py), so only the other rows (users' data, sampled by a
    served version) are recomputed. Recomputing the rollout rows too was 17-18% of a training
    step (bench/rl_step.py). Positions outside the completion are 0 in reused rows: only
    completion tokens are read."""
    if not any(sampled_here):
        return chunked_logprobs(model, batch, cfg)
    old = torch.where(batch.behaviour_mask, batch.behaviour_logprobs, 0.0)  # (B, T)
    rest = torch.tensor([i for i, here in enumerate(sampled_here) if not here], dtype=torch.long)
    if len(rest):
        old[rest] = chunked_logprobs(model, batch.rows(rest), cfg)
    return old


# ---------------------------------------------------------------------------------- the step

@dataclass
class StepMetrics:
    loss: float
    kl_ref: float
    entropy: float
    clip_fraction: float
    mismatch_kl: float | None  # engine mismatch, on the rows sampled by pi_old's weights (None: no such row)
    is_truncated: float
    grad_norm: float
    reward_mean: float
    tokens_per_s: float  # non-pad tokens (prompt + completion) through forward+backward per second
    dropped_stale: int
    tokens: int  # completion tokens in the loss
    routing_mismatch: float = 0.0  # share of replayed tokens whose own experts differed
    staleness_kl: float | None = None  # KL(mu || pi_old) on rows served by another version (None: none)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _scored_from(model: nn.Module, mb: Batch) -> int:
    """The first position whose logits the loss reads: the one that predicts the batch's earliest
    completion token. 0 (every position) when the model cannot skip the others."""
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return 0
    first = int(mb.completion_mask.to(torch.int8).argmax(1).min())  # earliest completion column
    return max(first - 1, 0)


def _tail_forward(model: nn.Module, mb: Batch, replay: bool, start: int) -> tuple[torch.Tensor, ReplayStats]:
    """Logits of positions start..T-1 only, (b, T - start, V): the LM head, the log-softmax and
    its backward skip the prompt positions, whose log-probs nothing reads (TRL keeps only the
    completion's logits too). The transformer still runs over every position (the context)."""
    ctx = replay_routing(model, batch_routing_to_flat(mb.routing)) if replay else nullcontext(ReplayStats())
    keep = {"logits_to_keep": mb.input_ids.shape[1] - start} if start else {}
    with ctx as stats:
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False, **keep)
    return out.logits, stats


@dataclass
class SharedPrompts:
    """The distinct prompts of a micro-batch: row i's prompt is the one row `firsts[group[i]]` holds."""

    group: torch.Tensor  # (b,) long: row -> index of its prompt among the distinct ones
    firsts: torch.Tensor  # (u,) long: one row holding each distinct prompt
    n_prompt: torch.Tensor  # (b,) long: prompt length of each row


def shared_prompts(model: nn.Module, mb: Batch) -> SharedPrompts | None:
    """The micro-batch's distinct prompts when forwarding each once saves compute: some rows share
    a prompt (a group), every prompt has 2+ tokens (one is kept for the completion pass) and the
    model takes a KV cache and position ids. None: forward every row whole."""
    params = inspect.signature(model.forward).parameters
    if "past_key_values" not in params or "position_ids" not in params:
        return None
    group, n_prompt = _prompt_groups(mb)
    distinct = max(group) + 1
    if int(n_prompt.min()) < 2 or distinct == mb.size:
        return None
    firsts: dict[int, int] = {}
    for i, g in enumerate(group):
        firsts.setdefault(g, i)
    return SharedPrompts(torch.tensor(group), torch.tensor(list(firsts.values())), n_prompt)


def _prompt_groups(batch: Batch) -> tuple[list[int], torch.Tensor]:
    """Each row's prompt as an index among the batch's distinct prompts (in order of first
    appearance), and each row's prompt length (its first completion column), (B,)."""
    n_prompt = batch.completion_mask.to(torch.int8).argmax(1).long()  # (B,)
    index: dict[tuple[int, ...], int] = {}
    group = [index.setdefault(tuple(row[:n].tolist()), len(index))
             for row, n in zip(batch.input_ids, n_prompt.tolist(), strict=True)]
    return group, n_prompt


def _shared_prefix_forward(model: nn.Module, mb: Batch, shared: SharedPrompts
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits of the completion positions with each distinct prompt forwarded once.

    Pass 1 runs the u distinct prompts less their last token (right-padded to the longest) and
    keeps their keys and values; each row gets its prompt's copy (an index: the backward sums the
    rows' gradients into the one prompt forward). Pass 2 runs every row's last prompt token and
    completion on top, at its true positions, attending to its prompt through the cache. The
    arithmetic is the whole forward's, regrouped: same log-probs and gradient to float rounding
    (tests/training/rl/test_trainer.py).

    Returns logits (b, Lc, V) whose position k predicts the row's input column n_prompt + k,
    pass 2's token ids (b, Lc), and cols (b, Lc): the input column of pass 2's token k, or T
    (none) past the row's end."""
    b, width = mb.input_ids.shape
    prefix = shared.n_prompt[shared.firsts] - 1  # (u,) tokens forwarded once per prompt
    lm = int(prefix.max())
    prefix_mask = (torch.arange(lm)[None] < prefix[:, None]).long()  # (u, Lm), right-padded
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    first = model(input_ids=mb.input_ids[shared.firsts, :lm], attention_mask=prefix_mask, use_cache=True, **keep)
    cache = first.past_key_values
    cache.batch_select_indices(shared.group)  # (b, ...) keys and values: row i's prompt's
    n_tail = mb.completion_mask.sum(1) + 1  # (b,) last prompt token + completion
    lc = int(n_tail.max())
    k = torch.arange(lc)[None]  # (1, Lc)
    start = (shared.n_prompt - 1)[:, None]  # (b, 1) input column of the last prompt token
    inside = k < n_tail[:, None]  # (b, Lc)
    cols = torch.where(inside, start + k, width)  # (b, Lc)
    ids = torch.where(inside, mb.input_ids.gather(1, cols.clamp(max=width - 1)), mb.input_ids[:, :1])
    mask = torch.cat([prefix_mask[shared.group], inside.long()], 1)  # (b, Lm + Lc)
    out = model(input_ids=ids, attention_mask=mask, position_ids=start + k, past_key_values=cache, use_cache=True)
    return out.logits, ids, cols


def _to_columns(values: torch.Tensor, cols: torch.Tensor, width: int) -> torch.Tensor:
    """(b, Lc) per pass-2 position -> (b, T) per input column (0 elsewhere); differentiable."""
    out = values.new_zeros(values.shape[0], width + 1).scatter(1, cols, values)  # column T: the spill
    return out[:, :width]


def _micro_loss(
    model: nn.Module, ref_model: nn.Module | None, mb: Batch, cfg: RLConfig, normalizer: float
) -> tuple[LossOutputs, ReplayStats]:
    replay = cfg.router_replay and mb.routing is not None
    shared = shared_prompts(model, mb) if cfg.shared_prefix and not replay else None
    if shared is not None:
        logits, ids, cols = _shared_prefix_forward(model, mb, shared)  # (b, Lc, V), (b, Lc), (b, Lc)
        width, stats = mb.input_ids.shape[1], ReplayStats()
        # Pass-2 position 0 is the last prompt token (outside the mask): its 0 lands there.
        logprobs = _to_columns(token_logprobs(logits, ids), cols, width)  # (b, T)
        entropy = _to_columns(token_entropy(logits, cfg.logprob_chunk_size), cols, width)  # (b, T)
    else:
        start = _scored_from(model, mb)
        logits, stats = _tail_forward(model, mb, replay, start)  # (b, T - start, V)
        # Columns before `start + 1` are prompt tokens (outside the mask): left as 0.
        logprobs = nn.functional.pad(token_logprobs(logits, mb.input_ids[:, start:]), (start, 0))  # (b, T)
        entropy = nn.functional.pad(token_entropy(logits, cfg.logprob_chunk_size), (start, 0))  # (b, T)
    # One update per batch: the pre-update forward *is* this forward, so pi_old = detached pi_theta.
    old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
    ref = None
    if ref_model is not None:  # the KL is measured whenever there is a reference; it is in the loss when beta > 0
        # No replay here: the KL is to the reference policy as it would act, with its own routing.
        with torch.no_grad():
            if shared is not None:
                ref_logits, ids, cols = _shared_prefix_forward(ref_model, mb, shared)
                ref = _to_columns(token_logprobs(ref_logits, ids), cols, width)
            else:
                ref_logits = ref_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
                ref = token_logprobs(ref_logits, mb.input_ids)
    inputs = LossInputs(
        logprobs=logprobs,
        old_logprobs=old,
        advantages=mb.advantages,
        mask=mb.completion_mask,
        behaviour_logprobs=torch.where(mb.behaviour_mask, mb.behaviour_logprobs, old),
        ref_logprobs=ref,
        same_weights=mb.same_weights,
        entropy=entropy,
        normalizer=normalizer,
    )
    return policy_loss(inputs, cfg.eps, cfg.eps_high, cfg.is_cap, cfg.beta), stats


METRIC_KEYS = ("kl_ref", "entropy", "clip_fraction", "is_truncated")


def backward_batch(
    model: nn.Module, ref_model: nn.Module | None, batch: Batch, cfg: RLConfig, normalizer: float
) -> tuple[dict[str, float], DriftSums, int, int]:
    """Accumulates the gradients of `batch`'s loss, normalised by `normalizer` tokens (the whole
    step's: under torch.distributed, every rank's tokens), micro-batch by micro-batch. Returns the
    token-weighted metric sums, the mismatch/staleness sums and the routing replay counts."""
    sums = dict.fromkeys(("loss", *METRIC_KEYS), 0.0)
    drift = DriftSums()
    replayed = differed = 0
    for mb in batch.micro_batches(cfg.micro_batch_size):
        out, stats = _micro_loss(model, ref_model, mb, cfg, normalizer)
        out.loss.backward()
        share = float(mb.completion_mask.sum()) / normalizer  # token-weighted average of the metrics
        sums["loss"] += float(out.loss.detach())
        for key in METRIC_KEYS:
            sums[key] += float(getattr(out, key)) * share
        drift.add(out)
        replayed, differed = replayed + stats.replayed, differed + stats.differed
    return sums, drift, replayed, differed


def rl_step(
    model: nn.Module, ref_model: nn.Module | None, batch: Batch, optimizer: torch.optim.Optimizer, cfg: RLConfig
) -> StepMetrics:
    """One optimiser step over `batch` (micro-batched; loss is the token-mean over the whole batch)."""
    start = time.perf_counter()
    total_tokens = int(batch.completion_mask.sum())
    normalizer = float(max(total_tokens, 1))
    if cfg.shared_prefix and batch.size > cfg.micro_batch_size:
        # A prompt's rows side by side, so its micro-batch forwards it once (the order of rows
        # in the step's sums changes nothing but float rounding).
        group, _ = _prompt_groups(batch)
        batch = batch.rows(torch.tensor(sorted(range(batch.size), key=group.__getitem__)))
    optimizer.zero_grad(set_to_none=True)
    sums, drift, replayed, differed = backward_batch(model, ref_model, batch, cfg, normalizer)
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
    optimizer.step()
    elapsed = time.perf_counter() - start
    return StepMetrics(
        **sums,
        grad_norm=grad_norm,
        reward_mean=float(batch.rewards.mean()),
        tokens_per_s=float(batch.attention_mask.sum()) / elapsed,
        dropped_stale=batch.dropped_stale,
        tokens=total_tokens,
        routing_mismatch=differed / replayed if replayed else 0.0,
        **drift.means(),
    )


@dataclass
class DriftSums:
    """Token-weighted sums of the engine mismatch and the staleness KL over micro-batches: each
    is a mean over its own rows' tokens, so it is averaged by those counts, not the batch's."""

    mismatch: float = 0.0
    mismatch_tokens: int = 0
    staleness: float = 0.0
    staleness_tokens: int = 0

    def add(self, out: LossOutputs) -> None:
        self.mismatch += float(out.mismatch_kl) * out.mismatch_tokens
        self.mismatch_tokens += out.mismatch_tokens
        if out.staleness_kl is not None:
            self.staleness += float(out.staleness_kl) * out.staleness_tokens
            self.staleness_tokens += out.staleness_tokens

    def means(self) -> dict[str, float | None]:
        return {"mismatch_kl": self.mismatch / self.mismatch_tokens if self.mismatch_tokens else None,
                "staleness_kl": self.staleness / self.staleness_tokens if self.staleness_tokens else None}
