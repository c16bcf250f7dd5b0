"""Packed next-token rows: a corpus's files tokenised, each followed by EOS, concatenated and cut
into fixed-length rows, so no position of a batch is padding. Pure torch (no Django).

    rows = pack_rows([ids_a, ids_b, ...], eos_id=0, seq_len=256)   # (R, T)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch


def pack_rows(documents: Sequence[Sequence[int]], eos_id: int, seq_len: int) -> torch.Tensor:
    """(R, seq_len) rows of the documents' tokens, each document ended by `eos_id`; the stream's
    last partial row is dropped (at most seq_len - 1 tokens of the corpus)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    flat: list[int] = []
    for doc in documents:
        flat.extend(doc)
        flat.append(eos_id)
    n_rows = len(flat) // seq_len
    if n_rows == 0:
        raise ValueError(f"the corpus has {len(flat)} tokens, fewer than one row of {seq_len}; "
                         "give more files or a shorter seq_len")
    return torch.tensor(flat[: n_rows * seq_len], dtype=torch.long).view(n_rows, seq_len)  # (R, T)


def row_batches(rows: torch.Tensor, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Batches of `batch_size` rows for ever, a fresh seeded permutation per pass (the last short
    batch of a pass is kept: every row is seen once per pass)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(rows.shape[0], generator=gen)  # (R,)
        for start in range(0, rows.shape[0], batch_size):
            yield rows[order[start : start + batch_size]]  # (B, T)


def lr_at(progress: float, peak: float, warmup: float = 0.02, floor: float = 0.1) -> float:
    """Linear warm-up over the first `warmup` of the run, then cosine down to `floor` x peak;
    by the run's progress in [0, 1] (steps or minutes alike)."""
    if progress < warmup:
        return peak * max(progress / warmup, 0.01)
    t = min((progress - warmup) / max(1 - warmup, 1e-9), 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


StepFn = Callable[[int, dict[str, Any]], None]


def train_rows(model: Any, rows: torch.Tensor, *, lr: float, batch_size: int, seed: int = 0,
               steps: int | None = None, seconds: float | None = None, warmup: float = 0.02,
               on_step: StepFn | None = None) -> dict[str, Any]:
    """Next-token AdamW training of `model` on packed `rows` (R, T) for `steps` optimiser steps or
    `seconds` of wall time (one of the two); the learning rate follows `lr_at` over the run's
    progress. `on_step(step, {"loss", "grad_norm", "tokens_per_s", "progress"})` after each step.
    Returns the run's figures (steps, tokens seen, seconds, first and last loss)."""
    if (steps is None) == (seconds is None):
        raise ValueError("give either steps or seconds")
    # fused: one kernel over all the parameters, as the RL trainer's optimiser
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)
    model.train()
    start, done, seen, losses = time.monotonic(), 0, 0, []
    for batch in row_batches(rows, batch_size, seed):  # (B, T)
        progress = done / steps if steps is not None else (time.monotonic() - start) / seconds
        if progress >= 1:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(progress, lr, warmup)
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss  # mean over B x (T - 1) next tokens
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        took = time.perf_counter() - t0
        seen, done = seen + batch.numel(), done + 1
        losses.append(loss.item())
        if on_step is not None:
            after = done / steps if steps is not None else (time.monotonic() - start) / seconds
            on_step(done - 1, {"loss": losses[-1], "grad_norm": float(grad_norm), "tokens_per_s": batch.numel() / took,
                               "progress": min(after, 1.0)})
    model.eval()
    elapsed = time.monotonic() - start
    return {"steps": done, "tokens_seen": seen, "seconds": round(elapsed, 2),
            "tokens_per_s": round(seen / max(elapsed, 1e-9), 1),
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None}
