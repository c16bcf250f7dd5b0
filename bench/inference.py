"""Inference benchmark: tokens/s of the vLLM and torch engines at batch 1/8/64, and the time to
hot-swap a full checkpoint.

    .venv/bin/python bench/inference.py [--model-dir DIR] [--kind dense|moe] [--tokens 64] [--json]
    .venv/bin/python bench/inference.py --quick    # torch only, batches 1 and 4, 8 tokens: that it runs

Without --model-dir it builds the tiny dense policy in a temp dir. With --json the last line is
one JSON object: vllm_tokens_per_s, torch_tokens_per_s (both at the largest batch),
swap_full_s (vLLM, HF folder -> in-place reload), swap_delta_s (vLLM, the version stored in the
checkpoint store as a delta against the served one: chain read and verified, then reloaded).
`--quick` leaves vLLM out (it says so; the delta swap is then timed on the torch engine).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference.engines import Engine, SamplingParams, make_engine  # noqa: E402
from training.pretrain import PolicyConfig, build_policy, perturbed_state_dict, stdlib_corpus  # noqa: E402

BATCHES = (1, 8, 64)


def tokens_per_s(engine: Engine, batch: int, max_tokens: int) -> float:
    prompts = [f"def f{i}(x):" for i in range(batch)]
    sp = SamplingParams(max_tokens=max_tokens, seed=0, ignore_eos=True)
    engine.generate(prompts[:1], n=1, sampling=SamplingParams(max_tokens=4, seed=0))  # warm-up
    start = time.perf_counter()
    done = engine.generate(prompts, n=1, sampling=sp)
    return sum(len(c.token_ids) for c in done) / (time.perf_counter() - start)


def swap_seconds(engine: Engine, folder: Path, repeats: int = 3) -> float:
    times = []
    for version in range(1, repeats + 1):
        start = time.perf_counter()
        engine.load_weights(folder, version=version)
        times.append(time.perf_counter() - start)
    return min(times)


def swap_delta_seconds(engine: Engine, base: Path, target: Path, store_dir: Path, repeats: int = 3) -> tuple[float, int]:
    """Store base (full) and target (delta on base); time verify-and-apply of the delta version."""
    from training.checkpoints.store import CheckpointStore, make_storage

    store = CheckpointStore(make_storage(store_dir))
    base_hash = store.put(str(base))
    target_hash = store.put(str(target), parent_hash=base_hash)
    times = []
    for version in range(10, 10 + repeats):
        start = time.perf_counter()
        engine.load_weights(store.load_state_dict(target_hash), version=version)
        times.append(time.perf_counter() - start)
    return min(times), store.manifest(target_hash)["blob_bytes"]


def save_perturbed(src: Path, dst: Path) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src))
    model.load_state_dict(perturbed_state_dict(src, scale=0.1))
    model.save_pretrained(dst)
    return dst


def run(model_dir: Path, max_tokens: int, kinds: tuple[str, ...] = ("torch", "vllm"),
        batches: tuple[int, ...] = BATCHES) -> dict[str, object]:
    rows: list[tuple[str, int, float]] = []
    result: dict[str, object] = {}
    target = save_perturbed(model_dir, model_dir.parent / "swap-target")
    for kind in kinds:
        engine = make_engine(kind, model_dir)  # type: ignore[arg-type]
        rows += [(kind, b, tokens_per_s(engine, b, max_tokens)) for b in batches]
        result[f"{kind}_swap_full_s"] = swap_seconds(engine, target)
        if kind == kinds[-1]:  # vLLM's, unless it is left out
            result["swap_delta_s"], result["delta_bytes"] = swap_delta_seconds(
                engine, model_dir, target, model_dir.parent / "store")
        engine.close()
    print(f"{'engine':<8}{'batch':>6}{'tokens/s':>12}")
    for kind, batch, tps in rows:
        print(f"{kind:<8}{batch:>6}{tps:>12.1f}")
    if "vllm" not in kinds:
        print("vllm: left out (--quick)")
    print("swap full checkpoint: " + ", ".join(f"{k} {result[f'{k}_swap_full_s']:.3f} s" for k in kinds))
    print(f"swap delta checkpoint ({kinds[-1]}, verified chain): {result['swap_delta_s']:.3f} s, "
          f"delta {result['delta_bytes']} bytes")
    return {
        **{f"{k}_tokens_per_s": round(max(t for kk, b, t in rows if kk == k and b == batches[-1]), 1) for k in kinds},
        "by_batch": {f"{k}_{b}": round(t, 1) for k, b, t in rows},
        "swap_full_s": round(float(result[f"{kinds[-1]}_swap_full_s"]), 4),  # type: ignore[arg-type]
        "swap_delta_s": round(float(result["swap_delta_s"]), 4),  # type: ignore[arg-type]
        "delta_bytes": result["delta_bytes"], "engines": list(kinds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--kind", choices=["dense", "moe"], default="dense")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="torch only, batches 1 and 4, 8 tokens: that it runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    kinds, batches = (("torch",), (1, 4)) if args.quick else (("torch", "vllm"), BATCHES)
    if args.quick:
        args.tokens = 8
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_dir
        if folder is None:
            lines = stdlib_corpus(2_000 if args.quick else 20_000)
            folder = build_policy(Path(tmp) / "policy", PolicyConfig(kind=args.kind), lines)
        summary = run(folder, args.tokens, kinds, batches)
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
