"""Delta codec benchmark: size ratios and speed on real and synthetic bf16 checkpoint updates.

    .venv/bin/python bench/delta.py            # tables
    .venv/bin/python bench/delta.py --json     # tables, then one JSON line last

(a) real consecutive checkpoints: a tiny random-init Qwen2 (seeded) trained in bf16 with AdamW
on random tokens at two learning rates; each step's weights are a delta against the previous.
(b) synthetic: 8M N(0, 0.02) bf16 weights with exactly 1%, 3%, 17% of them changed by a small
relative step (a few ulps, as an optimizer step does).

Ratios are raw bf16 bytes / encoded bytes for: our codec (a bf16 delta: the values' differences in
their parent's exponent order, zstd; else XOR byte planes, zstd), plain zstd on the raw XOR delta,
and a sparse patch (changed indices as u32 gaps + new values, zstd).
Speeds are single-core MB/s of raw tensor bytes, best of 5 in the table; the headline against
`zstd -1` (level 1) on the raw tensor interleaves the two round by round (best of 9), so a busy
machine slows both alike. Encode and decode include the BLAKE3 hash of every tensor that the
manifest promises (encode is also shown without it, and with format 1's SHA-256 instead, for
reference). Hashes follow torch's thread count: 1 here.
The level sweep at the end is how kernels.delta.LEVEL / FULL_LEVEL were chosen.
(c) LoRA adapters (training/rl/lora.py) on the demo policy's shape (bootstrap_policy's default,
fp32 as its versions are stored), trained 3 AdamW steps on random tokens: the base's raw bytes over
the stored adapter blob (`adapter_ratio`: the default, rank 8 on q/v, PEFT's default targets for
Qwen2/Llama), per rank, targets and the adapter's stored dtype (a bf16 run stores it in bf16).
(d) real RL updates on bench/rl_step.py's 25M shape: the training job's loop (torch engine
rollouts of 8 prompts x G=8, the toy reward, `rl_step` with fused AdamW at lr 1e-5), in fp32 and in
bf16 (training.rl.precision: float32 masters, bf16 autocast, each step's weights cast to bf16 and
delta'd against the previous step's bf16 weights, as a bf16 run's versions are stored). Step 1 is
AdamW's first step (lr x sign(g): every weight moves by lr), the later ones its running estimate,
whose steps shrink until about step 30 (the share of bf16 values a step changes falls from 25% to
6%); `real_delta_ratio_bf16` is the last step's ratio (raw bytes / delta bytes; 40 steps unless
--rl-steps says otherwise), `_first` the first step's, `_vs_full` the last delta against the full
snapshot's compressed bytes.

    .venv/bin/python bench/delta.py --quick --json   # seconds: small tensors, the 0.6M shape, 2 steps
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import delta  # noqa: E402

torch.set_num_threads(1)  # "same core": every codec here runs on one thread
N_SYNTH = 8_000_000
REPEAT = 5  # best of; 1 in --quick


def best_seconds(fn: Callable[[], Any], repeat: int | None = None) -> float:
    times = []
    repeat = min(repeat or REPEAT, REPEAT)
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bits16(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.int16).numpy().view(np.uint16)


def raw_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def plain_zstd_delta(child: dict[str, torch.Tensor], parent: dict[str, torch.Tensor], level: int) -> int:
    c = zstandard.ZstdCompressor(level=level)
    return sum(len(c.compress((bits16(child[k]) ^ bits16(parent[k])).tobytes())) for k in child)


def sparse_patch(child: dict[str, torch.Tensor], parent: dict[str, torch.Tensor], level: int) -> int:
    c = zstandard.ZstdCompressor(level=level)
    size = 0
    for k in child:
        new, old = bits16(child[k]), bits16(parent[k])
        idx = np.flatnonzero(new != old)  # (k,)
        gaps = np.diff(idx, prepend=-1).astype(np.uint32)
        size += len(c.compress(gaps.tobytes() + new[idx].tobytes()))
    return size


def changed_fraction(child: dict[str, torch.Tensor], parent: dict[str, torch.Tensor]) -> float:
    n = sum(int((bits16(child[k]) != bits16(parent[k])).sum()) for k in child)
    return n / sum(t.numel() for t in child.values())


def measure_pair(name: str, child: dict[str, torch.Tensor], parent: dict[str, torch.Tensor], level: int) -> dict[str, Any]:
    raw = raw_bytes(child)
    parent_hash = delta.checkpoint_hash(parent)  # the store knows it from the parent's manifest
    blob = delta.encode(child, parent, level=level, parent_hash=parent_hash)
    enc = best_seconds(lambda: delta.encode(child, parent, level=level, parent_hash=parent_hash))
    dec = best_seconds(lambda: delta.decode(blob, parent, parent_hash=parent_hash))
    sparse = sparse_patch(child, parent, 3)
    # The manifest needs a hash of every tensor; report the codec alone, and what SHA-256 cost.
    hashed = best_seconds(lambda: [delta.tensor_hash(t) for t in child.values()])
    sha = best_seconds(lambda: [delta.tensor_hash(t, fmt=1) for t in child.values()])
    return {
        "case": name, "changed": changed_fraction(child, parent), "ratio": raw / len(blob),
        "zstd_delta": raw / plain_zstd_delta(child, parent, 3), "sparse": raw / sparse,
        "vs_sparse": sparse / len(blob), "enc_mb_s": raw / enc / 1e6, "dec_mb_s": raw / dec / 1e6,
        "enc_nohash": raw / max(enc - hashed, 1e-9) / 1e6, "hash_mb_s": raw / hashed / 1e6,
        "sha_enc_mb_s": raw / (max(enc - hashed, 1e-9) + sha) / 1e6,
    }  # fmt: skip


def zstd1_speed(state: dict[str, torch.Tensor], level: int = 1) -> tuple[float, float]:
    """`zstd -1` (level 1) on the raw tensors: compress and decompress MB/s."""
    c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
    frames = {k: c.compress(bits16(t).tobytes()) for k, t in state.items()}
    enc = best_seconds(lambda: [c.compress(bits16(t).data) for t in state.values()])
    dec = best_seconds(lambda: [d.decompress(f) for f in frames.values()])
    return raw_bytes(state) / enc / 1e6, raw_bytes(state) / dec / 1e6


def head_to_head(child: dict[str, torch.Tensor], parent: dict[str, torch.Tensor], rounds: int = 9) -> dict[str, float]:
    """Ours vs `zstd -1` on the same tensors, interleaved round by round so that a busy machine
    slows both alike; best time of each. MB/s of raw bytes."""
    c, d = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    parent_hash = delta.checkpoint_hash(parent)
    blob = delta.encode(child, parent, parent_hash=parent_hash)
    frames = [c.compress(bits16(t).tobytes()) for t in child.values()]
    jobs = {
        "enc": lambda: delta.encode(child, parent, parent_hash=parent_hash),
        "dec": lambda: delta.decode(blob, parent, parent_hash=parent_hash),
        "z_enc": lambda: [c.compress(bits16(t).data) for t in child.values()],
        "z_dec": lambda: [d.decompress(f) for f in frames],
        "blake3": lambda: [delta.tensor_hash(t) for t in child.values()],
        "sha256": lambda: [delta.tensor_hash(t, fmt=1) for t in child.values()],
    }
    best = dict.fromkeys(jobs, float("inf"))
    for _ in range(rounds):
        for key, fn in jobs.items():
            best[key] = min(best[key], best_seconds(fn, repeat=1))
    raw = raw_bytes(child)
    return {key: raw / t / 1e6 for key, t in best.items()}


# --- data -------------------------------------------------------------------------------------


def synthetic(frac: float, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    parent = (torch.randn(N_SYNTH, generator=g) * 0.02).to(torch.bfloat16)
    idx = torch.randperm(N_SYNTH, generator=g)[: int(frac * N_SYNTH)]
    stepped = parent[idx].float() * (1 + torch.randn(idx.numel(), generator=g) * 2**-7)
    new = stepped.to(torch.bfloat16)
    same = new.view(torch.int16) == parent[idx].view(torch.int16)
    new.view(torch.int16)[same] ^= 1  # the step rounded away: move it by one ulp instead
    child = parent.clone()
    child[idx] = new
    return {"w": child}, {"w": parent}


def real_checkpoints(lr: float, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """Consecutive bf16 state dicts of a tiny Qwen2 trained with AdamW on random tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ids = torch.randint(0, 4096, (8, 64), generator=torch.Generator().manual_seed(1))
    states = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def entropy_bound(state: dict[str, torch.Tensor]) -> float:
    """16 / order-0 entropy of the bf16 words: what a symbol coder could reach at best."""
    counts = np.zeros(65536, dtype=np.int64)
    for t in state.values():
        if t.dtype == torch.bfloat16:
            counts += np.bincount(bits16(t), minlength=65536)
    p = counts[counts > 0] / counts.sum()
    return 16 / float(-(p * np.log2(p)).sum())


