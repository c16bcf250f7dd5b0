"""Batch-invariant numerics benchmark: slowdown vs default torch ops, and log-prob drift.

    .venv/bin/python bench/numerics.py            # tables
    .venv/bin/python bench/numerics.py --json     # tables, then one JSON line last
    .venv/bin/python bench/numerics.py --quick    # the smallest model, one repeat: that the bench runs

Models: tiny random-init Qwen2s (seeded) at the tiny-model shapes (hidden 64-256, vocab 2-8k).
- slowdown: forward + selective log-softmax of a training batch (64 x T) with
  `batch_invariant_mode` / without, same thread count; best of N interleaved runs (the machine is
  shared, so the minimum is the stable statistic). Per-op rows show where the time goes.
- drift: max |log p(batch of 1) - log p(same sequence in a batch of 64)| over every sequence
  position, with and without the mode (goal: exactly 0 with).
- memory: peak extra tensor bytes of selective log-softmax vs the plain reference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import batch_invariant as bi  # noqa: E402
from kernels.logprobs import (  # noqa: E402
    peak_allocated_bytes,
    selective_log_softmax,
    selective_log_softmax_reference,
)

MODELS = [  # (hidden, intermediate, vocab)
    (64, 256, 2048),
    (128, 1024, 4096),
    (256, 1024, 8192),
]


def tiny_qwen2(hidden: int, inter: int, vocab: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    return Qwen2ForCausalLM(config).to(dtype).eval()


def seq_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits[:, :-1]  # (B, T-1, V)
    return selective_log_softmax(logits, ids[:, 1:])  # (B, T-1)


def paired_best(a: Callable[[], Any], b: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Best-of-repeat seconds for a and b, interleaved so load changes hit both alike."""
    ta, tb = [], []
    a(), b()
    for _ in range(repeat):
        for fn, acc in ((a, ta), (b, tb)):
            start = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - start)
    return min(ta), min(tb)


def model_rows(dtype: torch.dtype, batch: int, t: int, repeat: int, models: list = MODELS) -> list[dict[str, Any]]:
    rows = []
    for hidden, inter, vocab in models:
        model = tiny_qwen2(hidden, inter, vocab, dtype)
        ids = torch.randint(0, vocab, (batch, t), generator=torch.Generator().manual_seed(1))

        def default(model: torch.nn.Module = model, ids: torch.Tensor = ids) -> torch.Tensor:
            return seq_logprobs(model, ids)

        def invariant(model: torch.nn.Module = model, ids: torch.Tensor = ids) -> torch.Tensor:
            with bi.batch_invariant_mode(model):
                return seq_logprobs(model, ids)

        with torch.no_grad():
            base, ours = paired_best(default, invariant, repeat)
        rows.append({"model": f"h{hidden}/v{vocab}", "dtype": str(dtype).removeprefix("torch."), "batch": batch,
                     "T": t, "default_ms": base * 1e3, "invariant_ms": ours * 1e3, "slowdown": ours / base})  # fmt: skip
    return rows


def _op_row(op: str, dtype: torch.dtype, base: float, ours: float) -> dict[str, Any]:
    return {"op": op, "dtype": str(dtype).removeprefix("torch."), "slowdown": ours / base, "default_ms": base * 1e3}


