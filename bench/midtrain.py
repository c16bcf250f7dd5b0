"""Mid-training on a code base the base never saw: exact-continuation accepts on its held-out files
before and after, and the training loop's throughput beside a plain torch loop and TRL's
SFTTrainer (packing) on the same model, packed data and cores.

    .venv/bin/python bench/midtrain.py [--corpus DIR] [--seconds 60] [--pretrain-steps 600] [--json]
    .venv/bin/python bench/midtrain.py --quick    # 2 s on django.utils, TRL left out, in a temp folder

The base is the demo's tiny dense policy (training/pretrain.py, pretrained on the standard library).
The code base defaults to Django's sources in this venv, split into
training and held-out files by the product's own rule (training/corpora/services.py
`heldout_paths`, 10% by path). "Accepts" are the gate's exact-continuation score
(training/gate/corpus_rows.py): held-out line prefixes, a suggestion's accepted characters against
what was actually written (usefulness.accepted_chars, 3 characters at least); `accept_share` is the
share of prompts with accepted characters > 0, greedy and sampled (T = 1), on two kinds of prompt:
- **in context** (`heldout_accept_*`, the headline): the requests the intent users send
  (webapp/demo/simulator.py `held_out_prompts`): a line of a held-out file cut a few characters
  past its indentation, after the file's preceding lines, as an editor sends it;
- **line alone** (`heldout_line_accept_*`): the stripped line's prefix with nothing before it
  (training/corpora/lines.py `continuation_prompts`, the gate's corpus row).
The base is read from var/policies/pretrained/ where the demo cached it, else built there once.
Mid-training is `training.corpora.packing.train_rows`, the loop `manage.py midtrain` runs.
Throughput: the median step's tokens/s after two warm-up steps, each loop `--compare-steps` steps
on the same rows, ours and the plain loop in `--compare-rounds` interleaved rounds (the order
swapped every round, so load that comes and goes hits both alike), with the range of the rounds'
medians; TRL once (its own packing of the same files, in var/bench-trl-venv as bench/rl_step.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if sys.path[:1] != [str(ROOT)]:  # first: bench/inference.py must not shadow the package
    sys.path.insert(0, str(ROOT))

from training.corpora.config import MidtrainConfig  # noqa: E402 - torch- and Django-free

OUT = ROOT / "var" / "bench-midtrain"
WARMUP = 2


def base_policy(steps: int, out: Path = OUT, lines: int | None = None) -> Path:
    """The demo's dense base pretrained `steps` steps on the standard library: the demo's own cache
    (var/policies/pretrained/, what `bootstrap_policy` reuses), else built there once; `--quick`
    (`lines` set) builds a throwaway one in its temp folder."""
    if lines is None:
        from bench.gate_base import base_folder

        return base_folder(argparse.Namespace(folder=None, steps=steps), ROOT / "var")
    from training.pretrain import PolicyConfig, build_policy, pretrain, stdlib_corpus

    folder = out / f"base-{steps}"
    corpus = stdlib_corpus(lines)
    build_policy(folder, PolicyConfig(), corpus[:60_000])
    pretrain(folder, corpus, float("inf"), max_steps=steps)
    return folder


def code_base(root: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(training, held-out) (path, text) of the *.py files under `root`, split by the product's rule."""
    from training.corpora.lines import heldout_paths

    files = []
    for path in sorted(root.rglob("*.py")):
        try:
            files.append((path.relative_to(root).as_posix(), path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    held = heldout_paths([p for p, _ in files], 10)  # the product's default share (corpora.services)
    return [f for f in files if f[0] not in held], [f for f in files if f[0] in held]


def accepts(folder: Path, prompts: list[tuple[str, str]], temperature: float, seed: int) -> dict[str, float]:
    """(prompt, what was written next) pairs: the share with accepted characters, and their mean."""
    from inference.engines import SamplingParams, make_engine
    from training.rewards.usefulness import accepted_chars

    engine = make_engine("torch", folder, version=0, seed=seed)
    try:
        out = engine.generate([p for p, _ in prompts], n=1,
                              sampling=SamplingParams(max_tokens=16, temperature=temperature, seed=seed))
    finally:
        engine.close()
    chars = [accepted_chars(c.text, prompts[c.prompt_index][1]) for c in out]
    return {"accept_share": sum(c > 0 for c in chars) / len(chars), "accepted_chars": sum(chars) / len(chars)}


def plain_loop(folder: Path, rows: Any, args: argparse.Namespace) -> float:
    """A plain torch loop on the same model and packed rows: forward, backward, AdamW step; the
    median step's tokens/s after the warm-up steps."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.corpora.packing import row_batches

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    rates = []
    for _, batch in zip(range(args.compare_steps), row_batches(rows, args.batch_size, args.seed), strict=False):
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
        rates.append(batch.numel() / (time.perf_counter() - t0))
    return statistics.median(rates[WARMUP:])


def ours_loop(folder: Path, rows: Any, args: argparse.Namespace) -> float:
    """The median step's tokens/s after the warm-up steps."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.corpora.packing import train_rows

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    rates: list[float] = []
    train_rows(model, rows, lr=args.lr, batch_size=args.batch_size, seed=args.seed, steps=args.compare_steps,
               on_step=lambda _, m: rates.append(m["tokens_per_s"]))
    return statistics.median(rates[WARMUP:])


def interleaved(folder: Path, rows: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Ours and the plain loop in `compare_rounds` rounds, the order swapped every round: the median
    of the rounds' figures per side, their range, and the ratio of the medians."""
    ours: list[float] = []
    plain: list[float] = []
    sides = [(ours_loop, ours), (plain_loop, plain)]
    for r in range(args.compare_rounds):
        for loop, rates in (sides if r % 2 == 0 else sides[::-1]):
            rates.append(loop(folder, rows, args))
    o, p = statistics.median(ours), statistics.median(plain)
    return {"tokens_per_s": o, "plain_torch_tokens_per_s": p, "throughput_ratio": round(o / p, 3),
            "tokens_per_s_range": [min(ours), max(ours)], "plain_torch_tokens_per_s_range": [min(plain), max(plain)]}


def trl_loop(folder: Path, texts: list[str], args: argparse.Namespace) -> float:
    from bench.rl_step import trl_python

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"folder": str(folder), "texts": texts, "seq_len": args.seq_len, "batch_size": args.batch_size,
                   "steps": args.compare_steps, "lr": args.lr, "seed": args.seed}, fh)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([trl_python(), __file__, "--trl-worker", fh.name], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    os.unlink(fh.name)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL part failed:\n{proc.stderr[-3000:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["tokens_per_s"])


def trl_worker(config_path: str) -> None:
    """Inside the TRL venv: SFTTrainer with packing, each step timed by a callback."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    c = json.loads(Path(config_path).read_text())
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            times.append(-time.perf_counter())

        def on_step_end(self, *a, **k):
            times[-1] += time.perf_counter()

    cfg = SFTConfig(output_dir=tempfile.mkdtemp(), packing=True, max_length=c["seq_len"], max_steps=c["steps"],
                    per_device_train_batch_size=c["batch_size"], learning_rate=c["lr"], use_cpu=True, report_to=[],
                    save_strategy="no", logging_steps=10_000, seed=c["seed"], dataloader_num_workers=0,
                    dataset_num_proc=1, bf16=False, fp16=False)
    model = AutoModelForCausalLM.from_pretrained(c["folder"])
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=Dataset.from_dict({"text": c["texts"]}),
                         processing_class=AutoTokenizer.from_pretrained(c["folder"]), callbacks=[Timer()])
    trainer.train()
    tokens = c["batch_size"] * c["seq_len"]
    print(json.dumps({"tokens_per_s": statistics.median(tokens / t for t in times[WARMUP:])}))


def main() -> None:
    import django

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=str(Path(django.__file__).parent))
    parser.add_argument("--seconds", type=float, default=60.0, help="mid-training wall time")
    parser.add_argument("--pretrain-steps", type=int, default=1000, help="the demo's base (FLYWHEEL_PRETRAIN_STEPS)")
    parser.add_argument("--prompts", type=int, default=200)
    # the product's own defaults (manage.py midtrain), so the figures are what a new project gets
    parser.add_argument("--seq-len", type=int, default=MidtrainConfig.seq_len)
    parser.add_argument("--batch-size", type=int, default=MidtrainConfig.batch_size)
    parser.add_argument("--lr", type=float, default=MidtrainConfig.lr)
    parser.add_argument("--compare-steps", type=int, default=12)
    parser.add_argument("--compare-rounds", type=int, default=5, help="interleaved rounds of ours and the plain loop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="a 2-step base, 2 s of mid-training on django.utils, TRL left out: that the bench runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.out, args.base_lines = OUT, None
        if args.quick:
            args.out, args.base_lines, args.no_trl = Path(tmp), 5_000, True
            args.pretrain_steps, args.seconds, args.prompts, args.compare_steps = 2, 2.0, 10, WARMUP + 1
            args.compare_rounds = 2
            args.corpus, args.batch_size, args.seq_len = str(Path(args.corpus) / "utils"), 4, 64
            print("TRL: left out (--quick)")
        result = run(args)
    result["quick"] = args.quick
    print(f"{'held-out accept share':34}{'greedy':>10}{'sampled':>10}")
    for kind, key in (("in context", "heldout"), ("line alone", "heldout_line")):
        for when in ("before", "after"):
            g, s = result[f"{key}_accept_{when}"], result[f"{key}_accept_{when}_sampled"]
            print(f"{kind + ', ' + when:34}{g:>10.3f}{s:>10.3f}")
        lifts = [result[f"{key}_lift{suffix}"] for suffix in ("", "_sampled")]
        print(f"{kind + ', lift':34}" + "".join(f"{x if x is not None else float('nan'):>9.1f}x" for x in lifts))
    print(f"{'accepted chars in context':34}{result['heldout_chars_before']:>10.2f} -> {result['heldout_chars_after']:.2f}")
    for name in ("tokens_per_s", "plain_torch_tokens_per_s", "trl_sft_tokens_per_s"):
        spread = result.get(f"{name}_range")
        print(f"{name:28}{result[name] if result[name] is not None else float('nan'):>10,.0f}"
              + (f"   rounds {spread[0]:,.0f}-{spread[1]:,.0f}" if spread else ""))
    print(f"{'ours / plain torch':28}{result['throughput_ratio']:>10.3f}")
    if args.json:
        print(json.dumps(result))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.corpora.lines import continuation_prompts
    from training.corpora.packing import pack_rows, train_rows
    from webapp.demo.simulator import INTENT, held_out_prompts
    from webapp.demo.simulator import code_base as users_code_base

    started = time.monotonic()
    base = base_policy(args.pretrain_steps, args.out, args.base_lines)
    train, held = code_base(Path(args.corpus))
    kinds = {"heldout": [(p.prompt, p.intended) for p in
                         held_out_prompts(users_code_base(args.corpus), INTENT, args.prompts, seed=11 + args.seed)],
             "heldout_line": [(c.prompt, c.rest) for c in continuation_prompts(held, n=args.prompts, seed=args.seed)]}
    before = {(k, t): accepts(base, ps, t, args.seed) for k, ps in kinds.items() for t in (0.0, 1.0)}
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    docs = tokenizer([t for _, t in train], add_special_tokens=False)["input_ids"]
    rows = pack_rows(docs, tokenizer.eos_token_id, args.seq_len)  # (R, T)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    trained = train_rows(model, rows, lr=args.lr, batch_size=args.batch_size, seed=args.seed, seconds=args.seconds)
    after_dir = args.out / "after"
    model.save_pretrained(after_dir)
    tokenizer.save_pretrained(after_dir)
    after = {(k, t): accepts(after_dir, ps, t, args.seed) for k, ps in kinds.items() for t in (0.0, 1.0)}
    shares: dict[str, Any] = {}
    for k in kinds:
        for t, suffix in ((0.0, ""), (1.0, "_sampled")):
            b, a = before[k, t]["accept_share"], after[k, t]["accept_share"]
            # a base that got none is counted as one prompt in n: the lift is then a lower bound
            shares.update({f"{k}_accept_before{suffix}": b, f"{k}_accept_after{suffix}": a,
                           f"{k}_lift{suffix}": round(a / max(b, 1 / len(kinds[k])), 2) if kinds[k] else None})
    sample = rows[: args.batch_size * (args.compare_steps + 1)]  # the same rows for each loop
    texts = [t for _, t in train][:64]
    return {
        "corpus": args.corpus, "train_files": len(train), "heldout_files": len(held),
        "prompts": len(kinds["heldout"]), "line_prompts": len(kinds["heldout_line"]), "pretrain_steps": args.pretrain_steps,
        "corpus_tokens": int(rows.numel()), "midtrain_seconds": args.seconds, "midtrain_steps": trained["steps"],
        "loss_first": trained["loss_first"], "loss_last": trained["loss_last"],
        **shares,
        "heldout_chars_before": before["heldout", 0.0]["accepted_chars"],
        "heldout_chars_after": after["heldout", 0.0]["accepted_chars"],
        **interleaved(base, sample, args),
        "trl_sft_tokens_per_s": None if args.no_trl else trl_loop(base, texts, args),
        "run_tokens_per_s": trained["tokens_per_s"], "threads": torch.get_num_threads(),
        "wall_s": round(time.monotonic() - started, 1),
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        trl_worker(sys.argv[2])
    else:
        main()