# --- tables -----------------------------------------------------------------------------------


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    print(" | ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>12.4g}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in cols))
    print()


def full_snapshot(state: dict[str, torch.Tensor], full_level: int) -> dict[str, Any]:
    raw = raw_bytes(state)
    blob = delta.encode(state, full_level=full_level)
    enc = best_seconds(lambda: delta.encode(state, full_level=full_level), repeat=2)
    bound = entropy_bound(state)
    return {"full_level": full_level, "ratio": raw / len(blob), "bound": bound,
            "of_bound": raw / len(blob) / bound, "enc_mb_s": raw / enc / 1e6}  # fmt: skip


ADAPTER_CASES = [  # (rank, targets, stored dtype); the first is the default
    (8, ("q_proj", "v_proj"), torch.float32),
    (8, ("q_proj", "v_proj"), torch.bfloat16),
    (8, ("q_proj", "k_proj", "v_proj", "o_proj"), torch.float32),
    (4, ("q_proj", "v_proj"), torch.float32),
    (16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), torch.float32),
]


def adapter_sizes(steps: int = 3) -> list[dict[str, Any]]:
    """Base raw bytes / stored adapter bytes for LoRA adapters of the demo policy's shape."""
    # Imported here: the codec tables above need neither transformers nor PEFT.
    from transformers import Qwen2ForCausalLM

    from training.pretrain import PolicyConfig, model_config
    from training.rl.config import AdapterConfig
    from training.rl.lora import adapter_state_dict, lora_attach

    rows = []
    assert AdapterConfig(kind="lora").target_modules == ADAPTER_CASES[0][1]
    for rank, targets, dtype in ADAPTER_CASES:
        adapter = AdapterConfig(kind="lora", rank=rank, target_modules=targets)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(model_config(PolicyConfig(), 0))
        base = raw_bytes(model.state_dict())
        model = lora_attach(model, adapter)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        ids = torch.randint(0, 2048, (8, 64), generator=torch.Generator().manual_seed(1))
        for _ in range(steps):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        blob = delta.encode(adapter_state_dict(model, dtype))
        kind = "bf16" if dtype == torch.bfloat16 else "fp32"
        rows.append({"case": f"r{adapter.rank} {'/'.join(t.split('_')[0] for t in adapter.target_modules)} {kind}",
                     "base_bytes": base, "adapter_bytes": len(blob), "ratio": base / len(blob)})
    return rows


