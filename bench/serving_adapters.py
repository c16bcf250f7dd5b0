"""The adapter side of bench/serving.py: two LoRA adapters (production + a 10% canary) on one
engine holding the base, against one merged model, both on the serving engine (vLLM's async
engine; the torch engine in --quick), C concurrent clients each sending requests back to back,
the two sides interleaved round by round (the same machine load).

    nice -n 15 .venv/bin/python bench/serving.py --adapters [--seconds 6] [--json]

Reported: output tokens/s per side and client count (medians over the rounds), and adapter_ratio_C:
the median over the rounds of each round's adapters / merged ratio (the goal at 16 clients is
>= 0.9), with its range and the ratio of the best rounds (best_ratio_C). The rounds
(`--adapter-rounds`, default 5) are paired: each runs both sides back to back, the order swapped
every round, so load that comes and goes on a shared machine hits a round's two sides alike. In-process engines (no HTTP, no recording): the engine's cost of
serving adapters, which the HTTP path adds the same amount to on both sides.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

CANARY_SHARE = 0.1
# vLLM's engine core and worker busy-loop (sched_yield) for 1 s after their last message before
# they sleep: a side started straight after the other ran beside its spinning processes, 2 of
# this machine's 2 cores, for the first second of its 6. Each timed run starts after this pause.
SETTLE_S = 1.2


def settle(kind: str) -> None:
    """The pause before a timed run on a `kind` engine (none on the torch engine: it does not spin)."""
    time.sleep(SETTLE_S if kind != "torch" else 0.0)
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):", "with open(path) as f:"]


def build(base: Path, tmp: Path, kind: str, max_model_len: int) -> dict[str, Any]:
    """The two sides: a host with two adapter views, and an engine on the merged weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from inference.engines import AdapterView, make_engine
    from training.rl.config import AdapterConfig
    from training.rl.lora import lora_attach, lora_save, merge_adapter

    folders = []
    for seed in (1, 2):
        model = lora_attach(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                            AdapterConfig(kind="lora", rank=8))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        lora_save(model, tmp / f"adapter-{seed}")
        folders.append(tmp / f"adapter-{seed}")
    merged = merge_adapter(base, folders[0], tmp / "merged")
    lora = {} if kind == "torch" else {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    host = make_engine(kind, base, max_model_len=max_model_len, **lora)
    views = [AdapterView(host, folders[0], 1), AdapterView(host, folders[1], 2)]
    return {"host": host, "views": views, "merged": make_engine(kind, merged, version=1, max_model_len=max_model_len)}


async def drive(pick, clients: int, seconds: float, seed: int) -> float:
    """Output tokens/s of `clients` clients sending back to back; `pick(rng)` is the engine."""
    from inference.engines import SamplingParams

    end, tokens = time.perf_counter() + seconds, [0]

    async def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        while time.perf_counter() < end:
            sampling = SamplingParams(max_tokens=rng.randint(16, 64), seed=rng.randrange(2**31), ignore_eos=True)
            out = await pick(rng).agenerate([rng.choice(PROMPTS)], sampling=sampling)
            tokens[0] += sum(len(c.token_ids) for c in out)

    start = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    return tokens[0] / (time.perf_counter() - start)


def adapter_side(base: Path, tmp: Path, kind: str, levels: tuple[int, ...], seconds: float, rounds: int,
                 max_model_len: int = 512) -> dict[str, dict[int, list[float]]]:
    """tokens/s by side ("adapters", "merged") and client count, one entry per round; in each
    round the two sides run back to back (the order swapped every round), so a round's two rates
    saw the same machine load and their ratio is one paired measurement."""
    sides = build(base, tmp, kind, max_model_len)
    production, canary = sides["views"]
    picks = {"adapters": lambda rng: canary if rng.random() < CANARY_SHARE else production,
             "merged": lambda rng: sides["merged"]}
    out: dict[str, dict[int, list[float]]] = {name: {c: [] for c in levels} for name in picks}
    try:
        for r in range(rounds):
            for c in levels:
                for name in (list(picks) if r % 2 == 0 else list(picks)[::-1]):
                    settle(kind)
                    out[name][c].append(asyncio.run(drive(picks[name], c, seconds, seed=r)))
    finally:
        for view in sides["views"]:
            view.close()
        sides["host"].close()
        sides["merged"].close()
    return out


def _paired(out: dict[str, dict[int, list[float]]], c: int) -> tuple[float, float, float]:
    """The median of the rounds' adapters/merged ratios at `c` clients, with their range."""
    ratios = [a / max(m, 1e-9) for a, m in zip(out["adapters"][c], out["merged"][c], strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def adapter_summary(out: dict[str, dict[int, list[float]]]) -> dict[str, Any]:
    """Per client count: each side's median tokens/s, and adapter_ratio_C, the median of the
    rounds' paired ratios (a ratio of two medians would pair rounds that saw different loads), with
    adapter_ratio_range_C and the best-of-rounds ratio the bench reported before (best_ratio_C)."""
    summary: dict[str, Any] = {}
    for c in out["adapters"]:
        ratio, low, high = _paired(out, c)
        summary[f"adapter_tokens_per_s_{c}"] = round(statistics.median(out["adapters"][c]), 1)
        summary[f"merged_tokens_per_s_{c}"] = round(statistics.median(out["merged"][c]), 1)
        summary[f"adapter_ratio_{c}"] = round(ratio, 3)
        summary[f"adapter_ratio_range_{c}"] = [round(low, 3), round(high, 3)]
        summary[f"best_ratio_{c}"] = round(max(out["adapters"][c]) / max(max(out["merged"][c]), 1e-9), 3)
    return summary


def print_adapter_table(out: dict[str, dict[int, list[float]]], kind: str) -> None:
    rounds = len(next(iter(out["adapters"].values())))
    print(f"\ntwo adapters (production + {CANARY_SHARE:.0%} canary) on one {kind} engine vs one merged model, "
          f"{rounds} interleaved rounds (tokens/s: medians; ratio: the median of the rounds' paired ratios)")
    print(f"{'clients':>7} | {'adapters':>9} | {'merged':>9} | {'ratio':>6} | {'range':>11} | {'best/best':>9}")
    for c in out["adapters"]:
        ratio, low, high = _paired(out, c)
        a, m = statistics.median(out["adapters"][c]), statistics.median(out["merged"][c])
        best = max(out["adapters"][c]) / max(max(out["merged"][c]), 1e-9)
        print(f"{c:>7} | {a:9.1f} | {m:9.1f} | {ratio:6.3f} | {low:5.3f}-{high:5.3f} | {best:9.3f}")
