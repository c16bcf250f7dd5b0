"""Tokens/s of one full RL step, ours vs TRL's GRPOTrainer, on the same tiny model and lengths.

A full step: generate G samples for each of P prompts, score them, loss, backward, optimiser.
Same model (a ~0.6M-parameter Qwen2 built offline), same lengths (prompts of 30 tokens, exactly
24 completion tokens), same reward function, one intra-op thread, median of >= 5 steps after
warm-up. Also: the update-only part of each and a plain torch forward+backward+AdamW baseline,
and the throughput of async (rollouts overlapped with training, one step off-policy) vs sync.

TRL runs in its own venv under var/bench-trl-venv (made on first use: the shared venv's packages
through a .pth file, plus trl==1.16.0), as a subprocess of this script, so the project's pinned
environment is never changed.

    .venv/bin/python bench/rl_step.py            # table
    .venv/bin/python bench/rl_step.py --json     # table, then one JSON line last
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TRL_VENV = ROOT / "var" / "bench-trl-venv"
TRL_VERSION = "1.16.0"
MODEL = dict(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
             max_position=128, tokenizer_lines=20_000)


def reward_of(text: str) -> float:
    """The same toy reward for both trainers: share of letters in the completion."""
    return sum(c.isalpha() for c in text) / max(len(text), 1)


# ----------------------------------------------------------------------------------- setup


def build_model(folder: Path) -> Path:
    from inference.policies import PolicyConfig, build_policy, stdlib_corpus

    if not (folder / "config.json").exists():
        build_policy(folder, PolicyConfig(**MODEL), stdlib_corpus(MODEL["tokenizer_lines"]))
    return folder


def make_prompts(folder: Path, n: int, length: int) -> list[list[int]]:
    """n prompts of exactly `length` tokens whose decode/encode round trip is stable (TRL re-tokenises)."""
    from inference.policies import load_tokenizer, stdlib_corpus

    tok = load_tokenizer(folder)
    out: list[list[int]] = []
    for line in stdlib_corpus(5000)[1000:]:
        ids = tok.encode(line * 4, add_special_tokens=False)[:length]
        if len(ids) == length and tok.encode(tok.decode(ids), add_special_tokens=False) == ids:
            out.append(ids)
        if len(out) == n:
            return out
    raise RuntimeError("not enough stable prompts")


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


# ----------------------------------------------------------------------------------- ours


class Ours:
    def __init__(self, folder: Path, prompts: list[list[int]], G: int, completion: int, lr: float) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from inference.engine import SamplingParams, make_engine
        from training.rl.config import RLConfig

        self.prompts, self.G = prompts, G
        self.engine = make_engine("torch", folder, seed=0)
        self.sampling = SamplingParams(max_tokens=completion, temperature=1.0, ignore_eos=True)
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).train()
        self.cfg = RLConfig(lr=lr, micro_batch_size=len(prompts) * G, beta=0.0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.pad = self.engine.tokenizer.pad_token_id or 0
        self.seed = 0

    def rollout(self, version: int = 0) -> list[Any]:
        from dataclasses import replace

        self.seed += 1
        return self.engine.generate(self.prompts, n=self.G, sampling=replace(self.sampling, seed=self.seed))

    def batch(self, completions: list[Any], version: int = 0) -> Any:
        from training.rl.trainer import Sample, prepare_batch

        samples = [Sample(c.prompt_token_ids, c.token_ids, reward_of(c.text), c.logprobs, version, c.prompt_index)
                   for c in completions]
        return prepare_batch(samples, version, self.cfg, self.pad)

    def update(self, batch: Any) -> Any:
        from training.rl.trainer import rl_step

        return rl_step(self.model, None, batch, self.opt, self.cfg)

    def sync_weights(self, version: int) -> None:
        self.engine.load_weights({k: v.detach().clone() for k, v in self.model.state_dict().items()}, version)


def plain_update(model: Any, batch: Any, opt: Any) -> None:
    """The floor: forward, selected log-probs x advantages, backward, AdamW; no RL bookkeeping."""
    import torch

    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    logp = torch.log_softmax(out[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]  # (B, T-1)
    mask = batch.completion_mask[:, 1:].float()
    loss = -(logp * batch.advantages[:, None] * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def bench_ours(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    ours = Ours(folder, prompts, args.G, args.completion, args.lr)
    full, update, plain, tokens = [], [], [], 0
    for i in range(args.warmup + args.steps):
        t_full, (t_update, batch) = timed(lambda: _full_step(ours))
        t_plain, _ = timed(lambda b=batch: plain_update(ours.model, b, ours.opt))
        if i >= args.warmup:
            full.append(t_full)
            update.append(t_update)
            plain.append(t_plain)
        tokens = int(batch.attention_mask.sum())
    del torch
    return {"tokens": tokens, "full_s": statistics.median(full), "update_s": statistics.median(update),
            "plain_s": statistics.median(plain)}


def _full_step(ours: Ours) -> tuple[float, Any]:
    batch = ours.batch(ours.rollout())
    t_update, _ = timed(lambda: ours.update(batch))
    return t_update, batch


def bench_async(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, float]:
    """Rollouts+training for `steps` iterations: sync (generate, then train) vs async (a rollout
    thread generates batch k+1 while batch k trains), one intra-op thread per computation. Sync
    with 2 intra-op threads is not the fairer baseline here: at these sizes OpenMP's spin-waits
    on a shared 2-core machine make it slower than one thread."""
    import torch

    n = args.warmup + args.steps
    torch.set_num_threads(1)
    ours = Ours(folder, prompts, args.G, args.completion, args.lr)
    ours.update(ours.batch(ours.rollout()))  # warm-up
    t_sync, tokens = timed(lambda: _sync_loop(ours, n))
    torch.set_num_threads(1)
    ours = Ours(folder, prompts, args.G, args.completion, args.lr)
    ours.update(ours.batch(ours.rollout()))
    t_async, _ = timed(lambda: _async_loop(ours, n))
    torch.set_num_threads(1)
    return {"sync_tokens_per_s": tokens / t_sync, "async_tokens_per_s": tokens / t_async}


def _sync_loop(ours: Ours, n: int) -> int:
    tokens = 0
    for v in range(n):
        batch = ours.batch(ours.rollout(), v)
        ours.update(batch)
        ours.sync_weights(v + 1)
        tokens += int(batch.attention_mask.sum())
    return tokens


def _async_loop(ours: Ours, n: int) -> int:
    import queue

    import torch

    ready: queue.Queue[Any] = queue.Queue(maxsize=1)

    def produce() -> None:
        torch.set_num_threads(1)
        for _ in range(n):
            ready.put(ours.rollout())  # blocks while the trainer is a full batch behind

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    tokens = 0
    for v in range(n):
        # The batch was sampled by the weights of one step ago at most: max_staleness covers it and
        # the truncated importance weight corrects for it.
        batch = ours.batch(ready.get(), v)
        ours.update(batch)
        ours.sync_weights(v + 1)
        tokens += int(batch.attention_mask.sum())
    thread.join()
    return tokens


# ----------------------------------------------------------------------------------- TRL


def trl_python() -> Path:
    """var/bench-trl-venv: the shared venv's packages (a .pth) plus TRL; built on first use."""
    python = TRL_VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", f"import trl; assert trl.__version__ == '{TRL_VERSION}'"],
                                          capture_output=True).returncode == 0:
        return python
    print(f"building {TRL_VENV} with trl=={TRL_VERSION} (once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    shared = subprocess.run([sys.executable, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                            capture_output=True, text=True).stdout.strip()
    Path(site, "_flywheel_shared.pth").write_text(shared + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}"], check=True)
    return python


def bench_trl(folder: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({**vars(args), "folder": str(folder), "prompt_ids": prompts}, fh)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([trl_python(), __file__, "--trl-worker", fh.name], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    os.unlink(fh.name)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL part failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def trl_worker(config_path: str) -> None:
    """Runs inside the TRL venv: GRPOTrainer for warm-up + N steps, times each step and its
    generate-and-score part (the rest is the update)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from inference.policies import load_tokenizer

    torch.set_num_threads(1)
    c = json.loads(Path(config_path).read_text())
    tok = load_tokenizer(c["folder"])
    data = Dataset.from_dict({"prompt": [tok.decode(p) for p in c["prompt_ids"]] * 1000})
    n_seq = len(c["prompt_ids"]) * c["G"]
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=n_seq, num_generations=c["G"],
        max_completion_length=c["completion"], generation_kwargs={"min_new_tokens": c["completion"]},
        learning_rate=c["lr"], beta=0.0, max_steps=c["warmup"] + c["steps"], use_cpu=True, report_to="none",
        logging_steps=1, save_strategy="no", shuffle_dataset=False, temperature=1.0, bf16=False,
        disable_tqdm=True, seed=0,
    )
    trainer = GRPOTrainer(model=c["folder"], reward_funcs=lambda completions, **kw: [reward_of(t) for t in completions],
                          args=cfg, train_dataset=data, processing_class=tok)
    gen_times: list[float] = []
    original = trainer._generate_and_score_completions

    def gen_and_score(*a: Any, **kw: Any) -> Any:
        t, out = timed(lambda: original(*a, **kw))
        gen_times.append(t)
        return out

    trainer._generate_and_score_completions = gen_and_score
    step_times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            step_times.append(time.perf_counter() - self.t)

    trainer.add_callback(Clock())
    trainer.train()
    w = c["warmup"]
    full, gen = step_times[w:], gen_times[w : w + len(step_times[w:])]
    tokens = n_seq * (len(c["prompt_ids"][0]) + c["completion"])
    print(json.dumps({"tokens": tokens, "full_s": statistics.median(full),
                      "update_s": statistics.median([f - g for f, g in zip(full, gen, strict=True)])}))


# ----------------------------------------------------------------------------------- report


def report(ours: dict[str, Any], trl: dict[str, Any], overlap: dict[str, float], args: argparse.Namespace) -> dict:
    rows = [
        ("ours: full step", ours["tokens"], ours["full_s"]),
        ("TRL GRPOTrainer: full step", trl["tokens"], trl["full_s"]),
        ("ours: update only", ours["tokens"], ours["update_s"]),
        ("TRL: update only", trl["tokens"], trl["update_s"]),
        ("plain torch fwd+bwd+AdamW", ours["tokens"], ours["plain_s"]),
    ]
    print(f"RL step: {args.prompts} prompts x G={args.G}, {args.prompt_len}+{args.completion} tokens, "
          f"median of {args.steps} steps after {args.warmup} warm-up, 1 thread")
    print(f"{'part':<30}{'tokens':>8}{'s/step':>10}{'tokens/s':>12}")
    for name, tokens, seconds in rows:
        print(f"{name:<30}{tokens:>8}{seconds:>10.3f}{tokens / seconds:>12,.0f}")
    result = {
        "ours_tokens_per_s": ours["tokens"] / ours["full_s"], "trl_tokens_per_s": trl["tokens"] / trl["full_s"],
        "speedup": (ours["tokens"] / ours["full_s"]) / (trl["tokens"] / trl["full_s"]),
        "ours_update_tokens_per_s": ours["tokens"] / ours["update_s"],
        "trl_update_tokens_per_s": trl["tokens"] / trl["update_s"],
        "update_vs_plain": ours["update_s"] / ours["plain_s"],
        "sync_tokens_per_s": overlap["sync_tokens_per_s"], "async_tokens_per_s": overlap["async_tokens_per_s"],
        "async_speedup": overlap["async_tokens_per_s"] / overlap["sync_tokens_per_s"],
    }
    print(f"speedup ours/TRL full step: {result['speedup']:.2f}x; our update / plain torch: "
          f"{result['update_vs_plain']:.2f}x")
    print(f"rollouts+training: sync {result['sync_tokens_per_s']:,.0f} tokens/s, async "
          f"{result['async_tokens_per_s']:,.0f} tokens/s ({result['async_speedup']:.2f}x)")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=30)
    parser.add_argument("--completion", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--model-dir", default=str(ROOT / "var" / "bench-rl-model"))
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    import torch

    folder = build_model(Path(args.model_dir))
    prompts = make_prompts(folder, args.prompts, args.prompt_len)
    trl = bench_trl(folder, prompts, args)
    torch.set_num_threads(1)
    ours = bench_ours(folder, prompts, args)
    overlap = bench_async(folder, prompts, args)
    result = report(ours, trl, overlap, args)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