def real_rl_rows(precision: str, steps: int, shape: str) -> tuple[list[dict[str, Any]], float]:
    """Per-step deltas of real RL updates (bench/rl_step.py's loop, lr 1e-5) in `precision`, each
    step's weights in that precision's serving dtype against the step before; and the full
    snapshot's compressed bytes of the starting weights."""
    from bench import rl_step
    from training.rl.precision import compute_context, serving_state_dict

    size = "" if shape == "tiny" else f"-{shape}"
    folder = rl_step.build_model(Path(rl_step.ROOT / "var" / f"bench-rl-model{size}"), rl_step.SIZES[shape])
    torch.manual_seed(0)
    ours = rl_step.Ours(folder, rl_step.make_prompts(folder, 8, 30), 8, 24, 1e-5, "torch")
    parent = serving_state_dict(ours.model.state_dict(), precision)
    full = len(delta.encode(parent))
    rows = []
    for step in range(steps):
        batch = ours.batch(ours.rollout(), step)
        with compute_context(precision):
            ours.update(batch)
        ours.sync_weights(step + 1)
        child = serving_state_dict(ours.model.state_dict(), precision)
        blob = delta.encode(child, parent)
        rows.append({"case": f"rl {shape} {precision} s{step + 1}", "changed": changed_fraction(child, parent),
                     "ratio": raw_bytes(child) / len(blob), "vs_full": full / len(blob)})
        parent = child
    ours.close()
    return rows, raw_bytes(parent) / full