def _ops_for(dtype: torch.dtype, m: int, repeat: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, k, n in (("linear h->4h", 256, 1024), ("linear 4h->h", 1024, 256), ("lm head", 256, 8192)):
        x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
        rows.append(_op_row(name, dtype, *paired_best(lambda x=x, w=w: F.linear(x, w), lambda x=x, w=w: bi.linear(x, w), repeat)))
    v = torch.randn(m, 8192, generator=g).to(dtype)  # (M, V)
    rows.append(_op_row("log_softmax 8k", dtype, *paired_best(lambda: torch.log_softmax(v, -1), lambda: bi.log_softmax(v, -1), repeat)))
    h, wn = torch.randn(m, 256, generator=g).to(dtype), torch.ones(256, dtype=dtype)  # (M, H), (H,)

    def hf_rms() -> torch.Tensor:  # what Qwen2RMSNorm.forward computes
        hf = h.float()
        return wn * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    rows.append(_op_row("rms_norm 256", dtype, *paired_best(hf_rms, lambda: bi.rms_norm(h, wn, 1e-6), repeat)))
    return rows


def op_rows(repeat: int, rows: int = 64 * 32) -> list[dict[str, Any]]:
    return [r for dtype in (torch.float32, torch.bfloat16) for r in _ops_for(dtype, rows, repeat)]


def drift(dtype: torch.dtype, t: int, invariant: bool, models: list = MODELS, batch: int = 64) -> float:
    """max |log p alone - log p in a batch of `batch`| over all sequences of the batch and models."""
    worst = 0.0
    for hidden, inter, vocab in models:
        model = tiny_qwen2(hidden, inter, vocab, dtype)
        ids = torch.randint(0, vocab, (batch, t), generator=torch.Generator().manual_seed(2))
        with torch.no_grad(), bi.batch_invariant_mode(model) if invariant else torch.no_grad():
            full = seq_logprobs(model, ids)  # (B, T-1)
            for i in range(batch):
                alone = seq_logprobs(model, ids[i : i + 1])  # (1, T-1)
                worst = max(worst, (alone - full[i : i + 1]).abs().max().item())
    return worst


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = list(rows[0])
    print(" | ".join(f"{c:>13}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>13.4g}" if isinstance(r[c], float) else f"{r[c]!s:>13}" for c in cols))
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--row-tile", type=int, default=bi.ROW_TILE, help="try another kernels.batch_invariant.ROW_TILE")
    parser.add_argument("--threads", type=int, default=1, help="timing threads (1: stable on a shared machine)")
    parser.add_argument("--models-only", action="store_true", help="only the model slowdown table")
    parser.add_argument("--quick", action="store_true",
                        help="the smallest model, one repeat, drift over 8 sequences: that the bench runs")
    args = parser.parse_args()
    models, batch, drift_batch, lengths = (MODELS[:1], 8, 8, (6,)) if args.quick else (MODELS, 64, 64, (6, 32))
    if args.quick:
        args.repeat = 1
    bi.ROW_TILE = args.row_tile
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ROW_TILE={bi.ROW_TILE}\n")

    train = [r for dtype in (torch.float32, torch.bfloat16) for r in model_rows(dtype, batch, 32, args.repeat, models)]
    single = [r for dtype in (torch.float32, torch.bfloat16) for r in model_rows(dtype, 1, 32, args.repeat, models)]
    print("model forward + selective log-softmax, invariant vs default")
    print_table(train + single)
    if args.models_only:
        return
    ops = op_rows(args.repeat, batch * 32)
    print(f"ops on {batch * 32} rows (batch {batch} x T 32)")
    print_table(ops)

    drifts = []
    for dtype in (torch.float32, torch.bfloat16):
        for t in lengths:
            drifts.append({"dtype": str(dtype).removeprefix("torch."), "T": t,
                           "default": drift(dtype, t, False, models, drift_batch),
                           "invariant": drift(dtype, t, True, models, drift_batch)})  # fmt: skip
    print(f"max |log p(batch 1) - log p(batch {drift_batch})| over {drift_batch} sequences x {len(models)} models")
    print_table(drifts)

    logits = torch.randn(64, 32, 8192).to(torch.bfloat16)  # (B, T, V)
    ids = torch.randint(0, 8192, (64, 32))
    mem_ours = peak_allocated_bytes(lambda: selective_log_softmax(logits, ids))
    mem_ref = peak_allocated_bytes(lambda: selective_log_softmax_reference(logits, ids))
    print(f"selective log-softmax peak extra memory on (64, 32, 8192) bf16 logits: "
          f"chunked {mem_ours / 2**20:.1f} MiB vs reference {mem_ref / 2**20:.1f} MiB\n")  # fmt: skip

    if args.json:
        geo = math.exp(sum(math.log(r["slowdown"]) for r in train) / len(train))
        print(json.dumps({
            "slowdown": round(geo, 3),
            "slowdown_max": round(max(r["slowdown"] for r in train), 3),
            "slowdown_batch1": round(math.exp(sum(math.log(r["slowdown"]) for r in single) / len(single)), 3),
            "max_abs_diff_invariant": max(d["invariant"] for d in drifts),
            "max_abs_diff_default": max(d["default"] for d in drifts),
            "selective_peak_mib": round(mem_ours / 2**20, 2),
            "reference_peak_mib": round(mem_ref / 2**20, 2),
            "row_tile": bi.ROW_TILE, "quick": args.quick,
        }))  # fmt: skip


if __name__ == "__main__":
    main()
