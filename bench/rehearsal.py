"""A realistic-size rehearsal: a Qwen2-0.5B-shaped policy (random weights built offline from a
config: the real vocabulary of 151936, 24 layers, hidden 896, tied embeddings; no model hub) goes
through the product's own services, phase by phase, on this machine:

  build     the policy folder (a tokenizer trained on the standard library; weights in bf16, as Qwen ships)
  register  `policy_register` as the project's production (the checkpoint store's full snapshot)
  data      8 live trajectories with feedback through `feedback_ingest`, rewarded
  train     a LoRA run (`training_run_start` + `train_policy`, rank 8 on q/v, a few steps, `precision`)
  gate      `gate_run` on a small suite (4 prompts x 2 samples, 8 tokens) against production
  serve     an engine on production's weights (`make_engine`, torch or vLLM)
  hot_swap  the candidate loaded into that engine without a restart (`load_weights`: the merged
            version's folder for the torch engine, the PEFT adapter folder for vLLM with LoRA),
            then one generate from it

Each phase's seconds and the process's peak RSS after it (GiB) are printed; `hot_swap_s` is the
adapter hot-load (goals: <= 5 s for the 0.5B shape, <= 1 s for the demo policy, `--shape demo`).

    .venv/bin/python bench/rehearsal.py --json                  # the 0.5B shape, torch engine, CPU
    .venv/bin/python bench/rehearsal.py --shape demo --json     # the demo policy's shape
    .venv/bin/python bench/rehearsal.py --quick --json          # a tiny shape, seconds
    bench/gpu_check.sh                                          # the same on a GPU with vLLM's CUDA build

Runs on a database of its own (bench/_django.py) and a temporary checkpoint folder.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._django import setup_django  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2-0.5B's config.json, less the hub: 494M parameters.
    "qwen2-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                       tie_word_embeddings=True, rms_norm_eps=1e-6),
    # The demo's policy (training.pretrain.PolicyConfig's default).
    "demo": dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False),
    # --quick: the tests' tiny policy.
    "tiny": dict(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False),
}
PROMPTS = ["def add(a, b):", "import os", "class Node:", "for i in range("]
COMPLETIONS = [" return a + b", "\nimport sys", "\n    pass", "10):\n    print(i)"]


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


class Phases:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        value = fn()
        self.rows.append({"phase": name, "s": time.perf_counter() - start, "peak_rss_gib": peak_rss_gib()})
        print(f"{name:<10}{self.rows[-1]['s']:>10.2f} s{self.rows[-1]['peak_rss_gib']:>10.2f} GiB", flush=True)
        return value


def build(folder: Path, shape: dict[str, Any], dtype: str) -> Path:
    """A random-weight policy of `shape`, saved with a tokenizer trained on the standard library."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from training.pretrain import EOS, save_policy, stdlib_corpus, train_tokenizer

    tokenizer = train_tokenizer(stdlib_corpus(3000), min(shape["vocab_size"], 4096))
    eos = tokenizer.convert_tokens_to_ids(EOS)
    config = Qwen2Config(**shape, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, dtype=dtype)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))  # HF's init: N(0, 0.02), norms at 1
    save_policy(folder, model, tokenizer)
    return folder


def setup_project(slug: str) -> Any:
    from feedback.services import project_create
    from training.models import EvalSuite
    from training.promotion.services import gate_policy_update
    from training.rewards.checks import Check, CheckResult, register_check
    from training.rewards.services import reward_spec_update

    @register_check("rehearsal_length")
    class Length(Check):
        """A completion's length, capped: something for the gate's suite to score."""

        def run(self, completion: str, context: Any = None) -> CheckResult:
            return CheckResult(min(len(completion), 20) / 20, "length")

    creds = project_create(f"Rehearsal {slug}", slug)
    reward_spec_update(creds.project, judge={}, aspects=[], settle_seconds=0)
    EvalSuite.objects.create(project=creds.project, version=1, prompts=[{"id": f"p{i}", "prompt": p}
                             for i, p in enumerate(PROMPTS)], checks=[{"name": "rehearsal_length", "weight": 1.0}],
                             judge={}, aspects=[], n_samples=2, max_tokens=8)
    gate_policy_update(creds.project, "system:rehearsal", "rehearsal: a random policy; the gate's mechanics, not its bar",
                       thresholds={"margin": -10.0, "kl_budget": 1e6, "aspect_tolerance": 10.0,
                                   "length_ratio_max": 100.0, "repeated_ngram_jump_max": 10.0,
                                   "min_median_chars": None})
    return creds.project


def ingest(project: Any, folder: Path) -> list[int]:
    from datetime import timedelta

    from django.utils import timezone

    from feedback.models import Trajectory
    from feedback.services import feedback_ingest
    from training.pretrain import load_tokenizer
    from training.rewards.services import rewards_compute_pending

    tok = load_tokenizer(folder)
    events: list[dict[str, Any]] = []
    for i in range(8):
        text = COMPLETIONS[i % len(COMPLETIONS)]
        events.append({"type": "trajectory", "id": f"t-{i}", "policy_version": 1, "task": "tab-completion",
                       "prompt": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                       "steps": [{"role": "assistant", "content": text,
                                  "token_ids": tok.encode(text, add_special_tokens=False)}],
                       "occurred_at": timezone.now().isoformat()})
        events.append({"type": "feedback", "id": f"fb-{i}", "trajectory_id": f"t-{i}",
                       "signal": "accept" if i % 2 == 0 else "reject", "user": "u-1",
                       "occurred_at": timezone.now().isoformat()})
    feedback_ingest(project, events)
    rewards_compute_pending(project, now=timezone.now() + timedelta(seconds=1))
    return list(Trajectory.objects.filter(project=project).values_list("pk", flat=True))


