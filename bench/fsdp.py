"""The RL update on 2 ranks (torchrun, FSDP2, gloo) against 1 rank, on the same model and batches.

    .venv/bin/python bench/fsdp.py [--size small] [--steps 4] [--rows 16] [--rounds 3]
                                   [--compare ring,gloo] [--precision fp32|bf16] [--json]
    .venv/bin/python bench/fsdp.py --quick        # a micro model, 2 steps: checks the bench runs

Both sides run the same job (training/rl/distributed.py) under torchrun, one thread per rank, so
"per core" compares like with like: `per_core_ratio` = (2-rank tokens/s / 2) / (1-rank tokens/s),
the median over `--rounds` rounds that run the sides in turn (this machine's drift falls on all of
them). `peak_mem_ratio` = the weights, gradients and AdamW state one rank of 2 holds / what 1 rank
holds (what sharding divides; each rank's peak RSS, which also holds activations and torch itself,
is printed beside it). Communication: the seconds rank 0 spent in FSDP2's all-gathers and
reduce-scatters a step (`comm_ms_per_step`, waiting for the peer included), and the 2-rank step's
time less half the 1-rank step's (`overhead_ms_per_step`: communication plus FSDP2's copies and
whatever else sharding adds). Steps after the first (warm-up) are the medians. The 2 ranks share
this host, so their collectives go through shared memory (training/rl/collectives.py);
`--compare ring,gloo` adds 2-rank sides with the rings of gloo's paired sends (what ranks on
different hosts use) and with gloo's own all-gather and reduce-scatter (as jobs ran before both).

This 2-core machine (AMD EPYC, 25M shape, rows 16, micro-batch 8, fp32, 2026-12-07):

    side                     tokens/s   per_core_ratio (range)   communication/step
    1 rank                   506        -                        -
    2 ranks, shared memory   913        0.902 (0.873-0.929)      115 ms
    2 ranks, rings           884        0.875 (0.828-0.897)      173 ms
    2 ranks, gloo's own      689        0.699 (0.549-0.705)      434 ms

A second run, fp32: shared memory 0.903 (0.895-0.910, 121 ms), rings 0.834 (0.818-0.880, 174 ms).
In bf16 (`--precision bf16`, autocast over float32 masters; 1 rank 732-768 tokens/s), before and
after the blocks were gathered in bf16 (FSDP2's MixedPrecisionPolicy, training/rl/distributed.py
`shard`): shared memory 0.791 (0.779-0.797) -> 0.955 (0.911-0.981), rings 0.724 -> 0.888; the
2-rank step less half the 1-rank step 180 -> 46 ms (each rank had cast the whole gathered model
to bf16 for autocast; now each casts its shard, and gathers half the bytes).

Earlier runs of the rings alone against gloo's own (three, the same shape): 0.739, 0.600 and 0.848
against 0.602, 0.713 and 0.743, communication 234, 192 and 166 ms against 652, 354 and 288; the
per-core ratio moved with the 2-rank steps' compute, which on this machine varies by a third from
round to round (two one-thread processes side by side: 0.9-1.4 s for the same forward and backward).

Earlier, on a quiet machine of 16 cores with gloo's own collectives: 0.70-0.73 at micro-batch 8,
0.76 at 16 and 0.865 at 32 (the compute per collective grows with the tokens per micro-batch).
On CPU FSDP2's collectives do not overlap the compute (explicit prefetch and `--reshard no`
measured the same), so what is left of the per-core gap at micro-batch 8 is the communication
and FSDP2's own copies (its all-gather copy-out and reduce-scatter copy-in, about 0.1 s a step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
# the 2-rank sides `--compare` adds beside the default (shared memory: the ranks share this host)
COMPARED = {"ring": "rings of gloo's paired sends", "gloo": "gloo's own all-gather and reduce-scatter"}


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


def _run(policy: Path, batches: list, nproc: int, work: Path, micro: int, reshard: bool = True,
         comms: str = "shm", precision: str = "fp32") -> dict:
    """One job; `comms`: how its all-gathers and reduce-scatters run (training/rl/collectives.py)."""
    from training.rl.distributed import JobSpec, launch

    start = time.perf_counter()
    folder = work / f"ranks-{nproc}-{comms}"
    shutil.rmtree(folder, ignore_errors=True)
    JobSpec(policy=str(policy), rl={"lr": 1e-5, "micro_batch_size": micro}, reference=None,
            reshard_after_forward=reshard, comms=comms, precision=precision).write(folder, batches)
    result = launch(folder, nproc=nproc, timeout_s=1800)
    steps = result.metrics[1:] or result.metrics
    ranks = [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(nproc)]
    tokens = statistics.median(m["tokens_per_s"] for m in steps)
    return {"tokens_per_s": tokens, "wall_s": time.perf_counter() - start,
            "state_mb": max(r["state_mb"] for r in ranks), "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
            "stages": {k: max(r[k] for r in ranks) for k in ("import_s", "load_s", "steps_s", "save_s")},
            # seconds a step spent in the all-gathers and reduce-scatters, after the first (rank 0's)
            "comm_s": statistics.median(ranks[0]["comm_s"][1:] or ranks[0]["comm_s"]),
            "loss": [m["loss"] for m in result.metrics]}


def main() -> int:
    args = _args()
    if set(args.compare) - set(COMPARED):
        raise SystemExit(f"--compare takes {', '.join(COMPARED)}, got {','.join(args.compare)}")
    size = "micro" if args.quick else args.size
    steps, rows = (2, 4) if args.quick else (args.steps, args.rows)
    rounds = 1 if args.quick else args.rounds
    policy = build_model(ROOT / "var" / "bench-policies" / size, SHAPES[size])
    batches = _batches(policy, steps, rows, prompt=32, completion=32)
    sides: dict[str, list[dict]] = {"1": [], "2": [], **{f"2-{mode}": [] for mode in args.compare}}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):  # the sides interleaved: this machine's drift falls on all of them
            sides["1"].append(_run(policy, batches, 1, Path(tmp), args.micro_batch, precision=args.precision))
            sides["2"].append(_run(policy, batches, 2, Path(tmp), args.micro_batch, args.reshard == "yes",
                                   precision=args.precision))
            for mode in args.compare:
                sides[f"2-{mode}"].append(_run(policy, batches, 2, Path(tmp), args.micro_batch, args.reshard == "yes",
                                               comms=mode, precision=args.precision))
    one, two = _median_run(sides["1"]), _median_run(sides["2"])
    tokens = sum(int(b.attention_mask.sum()) for b in batches) / len(batches)
    overhead_ms = (tokens / two["tokens_per_s"] - tokens / one["tokens_per_s"] / 2) * 1000
    ratios = _per_core(sides["1"], sides["2"])
    figures = {"size": size, "rows": rows, "micro_batch": args.micro_batch, "reshard_after_forward": args.reshard == "yes",
               "precision": args.precision, "compare": args.compare,
               "rounds": rounds, "per_core_ratio": round(statistics.median(ratios), 3),
               "per_core_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
               "peak_mem_ratio": round(two["state_mb"] / one["state_mb"], 3),
               "rss_ratio": round(two["peak_rss_mb"] / one["peak_rss_mb"], 3),
               "tokens_per_s_1": round(one["tokens_per_s"]), "tokens_per_s_2": round(two["tokens_per_s"]),
               "comm_ms_per_step": round(statistics.median(r["comm_s"] for r in sides["2"]) * 1000, 1),
               "overhead_ms_per_step": round(overhead_ms, 1),
               "max_loss_diff": max(abs(a - b) for a, b in zip(one["loss"], two["loss"], strict=True)),
               "stages_1": one["stages"], "stages_2": two["stages"], "load_avg": round(os.getloadavg()[0], 1)}
    for mode in args.compare:  # the same figures for 2 ranks with the ring's or gloo's own collectives
        side = sides[f"2-{mode}"]
        ratio = _per_core(sides["1"], side)
        figures |= {f"per_core_ratio_{mode}": round(statistics.median(ratio), 3),
                    f"per_core_ratio_{mode}_range": [round(min(ratio), 3), round(max(ratio), 3)],
                    f"tokens_per_s_2_{mode}": round(_median_run(side)["tokens_per_s"]),
                    f"comm_ms_per_step_{mode}": round(statistics.median(r["comm_s"] for r in side) * 1000, 1),
                    f"max_loss_diff_{mode}": max(abs(a - b) for a, b in zip(
                        one["loss"], _median_run(side)["loss"], strict=True))}
    _table(sides, figures)
    if args.json:
        print(json.dumps(figures))
    return 0


def _per_core(one: list[dict], two: list[dict]) -> list[float]:
    """Each round's 2-rank tokens/s per core over its 1-rank tokens/s."""
    return [b["tokens_per_s"] / 2 / a["tokens_per_s"] for a, b in zip(one, two, strict=True)]


