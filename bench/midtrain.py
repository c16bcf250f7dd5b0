"""Mid-training on a code base the base never saw: exact-continuation accepts on its held-out files
before and after, and the training loop's throughput beside a plain torch loop and TRL's
SFTTrainer (packing) on the same model, packed data and cores.

    .venv/bin/python bench/midtrain.py [--corpus DIR] [--seconds 60] [--pretrain-steps 600] [--json]
    .venv/bin/python bench/midtrain.py --quick    # 2 s on django.utils, TRL left out, in a temp folder

The base is the demo's tiny dense policy (training/pretrain.py, pretrained on the standard library;
cached in var/bench-midtrain/). The code base defaults to Django's sources in this venv, split into
training and held-out files by the product's own rule (training/corpora/services.py
`heldout_paths`, 10% by path). "Accepts" are the gate's exact-continuation score
(training/gate/corpus_rows.py): held-out line prefixes (a few characters to half the line), a
suggestion's accepted characters against what was actually written (usefulness.accepted_chars);
`accept_share` is the share of prompts with accepted characters > 0, greedy and sampled (T = 1).
Mid-training is `training.corpora.packing.train_rows`, the loop `manage.py midtrain` runs.
Throughput: the median step's tokens/s after two warm-up steps, each loop `--compare-steps` steps
on the same rows (TRL: its own packing of the same files, in var/bench-trl-venv as bench/rl_step.py).
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from training.corpora.config import MidtrainConfig  # noqa: E402 - torch- and Django-free

OUT = ROOT / "var" / "bench-midtrain"
WARMUP = 2


def base_policy(steps: int, out: Path = OUT, lines: int | None = None) -> Path:
    """The demo's dense base pretrained `steps` steps on the standard library (cached)."""
    from training.pretrain import PolicyConfig, build_policy, pretrain, stdlib_corpus

    folder = out / f"base-{steps}"
    if (folder / "done").exists():
        return folder
    corpus = stdlib_corpus(lines)
    build_policy(folder, PolicyConfig(), corpus[:60_000])
    stats = pretrain(folder, corpus, float("inf"), max_steps=steps)
    (folder / "done").write_text(json.dumps(stats))
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


def accepts(folder: Path, prompts: list[Any], temperature: float, seed: int) -> dict[str, float]:
    from inference.engines import SamplingParams, make_engine
    from training.rewards.usefulness import accepted_chars

    engine = make_engine("torch", folder, version=0, seed=seed)
    try:
        out = engine.generate([p.prompt for p in prompts], n=1,
                              sampling=SamplingParams(max_tokens=16, temperature=temperature, seed=seed))
    finally:
        engine.close()
    chars = [accepted_chars(c.text, prompts[c.prompt_index].rest) for c in out]
    return {"accept_share": sum(c > 0 for c in chars) / len(chars), "accepted_chars": sum(chars) / len(chars)}


def plain_loop(folder: Path, rows: Any, args: argparse.Namespace) -> float:
    """A plain torch loop on the same model and packed rows: forward, backward, AdamW step."""
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
    import torch
    from transformers import AutoModelForCausalLM

    from training.corpora.packing import train_rows

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    rates: list[float] = []
    train_rows(model, rows, lr=args.lr, batch_size=args.batch_size, seed=args.seed, steps=args.compare_steps,
               on_step=lambda _, m: rates.append(m["tokens_per_s"]))
    return statistics.median(rates[WARMUP:])


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
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--prompts", type=int, default=200)
    # the product's own defaults (manage.py midtrain), so the figures are what a new project gets
    parser.add_argument("--seq-len", type=int, default=MidtrainConfig.seq_len)
    parser.add_argument("--batch-size", type=int, default=MidtrainConfig.batch_size)
    parser.add_argument("--lr", type=float, default=MidtrainConfig.lr)
    parser.add_argument("--compare-steps", type=int, default=12)
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
            args.corpus, args.batch_size, args.seq_len = str(Path(args.corpus) / "utils"), 4, 64
            print("TRL: left out (--quick)")
        result = run(args)
    result["quick"] = args.quick
    print(f"{'':28}{'greedy':>10}{'sampled':>10}")
    for when in ("before", "after"):
        g, s = result[f"heldout_accept_{when}"], result[f"heldout_accept_{when}_sampled"]
        print(f"{'held-out accept share ' + when:28}{g:>10.3f}{s:>10.3f}")
    print(f"{'held-out accepted chars':28}{result['heldout_chars_before']:>10.2f} -> {result['heldout_chars_after']:.2f}")
    for name in ("tokens_per_s", "plain_torch_tokens_per_s", "trl_sft_tokens_per_s"):
        print(f"{name:28}{result[name] if result[name] is not None else float('nan'):>10,.0f}")
    if args.json:
        print(json.dumps(result))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.corpora.lines import continuation_prompts
    from training.corpora.packing import pack_rows, train_rows

    started = time.monotonic()
    base = base_policy(args.pretrain_steps, args.out, args.base_lines)
    train, held = code_base(Path(args.corpus))
    prompts = continuation_prompts(held, n=args.prompts, seed=args.seed)
    before = {t: accepts(base, prompts, t, args.seed) for t in (0.0, 1.0)}
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    docs = tokenizer([t for _, t in train], add_special_tokens=False)["input_ids"]
    rows = pack_rows(docs, tokenizer.eos_token_id, args.seq_len)  # (R, T)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    trained = train_rows(model, rows, lr=args.lr, batch_size=args.batch_size, seed=args.seed, seconds=args.seconds)
    after_dir = args.out / "after"
    model.save_pretrained(after_dir)
    tokenizer.save_pretrained(after_dir)
    after = {t: accepts(after_dir, prompts, t, args.seed) for t in (0.0, 1.0)}
    sample = rows[: args.batch_size * (args.compare_steps + 1)]  # the same rows for each loop
    texts = [t for _, t in train][:64]
    return {
        "corpus": args.corpus, "train_files": len(train), "heldout_files": len(held), "prompts": len(prompts),
        "corpus_tokens": int(rows.numel()), "midtrain_seconds": args.seconds, "midtrain_steps": trained["steps"],
        "loss_first": trained["loss_first"], "loss_last": trained["loss_last"],
        "heldout_accept_before": before[0.0]["accept_share"], "heldout_accept_after": after[0.0]["accept_share"],
        "heldout_accept_before_sampled": before[1.0]["accept_share"],
        "heldout_accept_after_sampled": after[1.0]["accept_share"],
        "heldout_chars_before": before[0.0]["accepted_chars"], "heldout_chars_after": after[0.0]["accepted_chars"],
        "tokens_per_s": ours_loop(base, sample, args), "plain_torch_tokens_per_s": plain_loop(base, sample, args),
        "trl_sft_tokens_per_s": None if args.no_trl else trl_loop(base, texts, args),
        "run_tokens_per_s": trained["tokens_per_s"], "threads": torch.get_num_threads(),
        "wall_s": round(time.monotonic() - started, 1),
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--trl-worker":
        trl_worker(sys.argv[2])
    else:
        main()