def train(project: Any, ids: list[int], args: argparse.Namespace) -> Any:
    from training.runs.services import train_policy, training_run_start
    from training.runs.settings import RunSettings

    settings = RunSettings.from_dict({"steps": args.steps, "batch_size": 4, "rl": {"lr": 1e-4},
                                      "adapter": {"kind": "lora", "rank": 8}, "precision": args.precision,
                                      "trajectory_ids": ids})
    run, _ = training_run_start(project, settings, enqueue=False)
    run = train_policy(run.pk)
    if run.state != "succeeded":
        raise RuntimeError(f"the LoRA run failed: {run.error}")
    return run


def engine_for(production: Any, args: argparse.Namespace) -> Any:
    from inference.engines import make_engine
    from training.versions.services import policy_folder

    if args.engine == "vllm":
        return make_engine("vllm", policy_folder(production), version=production.number, dtype=args.vllm_dtype,
                           max_model_len=256, enable_lora=True, max_lora_rank=8, max_loras=2)
    return make_engine("torch", policy_folder(production), version=production.number)


def hot_swap(engine: Any, candidate: Any, args: argparse.Namespace) -> dict[str, Any]:
    from inference.engines import SamplingParams
    from training.versions.services import policy_adapter_folder, policy_folder

    source = policy_adapter_folder(candidate) if args.engine == "vllm" else policy_folder(candidate)
    start = time.perf_counter()
    engine.load_weights(source, candidate.number)
    loaded = time.perf_counter() - start
    [done] = engine.generate([PROMPTS[0]], n=1, sampling=SamplingParams(max_tokens=8, seed=0))
    return {"load_s": loaded, "served_version": done.version, "tokens": len(done.token_ids)}


def rehearse(args: argparse.Namespace) -> dict[str, Any]:
    from django.conf import settings as django_settings

    from training.gate.services import gate_run
    from training.versions.services import policy_register

    work = Path(tempfile.mkdtemp(prefix="flywheel-rehearsal-"))
    django_settings.FLYWHEEL_CHECKPOINT_DIR = work / "checkpoints"
    django_settings.FLYWHEEL_GATE_ENGINE = args.engine if args.engine == "torch" else django_settings.FLYWHEEL_GATE_ENGINE
    phases = Phases()
    folder = phases.run("build", lambda: build(work / "policy", SHAPES[args.shape], args.dtype))
    project = setup_project(f"rehearsal-{os.getpid()}-{int(time.time())}")
    production = phases.run("register", lambda: policy_register(project, folder, state="production",
                                                                config={"kind": "dense"}))
    ids = phases.run("data", lambda: ingest(project, folder))
    run = phases.run("train", lambda: train(project, ids, args))
    candidate = run.candidate
    report = phases.run("gate", lambda: gate_run(candidate.id, actor="system:rehearsal"))
    engine = phases.run("serve", lambda: engine_for(production, args))
    swap = phases.run("hot_swap", lambda: hot_swap(engine, candidate, args))
    engine.close()
    if swap["served_version"] != candidate.number:
        raise RuntimeError(f"the engine answered as v{swap['served_version']}, not the candidate v{candidate.number}")
    params = _params(folder)
    return {"shape": args.shape, "engine": args.engine, "precision": run.result.get("precision"),
            "params": params, "phases": {r["phase"]: round(r["s"], 3) for r in phases.rows},
            "peak_rss_gib": round(max(r["peak_rss_gib"] for r in phases.rows), 3),
            "peak_rss_after": {r["phase"]: round(r["peak_rss_gib"], 3) for r in phases.rows},
            "hot_swap_s": round(swap["load_s"], 3), "adapter_ratio": round(1 / candidate.delta_ratio, 1),
            "gate_passed": report.passed, "steps": run.result.get("steps"), "work": str(work)}


def _params(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.add_argument("--quick", action="store_true", help="the tests' tiny shape: seconds")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    parser.add_argument("--engine", choices=["torch", "vllm"], default="torch", help="the serving engine")
    parser.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's compute dtype (--engine vllm)")
    parser.add_argument("--dtype", default="bfloat16", help="the built policy's stored dtype")
    parser.add_argument("--precision", default="auto", choices=["fp32", "bf16", "auto"], help="the LoRA run's")
    parser.add_argument("--steps", type=int, default=2, help="the LoRA run's optimiser steps")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (weights, checkpoints)")
    args = parser.parse_args()
    if args.quick:
        args.shape = "tiny"
    setup_django("flywheel_bench_rehearsal")
    load = os.getloadavg()[0]
    out = rehearse(args)
    if not args.keep:
        import shutil

        shutil.rmtree(out["work"], ignore_errors=True)
    print(f"\n{out['shape']} ({out['params'] / 1e6:.1f}M params), engine {out['engine']}, precision {out['precision']}; "
          f"load average {load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"peak RSS {out['peak_rss_gib']:.2f} GiB; adapter hot-load {out['hot_swap_s']:.2f} s; "
          f"adapter {out['adapter_ratio']:.0f}x smaller than its base; gate passed: {out['gate_passed']}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
