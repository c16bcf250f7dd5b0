"""What the behaviour log-probs cost a serving engine step, measured alone: vLLM's engine stepped in
this process, with and without the sampled token's log-prob, in CPU time.

    .venv/bin/python bench/logprob_cost.py [--clients 16] [--steps 400] [--rounds 6] [--json]
    .venv/bin/python bench/logprob_cost.py --before ../wt-base    # another checkout's engine code too
    .venv/bin/python bench/logprob_cost.py --quick                # 2 rounds of 40 steps: that it runs

Every completion Flywheel serves is recorded with the log-prob of each token it sampled (the
behaviour policy the trainer corrects for); `vllm serve` asked for nothing sends none. This
measures that difference without HTTP, recording or a second process: the serving engine's own
vLLM settings (processed log-probs, Flywheel's scheduler and worker extension, as
inference/engines/vllm_async.py builds it) in one process on one thread (vLLM's in-process
engine core and executor), the tiny dense policy the serving bench builds, `--clients` requests
in flight at once, each replaced by the next as it ends (max_tokens in [16, 64], a seed each,
the same sequence both ways), `--steps` engine steps a round. A round runs both ways back to
back, the order swapped every round. Reported per way: CPU ms per engine step and per output
token (this process's user + system time: a busy neighbour stretches the wall clock, not this),
wall tokens/s; and the log-prob cost, the paired difference of CPU per step, as a median over the
rounds with its range, and the difference of each way's fastest round (noise only adds). And where
it falls: the wall time per step of the worker's sampler (sampling, log-probs and their gather)
and of its runner's `_bookkeeping_sync` (the step's outputs made into the lists the engine core
gets), the engine core's `update_from_output` (each request's output) and the frontend's
`process_outputs`, each timed in place, with and without; and `transport`, the worker's step
output pickled and unpickled as vLLM's shared-memory queue carries it from the worker's process to
the engine core's in the served engine (here both are in this process, so the round trip is made
in place).

With --before CHECKOUT the engine code (inference/) is also taken from that checkout, each
checkout in its own processes, the two alternating: a change's before and after.

The engine runs on the allocator this command runs on: glibc's malloc unless LD_PRELOAD names
another. The serving engine preloads tcmalloc in its processes (inference/engines/vllm_async.py
engine_preload); `LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 .venv/bin/python
bench/logprob_cost.py` measures the step as served.

With --json the last line is one JSON object: logprob_cost_us_per_step, logprob_cost_range,
logprob_cost_best_us_per_step, logprob_cost_us_per_token, cpu_ms_per_step_with / _without,
tokens_per_s_with / _without, <part>_us_per_step_with and <part>_cost_us_per_step for sampler,
runner_lists, scheduler_update, output_processor and transport (and before_* for --before).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):", "with open(path) as f:",
           "try:\n    import json", "def __init__(self):", "if __name__ == '__main__':"]
WAYS = ("with", "without")  # with: the sampled token's log-prob, held to the end as served; without: none


PARTS = {  # where asking for log-probs adds work in an engine step, timed in place
    "sampler": ("vllm.v1.sample.sampler", "Sampler", "forward"),  # the worker: sampling, log-probs, their gather
    # the worker: the step's outputs made into lists for the engine core (log-probs among them)
    "runner_lists": ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_bookkeeping_sync"),
    "scheduler_update": (None, None, "update_from_output"),  # the engine core: each request's output
    "output_processor": ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs"),  # the frontend
}
# The worker's step output on its way to the engine core: in the served engine the worker is a
# process of its own and vLLM's shared-memory queue pickles the output there and unpickles it here;
# in this one process that round trip is made in place, with the queue's pickler settings.
TRANSPORT = "transport"
PART_NAMES = (*PARTS, TRANSPORT)


def _round_trip_outputs(spent: dict[str, float]) -> None:
    """Each `Worker.sample_tokens` output pickled and unpickled as vLLM's shared-memory queue does,
    the engine core getting the unpickled copy; the round trip's wall seconds added to `spent`."""
    import copyreg
    import io
    import pickle

    import torch
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.v1.worker.gpu_worker import Worker

    table = dict(copyreg.dispatch_table)
    if hasattr(shm_broadcast, "_reduce_tensor"):  # the queue's reducer of CPU tensors
        table[torch.Tensor] = shm_broadcast._reduce_tensor
    original = Worker.sample_tokens

    def sample_tokens(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        start = time.perf_counter()
        with io.BytesIO() as bio:
            pickler = pickle.Pickler(bio, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=lambda buf: True)
            pickler.dispatch_table = table
            pickler.dump(out)
            out = pickle.loads(bio.getvalue())
        spent[TRANSPORT] = spent.get(TRANSPORT, 0.0) + time.perf_counter() - start
        return out

    Worker.sample_tokens = sample_tokens


def _time_parts(scheduler: str) -> dict[str, float]:
    """Wraps each of PARTS (the scheduler's from its import path) to add its wall seconds to the
    returned dict, by part."""
    import importlib

    spent: dict[str, float] = {}
    for part, (module, cls, method) in PARTS.items():
        if module is None:
            module, _, cls = scheduler.rpartition(".")
        owner = getattr(importlib.import_module(module), cls)
        original = getattr(owner, method)

        def timed(*args, _original=original, _part=part, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_part] = spent.get(_part, 0.0) + time.perf_counter() - start

        setattr(owner, method, timed)
    return spent


def child(folder: Path, clients: int, steps: int, rounds: int) -> dict[str, list[dict[str, float]]]:
    """In a process of its own (the checkout first on sys.path): rounds of both ways."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and its worker in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    torch.set_num_threads(1)
    from vllm import LLM
    from vllm import SamplingParams as VParams

    from inference.engines import patches
    from inference.engines.base import SamplingParams
    from inference.engines.vllm import WORKER_EXTENSION, vllm_params
    from inference.engines.vllm_async import SCHEDULER

    for name in ("patch_cpu_moe_reload", "patch_flat_sample_logprobs"):  # those the checkout has
        getattr(patches, name, lambda: None)()
    spent = _time_parts(SCHEDULER)
    _round_trip_outputs(spent)
    llm = LLM(model=str(folder), dtype="float32", seed=0, max_model_len=512, enforce_eager=True,
              logprobs_mode="processed_logprobs", disable_log_stats=True,
              worker_extension_cls=WORKER_EXTENSION, scheduler_cls=SCHEDULER)
    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]

    def params(way: str, rng: random.Random) -> VParams:
        sampling = SamplingParams(max_tokens=rng.randint(16, 64), temperature=1.0, seed=rng.randrange(2**31))
        p = vllm_params(1, sampling, final_only=True)  # what the serving engine sends
        if way == "without":
            p.logprobs, p.extra_args = None, None
        return p

    def run(way: str, count: int, seed: int) -> dict[str, float]:
        rng, made, tokens = random.Random(seed), 0, 0

        def add() -> None:
            nonlocal made
            made += 1
            engine.add_request(f"{way}-{seed}-{made}", {"prompt_token_ids": rng.choice(prompts)}, params(way, rng))

        for _ in range(clients):
            add()
        spent.clear()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(count):
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
                    add()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        parts = {f"{part}_us_per_step": seconds / count * 1e6 for part, seconds in spent.items()}
        while engine.has_unfinished_requests():
            engine.step()
        return {"cpu_ms_per_step": cpu / count * 1e3, "cpu_ms_per_token": cpu / max(tokens, 1) * 1e3,
                "tokens_per_s": tokens / wall, **parts}

    for way in WAYS:  # warm-up
        run(way, max(steps // 4, 10), seed=999)
    out: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for r in range(rounds):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            out[way].append(run(way, steps, seed=r))
    return out


def measure(checkout: Path, folder: Path, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(checkout), "--model-dir", str(folder),
           "--clients", str(args.clients), "--steps", str(args.steps), "--rounds", str(args.rounds)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the engine in {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def merge(runs: list[dict[str, list[dict[str, float]]]]) -> dict[str, list[dict[str, float]]]:
    return {way: [r for run in runs for r in run[way]] for way in WAYS}


def summary(got: dict[str, list[dict[str, float]]], clients: int) -> dict[str, float | list[float]]:
    costs = [(a["cpu_ms_per_step"] - b["cpu_ms_per_step"]) * 1e3 for a, b in zip(got["with"], got["without"], strict=True)]
    cost = statistics.median(costs)
    out: dict[str, float | list[float]] = {
        "logprob_cost_us_per_step": round(cost, 1), "logprob_cost_range": [round(min(costs), 1), round(max(costs), 1)],
        "logprob_cost_us_per_token": round(cost / clients, 2)}
    best = (min(r["cpu_ms_per_step"] for r in got["with"]) - min(r["cpu_ms_per_step"] for r in got["without"])) * 1e3
    out["logprob_cost_best_us_per_step"] = round(best, 1)  # the fastest round each way: noise only adds
    for way in WAYS:
        for key in ("cpu_ms_per_step", "cpu_ms_per_token", "tokens_per_s"):
            out[f"{key}_{way}"] = round(statistics.median(r[key] for r in got[way]), 4 if "ms" in key else 1)
    for part in PART_NAMES:
        key = f"{part}_us_per_step"
        diffs = [a[key] - b[key] for a, b in zip(got["with"], got["without"], strict=True)]
        out[f"{part}_us_per_step_with"] = round(statistics.median(r[key] for r in got["with"]), 1)
        out[f"{part}_cost_us_per_step"] = round(statistics.median(diffs), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16, help="requests in flight at once")
    parser.add_argument("--steps", type=int, default=400, help="engine steps per way and round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per checkout process")
    parser.add_argument("--before", type=Path, help="another checkout whose engine code is measured alike")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 40 steps: that the bench runs")
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        sys.path.insert(0, str(args.child))
        print(json.dumps(child(args.model_dir, args.clients, args.steps, args.rounds)))
        return
    if args.quick:
        args.steps, args.rounds = 40, 2
    sys.path.insert(0, str(ROOT))
    from training.pretrain import PolicyConfig, build_policy, stdlib_corpus

    checkouts = {"after": ROOT} if args.before is None else {"before": args.before.resolve(), "after": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_policy(Path(tmp) / "policy", PolicyConfig(kind="dense"), stdlib_corpus(2_000 if args.quick else 20_000))
        runs: dict[str, list] = {name: [] for name in checkouts}
        for turn in range(1 if args.quick or args.before is None else 2):  # checkouts alternate
            for name in (list(checkouts) if turn % 2 == 0 else list(checkouts)[::-1]):
                runs[name].append(measure(checkouts[name], folder, args))
    results = {name: summary(merge(got), args.clients) for name, got in runs.items()}
    print(f"the serving engine's step, {args.clients} requests in flight, one thread, CPU time; "
          f"log-prob cost = CPU per step with - without (median of paired rounds, range)")
    print(f"{'checkout':>8} | {'with ms/step':>12} | {'without':>8} | {'cost us/step':>12} | {'range':>13} | "
          f"{'us/token':>8} | {'tok/s with':>10} | {'without':>8}")
    for name, r in results.items():
        low, high = r["logprob_cost_range"]  # type: ignore[misc]
        print(f"{name:>8} | {r['cpu_ms_per_step_with']:12.3f} | {r['cpu_ms_per_step_without']:8.3f} | "
              f"{r['logprob_cost_us_per_step']:12.1f} | {low:6.1f}-{high:6.1f} | {r['logprob_cost_us_per_token']:8.2f} | "
              f"{r['tokens_per_s_with']:10.1f} | {r['tokens_per_s_without']:8.1f}")
    print("\nwhere the cost falls (wall µs per step, with log-probs; in brackets: with - without, median of rounds)")
    print(f"{'checkout':>8} | " + " | ".join(f"{part:>26}" for part in PART_NAMES))
    for name, r in results.items():
        print(f"{name:>8} | " + " | ".join(f"{r[f'{part}_us_per_step_with']:>12.1f} ({r[f'{part}_cost_us_per_step']:+8.1f})"
                                           + " " * 3 for part in PART_NAMES))
    if args.json:
        out = dict(results["after"])
        if "before" in results:
            out.update({f"before_{k}": v for k, v in results["before"].items()})
        print(json.dumps({**out, "clients": args.clients, "steps": args.steps, "quick": args.quick}))


if __name__ == "__main__":
    main()
