"""The RL update on 2 ranks (torchrun, FSDP2, gloo) against 1 rank, on the same model and batches.

    .venv/bin/python bench/fsdp.py [--size small] [--steps 4] [--rows 16] [--json]
    .venv/bin/python bench/fsdp.py --quick        # a micro model, 2 steps: checks the bench runs

Both sides run the same job (training/rl/distributed.py) under torchrun, one thread per rank, so
"per core" compares like with like: `per_core_ratio` = (2-rank tokens/s / 2) / (1-rank tokens/s).
`peak_mem_ratio` = the weights, gradients and AdamW state one rank of 2 holds / what 1 rank holds
(what sharding divides; each rank's peak RSS, which also holds activations and torch itself, is
printed beside it). Communication: a 2-rank step's time minus half the 1-rank step's (the work
split in two), printed per step. Steps after the first (warm-up) are the medians.

Measured on a quiet machine of 16 cores (the small 25M shape, 1 thread a rank, torch 2.11 CPU):

    rows/step  micro-batch  per_core_ratio  peak_mem_ratio  communication/step
    16         8            0.70-0.73       0.5             ~0.40 s
    32         16           0.76            0.5             ~0.6 s
    64         32           0.865           0.5             ~0.6 s

The communication is gloo's: each micro-batch gathers the weights twice (forward, backward) and
reduce-scatters the gradients once, ~98 MB each for 25M fp32 parameters, and on CPU FSDP2's
collectives do not overlap the compute (explicit forward/backward prefetch and
`--reshard no` measured the same). So the per-core ratio grows with the tokens per micro-batch:
the goal (0.85) is met from 32 rows of 64 tokens per rank's micro-batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.rl_step import MODEL, SMALL, build_model  # noqa: E402

# --quick: the smallest shape the sharding path takes (its tokenizer trains in a second).
MICRO = dict(MODEL, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, tokenizer_lines=2000)
SHAPES = {"micro": MICRO, "tiny": MODEL, "small": SMALL}


def _batches(folder: Path, steps: int, rows: int, prompt: int, completion: int) -> list:
    import torch

    from training.pretrain import load_tokenizer
    from training.rl.config import RLConfig
    from training.rl.trainer import Sample, prepare_batch

    vocab = len(load_tokenizer(folder))
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        samples = [Sample(torch.randint(3, vocab, (prompt,), generator=gen).tolist(),
                          torch.randint(3, vocab, (completion,), generator=gen).tolist(),
                          reward=float(i % 4) / 3, behaviour_logprobs=[-3.0] * completion, group=i // 4)
                   for i in range(rows)]
        out.append(prepare_batch(samples, current_version=1, cfg=RLConfig(), pad_id=0))
    return out


def _run(policy: Path, batches: list, nproc: int, work: Path, micro: int, reshard: bool = True) -> dict:
    from training.rl.distributed import JobSpec, launch

    start = time.perf_counter()
    folder = work / f"ranks-{nproc}"
    JobSpec(policy=str(policy), rl={"lr": 1e-5, "micro_batch_size": micro}, reference=None,
            reshard_after_forward=reshard).write(folder, batches)
    result = launch(folder, nproc=nproc, timeout_s=1800)
    steps = result.metrics[1:] or result.metrics
    ranks = [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(nproc)]
    tokens = statistics.median(m["tokens_per_s"] for m in steps)
    return {"tokens_per_s": tokens, "wall_s": time.perf_counter() - start,
            "state_mb": max(r["state_mb"] for r in ranks), "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
            "stages": {k: max(r[k] for r in ranks) for k in ("import_s", "load_s", "steps_s", "save_s")},
            "loss": [m["loss"] for m in result.metrics]}


def main() -> int:
    args = _args()
    size = "micro" if args.quick else args.size
    steps, rows = (2, 4) if args.quick else (args.steps, args.rows)
    policy = build_model(ROOT / "var" / "bench-policies" / size, SHAPES[size])
    batches = _batches(policy, steps, rows, prompt=32, completion=32)
    with tempfile.TemporaryDirectory() as tmp:
        one = _run(policy, batches, 1, Path(tmp), args.micro_batch)
        two = _run(policy, batches, 2, Path(tmp), args.micro_batch, args.reshard == "yes")
    tokens = sum(int(b.attention_mask.sum()) for b in batches) / len(batches)
    comm_ms = (tokens / two["tokens_per_s"] - tokens / one["tokens_per_s"] / 2) * 1000
    figures = {"size": size, "rows": rows, "micro_batch": args.micro_batch, "reshard_after_forward": args.reshard == "yes",
               "per_core_ratio": round(two["tokens_per_s"] / 2 / one["tokens_per_s"], 3),
               "peak_mem_ratio": round(two["state_mb"] / one["state_mb"], 3),
               "rss_ratio": round(two["peak_rss_mb"] / one["peak_rss_mb"], 3),
               "tokens_per_s_1": round(one["tokens_per_s"]), "tokens_per_s_2": round(two["tokens_per_s"]),
               "comm_ms_per_step": round(comm_ms, 1),
               "max_loss_diff": max(abs(a - b) for a, b in zip(one["loss"], two["loss"], strict=True)),
               "stages_1": one["stages"], "stages_2": two["stages"], "load_avg": round(os.getloadavg()[0], 1)}
    _table(one, two, figures)
    if args.json:
        print(json.dumps(figures))
    return 0


def _table(one: dict, two: dict, f: dict) -> None:
    print(f"[{f['size']}] RL step under torchrun, FSDP2 over gloo, 1 thread per rank")
    print(f"{'ranks':>5} {'tokens/s':>10} {'per core':>10} {'state MB/rank':>14} {'peak RSS MB/rank':>17}")
    for n, r in ((1, one), (2, two)):
        print(f"{n:>5} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / n:>10.0f} {r['state_mb']:>14.1f} "
              f"{r['peak_rss_mb']:>17.0f}")
    for n, r in ((1, one), (2, two)):
        stages = ", ".join(f"{k[:-2]} {v:.1f}" for k, v in r["stages"].items())
        print(f"{n} rank(s): launch to weights back {r['wall_s']:.1f} s (slowest rank's seconds: {stages})")
    print(f"machine load (1 min) {f['load_avg']} on {os.cpu_count()} cores")
    print(f"per-core ratio {f['per_core_ratio']} (goal >= 0.85); state per rank {f['peak_mem_ratio']} of 1 rank "
          f"(goal <= 0.6); communication ~{f['comm_ms_per_step']} ms/step; losses agree to {f['max_loss_diff']:.1e}")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SHAPES), default="small")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=8,
                   help="rows per forward (each rank's): FSDP2 gathers the weights once per micro-batch")
    p.add_argument("--reshard", choices=["yes", "no"], default="yes",
                   help="FSDP2's reshard_after_forward for the blocks (no: one all-gather fewer, more memory)")
    p.add_argument("--quick", action="store_true", help="micro model, 2 steps: that the bench runs")
    p.add_argument("--json", action="store_true")
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(main())