def real_rl_table(steps: int, shape: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows = []
    for precision in ("fp32", "bf16"):
        got, full_ratio = real_rl_rows(precision, steps, shape)
        rows += got
        out[precision] = {"last": got[-1], "first": got[0], "full_ratio": full_ratio}
    print(f"real RL updates ({shape} shape, lr 1e-5, 8 prompts x G=8); ratio = raw bytes of the serving dtype / "
          "delta bytes; vs_full = the full snapshot's bytes / delta bytes")
    print_table(rows, ["case", "changed", "ratio", "vs_full"])
    return out


def main() -> None:
    global N_SYNTH, REPEAT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.add_argument("--quick", action="store_true", help="seconds: 1M-weight tensors, the 0.6M shape, 2 steps")
    parser.add_argument("--rl-steps", type=int, default=40,
                        help="real RL steps per precision (25M shape): AdamW's warm-up and its steady state")
    args = parser.parse_args()
    if args.quick:
        N_SYNTH, REPEAT = 1_000_000, 1
    rl = real_rl_table(2 if args.quick else args.rl_steps, "tiny" if args.quick else "small")

    rows = []
    for lr in (1e-5, 1e-4):
        states = real_checkpoints(lr, steps=1 if args.quick else 3)
        rows += [measure_pair(f"real lr={lr:g} s{i + 1}", states[i + 1], states[i], delta.LEVEL) for i in range(len(states) - 1)]
    synth = {frac: synthetic(frac) for frac in (0.01, 0.03, 0.17)}
    rows += [measure_pair(f"synth {frac:.0%}", *pair, delta.LEVEL) for frac, pair in synth.items()]
    print(f"delta codec (level {delta.LEVEL}); ratio = raw bf16 bytes / encoded bytes; MB/s of raw bytes, 1 core")
    print_table(rows, ["case", "changed", "ratio", "zstd_delta", "sparse", "vs_sparse", "enc_mb_s", "enc_nohash",
                       "sha_enc_mb_s", "dec_mb_s"])  # fmt: skip

    fast_enc, _ = zstd1_speed(synth[0.01][0], level=-1)
    one = next(r for r in rows if r["case"] == "synth 1%")
    h = head_to_head(*synth[0.01], rounds=1 if args.quick else 9)
    z_enc, z_dec = h["z_enc"], h["z_dec"]
    nohash = 1 / (1 / h["enc"] - 1 / h["blake3"])  # MB/s of the codec alone
    with_sha = 1 / (1 / nohash + 1 / h["sha256"])  # the same codec with format 1's SHA-256
    print(f"(for scale: zstd's negative level -1, which mostly stores bf16 raw, encodes {fast_enc:.0f} MB/s)")
    print(f"head to head at 1% (interleaved, best of 9): zstd -1 (level 1) on the raw tensor encodes "
          f"{z_enc:.0f} MB/s, decodes {z_dec:.0f} MB/s; ours encodes {h['enc']:.0f} MB/s ({h['enc'] / z_enc:.2f}x; "
          f"{nohash / z_enc:.2f}x without the BLAKE3 at {h['blake3']:.0f} MB/s, {with_sha / z_enc:.2f}x with "
          f"SHA-256 at {h['sha256']:.0f} MB/s), decodes {h['dec']:.0f} MB/s ({h['dec'] / z_dec:.2f}x)\n")  # fmt: skip

    real_full = real_checkpoints(1e-5, steps=0)[0]
    fulls = [dict(case="synthetic", **full_snapshot(synth[0.01][1], lv)) for lv in (1, 9, delta.FULL_LEVEL)]
    fulls += [dict(case="tiny qwen2", **full_snapshot(real_full, delta.FULL_LEVEL))]
    print("full snapshots (rotated byte planes + zstd; exponent plane at full_level)")
    print_table(fulls, ["case", "full_level", "ratio", "bound", "of_bound", "enc_mb_s"])

    sweep = [dict(level=lv, **measure_pair("synth 1%", *synth[0.01], lv)) for lv in (1, 3, 6, 9)]
    print("level sweep on the 1% synthetic delta")
    print_table(sweep, ["level", "ratio", "vs_sparse", "enc_mb_s", "dec_mb_s"])

    adapters = adapter_sizes()
    print("LoRA adapters of the demo policy (fp32 base; ratio = base raw bytes / stored adapter bytes)")
    print_table(adapters, ["case", "base_bytes", "adapter_bytes", "ratio"])

    if args.json:
        by = {r["case"]: r for r in rows}
        full = next(f for f in fulls if f["case"] == "synthetic" and f["full_level"] == delta.FULL_LEVEL)
        print(json.dumps({
            "ratio_1pct": round(one["ratio"], 2),
            "ratio_3pct": round(by["synth 3%"]["ratio"], 2),
            "ratio_17pct": round(by["synth 17%"]["ratio"], 2),
            "ratio_vs_sparse_1pct": round(one["vs_sparse"], 3),
            "ratio_zstd_delta_1pct": round(one["zstd_delta"], 2),
            "full_snapshot_ratio": round(full["ratio"], 4),
            "full_snapshot_entropy_bound": round(full["bound"], 4),
            "full_snapshot_ratio_tiny_qwen2": round(fulls[-1]["ratio"], 4),
            "encode_speed_vs_zstd1": round(h["enc"] / z_enc, 3),
            "encode_speed_vs_zstd1_without_hash": round(nohash / z_enc, 3),
            "encode_speed_vs_zstd1_with_sha256": round(with_sha / z_enc, 3),
            "decode_speed_vs_zstd1": round(h["dec"] / z_dec, 3),
            "encode_mb_s_1pct": round(h["enc"], 1),
            "hash_mb_s": round(h["blake3"], 1),
            "sha256_mb_s": round(h["sha256"], 1),
            "zstd1_encode_mb_s": round(z_enc, 1),
            "real_ratios": {r["case"]: round(r["ratio"], 2) for r in rows if r["case"].startswith("real")},
            "level": delta.LEVEL,
            "full_level": delta.FULL_LEVEL,
            "adapter_ratio": round(adapters[0]["ratio"], 1),
            "adapter_ratio_bf16": round(adapters[1]["ratio"], 1),
            "adapter_ratios": {a["case"]: round(a["ratio"], 1) for a in adapters},
            "real_delta_ratio_bf16": round(rl["bf16"]["last"]["ratio"], 2),
            "real_delta_ratio_bf16_vs_full": round(rl["bf16"]["last"]["vs_full"], 2),
            "real_delta_ratio_bf16_first": round(rl["bf16"]["first"]["ratio"], 2),
            "real_delta_changed_bf16": round(rl["bf16"]["last"]["changed"], 4),
            "real_delta_ratio_fp32": round(rl["fp32"]["last"]["ratio"], 2),
            "real_delta_ratio_fp32_first": round(rl["fp32"]["first"]["ratio"], 2),
            "real_delta_rl_steps": 2 if args.quick else args.rl_steps,
        }))  # fmt: skip


if __name__ == "__main__":
    main()