def _median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s (its memory, stages and losses with it)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def _table(sides: dict[str, list[dict]], f: dict) -> None:
    print(f"[{f['size']}, {f['precision']}] RL step under torchrun, FSDP2 over gloo, 1 thread per rank, "
          f"{f['rounds']} interleaved round(s)")
    print(f"{'ranks':>8} {'tokens/s':>10} {'per core':>10} {'range':>13} {'state MB/rank':>14} {'peak RSS MB/rank':>17}")
    for name, runs in sides.items():
        if not runs:
            continue
        n, r = int(name[0]), _median_run(runs)
        spread = [x["tokens_per_s"] for x in runs]
        print(f"{name:>8} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / n:>10.0f} "
              f"{min(spread):>6.0f}-{max(spread):<6.0f} {r['state_mb']:>14.1f} {r['peak_rss_mb']:>17.0f}")
    for name, runs in sides.items():
        if runs:
            r = _median_run(runs)
            stages = ", ".join(f"{k[:-2]} {v:.1f}" for k, v in r["stages"].items())
            print(f"{name} rank(s): launch to weights back {r['wall_s']:.1f} s (slowest rank's seconds: {stages})")
    print(f"machine load (1 min) {f['load_avg']} on {os.cpu_count()} cores")
    for mode in f["compare"]:
        print(f"2-{mode}: 2 ranks with {COMPARED[mode]}: per-core ratio {f[f'per_core_ratio_{mode}']} "
              f"({f[f'per_core_ratio_{mode}_range'][0]}-{f[f'per_core_ratio_{mode}_range'][1]}), "
              f"communication {f[f'comm_ms_per_step_{mode}']} ms/step")
    print(f"per-core ratio {f['per_core_ratio']} ({f['per_core_ratio_range'][0]}-{f['per_core_ratio_range'][1]}; "
          f"goal >= 0.85); state per rank {f['peak_mem_ratio']} of 1 rank (goal <= 0.6); communication "
          f"{f['comm_ms_per_step']} ms/step (2 ranks' step less half of 1 rank's: {f['overhead_ms_per_step']} ms); "
          f"losses agree to {f['max_loss_diff']:.1e}")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SHAPES), default="small")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=8,
                   help="rows per forward (each rank's): FSDP2 gathers the weights once per micro-batch")
    p.add_argument("--reshard", choices=["yes", "no"], default="yes",
                   help="FSDP2's reshard_after_forward for the blocks (no: one all-gather fewer, more memory)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="both sides' compute (bf16: autocast over float32 masters, as a bf16 run trains)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every side; medians reported")
    p.add_argument("--compare", type=lambda v: [m for m in v.split(",") if m], default=[],
                   help="also 2 ranks with other collectives, comma-separated: ring (gloo's paired sends), "
                        "gloo (gloo's own all-gather and reduce-scatter)")
    p.add_argument("--quick", action="store_true", help="micro model, 2 steps: that the bench runs")
    p.add_argument("--json", action="store_true")
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(main())
