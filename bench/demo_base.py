"""Does the demo's base policy write plausible code? Pretraining time and real-name share per shape.

    .venv/bin/python bench/demo_base.py [--shape tiny|mid|small] [--steps 1000] [--held-out 200]
        [--time-steps 5] [--json]
    .venv/bin/python bench/demo_base.py --quick    # 3 steps on 5,000 lines, 8 prompts, in a temp folder

Builds a policy of the shape (the demo's `tiny` 0.6M default, a `mid` one, or the 25M `small`
shape bench/rl_step.py builds), pretrains it on the standard library for `--steps` optimiser steps
with the same recipe as `manage.py bootstrap_policy` (a progress bar; the tiny shape is cached
where bootstrap_policy looks, var/policies/pretrained/dense-<steps>steps/, so the demo reuses it),
and measures on held-out prompts, one completion each at a fixed seed:

- stdlib statement starts (files of the standard library held out by path hash): the share of
  shown suggestions that use only real names (training.rewards.usefulness: the code base's names
  and Python's), accepted characters per request;
- the intent population's prompts on django's source (a file's preceding lines + a line's start):
  accepted characters per request and the real-name share there.

`--steps 0 --time-steps N` times N steps only (seconds per step, and what `--steps` would cost)
without pretraining to the end: the way to size a shape too slow for this machine. With --json the
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TINY: dict = {}  # PolicyConfig's defaults: the demo's base today
MID = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512}
SMALL = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1408}
SHAPES = {"tiny": TINY, "mid": MID, "small": SMALL}
EVAL_SEED = 1234
QUICK_PACKAGES = {"stdlib": "email", "django": "utils"}


def main() -> int:
    args = _args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        args.cache = Path(tmp) if args.quick else None  # a quick base is never cached for the demo
        folder, stats = _pretrained(args)
        result = {"shape": args.shape, "steps": args.steps, "quick": args.quick, **stats}
        if folder is not None:
            result.update(_measure(folder, args.held_out, args.quick))
    _print(result)
    if args.json:
        print(json.dumps(result))
    return 0


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--time-steps", type=int, default=5, help="with --steps 0: steps to time")
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--quick", action="store_true",
                        help="3 steps on 5,000 lines, 8 held-out prompts, in a temp folder: that the bench runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.held_out = 3, 8
    return args


def _cache(args: argparse.Namespace) -> Path:
    var = args.cache or Path(os.environ.get("FLYWHEEL_VAR_DIR", ROOT / "var")) / "policies" / "pretrained"
    name = f"dense-{args.steps}steps" if args.shape == "tiny" else f"dense-{args.shape}-{args.steps}steps"
    return var / name


def _pretrained(args: argparse.Namespace) -> tuple[Path | None, dict]:
    """The shape pretrained `--steps` steps (cached), or only timed when --steps is 0."""
    from training.pretrain import PolicyConfig, build_policy, pretrain, stdlib_corpus

    cached = _cache(args)
    if args.steps and (cached / "pretrain.json").exists():
        stats = json.loads((cached / "pretrain.json").read_text())
        return cached, {"pretrain_seconds": stats.get("elapsed"), "loss": stats.get("loss"), "cached": True}
    corpus = stdlib_corpus(5_000 if args.quick else None)
    folder = cached.with_name(cached.name + ".building")
    shutil.rmtree(folder, ignore_errors=True)
    started = time.monotonic()
    build_policy(folder, PolicyConfig(kind="dense", **SHAPES[args.shape]), corpus[:60_000])
    built = time.monotonic() - started
    steps = args.steps or args.time_steps
    # Timing only: a step costs the same on any slice of the corpus; tokenising all of it does not.
    text = corpus if args.steps else corpus[:60_000]
    stats = pretrain(folder, text, math.inf, progress=_bar(steps), max_steps=steps)
    sys.stdout.write("\n")
    params = _parameters(folder)
    out = {"build_seconds": round(built, 1), "pretrain_seconds": round(stats["elapsed"], 1), "loss": stats["loss"],
           "seconds_per_step": round(stats["elapsed"] / max(stats["step"], 1), 3), "parameters": params,
           "cached": False}
    if not args.steps:
        out["seconds_for_1000_steps"] = round(1000 * out["seconds_per_step"] + built)
        shutil.rmtree(folder, ignore_errors=True)
        return None, out
    (folder / "pretrain.json").write_text(json.dumps(stats))
    shutil.rmtree(cached, ignore_errors=True)
    folder.rename(cached)
    return cached, out


def _parameters(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    h, layers, inter, vocab = (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"],
                               config["vocab_size"])
    kv = config["num_key_value_heads"] * config.get("head_dim", h // config["num_attention_heads"])
    return vocab * h * (1 if config.get("tie_word_embeddings") else 2) + layers * (2 * h * h + 2 * h * kv + 3 * h * inter)


def _bar(steps: int):
    def show(stats: dict) -> None:
        done = min(stats["step"] / steps, 1.0)
        sys.stdout.write(f"\r[{'#' * int(done * 30):<30}] {done:4.0%} step {int(stats['step'])} "
                         f"loss {stats['loss']:.3f} {stats['elapsed']:.0f}s")
        sys.stdout.flush()

    return show


def _measure(folder: Path, n: int, quick: bool = False) -> dict:
    """The real-name share and accepted characters of the base on stdlib and django held-out prompts
    (quick: on one package of each, `email` and `django.utils`)."""
    from webapp.demo.simulator import (
        INTENT,
        code_base,
        django_source,
        held_out_prompts,
        population_metrics,
        stdlib_source,
    )

    out = {}
    for name, source, taste in (("stdlib", stdlib_source(), "compiles"), ("django", django_source(), INTENT)):
        code = code_base(source / QUICK_PACKAGES[name] if quick else source)
        requests = held_out_prompts(code, taste, n)
        texts = _complete(folder, [r.prompt for r in requests])
        m = population_metrics(taste, requests, texts, code.known)
        visible = [t.strip() for t in texts if t.strip()]
        out[name] = {"real_name_share": round(1 - m["invented_share"], 3), "accepted_chars": round(m["accepted_chars"], 3),
                     "accept_rate": round(m["accept_rate"], 3), "silent_rate": round(m["silent_rate"], 3),
                     "median_chars": statistics.median(len(t) for t in visible) if visible else 0,
                     "samples": [[r.prompt[-40:], t] for r, t in zip(requests[:10], texts[:10], strict=True)]}
    return out


def _complete(folder: Path, prompts: list[str]) -> list[str]:
    from inference.engines import SamplingParams, make_engine

    engine = make_engine("torch", folder, version=1, seed=EVAL_SEED)
    try:
        out = engine.generate(prompts, n=1, sampling=SamplingParams(max_tokens=16, seed=EVAL_SEED))
    finally:
        engine.close()
    return [c.text for c in sorted(out, key=lambda c: c.prompt_index)]


def _print(r: dict) -> None:
    print(f"shape {r['shape']}  parameters {r.get('parameters', '-')}  steps {r['steps']}  "
          f"pretrain {r.get('pretrain_seconds')} s  ({r.get('seconds_per_step', '-')} s/step)  loss {r.get('loss')}")
    if "seconds_for_1000_steps" in r:
        print(f"1000 steps would take about {r['seconds_for_1000_steps']} s on this machine")
    for name in ("stdlib", "django"):
        if name in r:
            m = r[name]
            print(f"{name:<7} real names {m['real_name_share']:.3f}  accepted chars/request {m['accepted_chars']:.3f}  "
                  f"accept {m['accept_rate']:.3f}  silent {m['silent_rate']:.3f}  median chars {m['median_chars']}")
            for prompt, text in m["samples"][:5]:
                print(f"    {prompt!r} -> {text!r}")


if __name__ == "__main__":
    raise SystemExit(main())
