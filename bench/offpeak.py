"""Rollouts on idle serving capacity: what background rollouts cost the users, and what they yield.

    nice -n 15 .venv/bin/python bench/offpeak.py [--engine torch|vllm] [--rate 2] [--seconds 20]
        [--rounds 3] [--slots 64] [--prompts 8] [--G 8] [--hidden 256] [--layers 4] [--json] [--quick]

On a database of its own: a tiny policy in production and one real `manage.py serve_policy
--background-rollouts K` replica (it registers itself, background capacity K). This process plays
both the users and a training run:

- users: an open-loop stream of completions at `--rate` requests/s (Poisson arrivals, a seed per
  request, max_tokens in [8, 24]), the same schedule in every window, so the live load is the same
  with and without background work; each request's latency is recorded;
- the run: `training.replicas.background.ReplicaSampler` (the path a run's group rollouts take)
  asks the replica for G completions of each of `--prompts` prompts, back to back, on weights it
  pushed once (a perturbed copy of production: the run's candidate).

Windows of `--seconds` alternate, `--rounds` times: users alone, users with the run's rollouts in
the background. Then the users stop: the run's rollouts/s through the replica with no live
traffic, against a dedicated rollout worker (the torch engine a `rollouts` worker or a run samples
with, `exact=False`, in this process, the same calls), half-windows interleaved `--rounds` times.

Reported: live p50/p95 latency without and with background rollouts, and `p95_ratio` (with /
without; goal <= 1.15); background rollouts/s while users were served; idle rollouts/s on the
replica and on the dedicated worker, and `idle_rollouts_ratio` (replica / dedicated; goal >= 0.8).
With --json the last line is one JSON object.

This 2-core machine (AMD EPYC, 2026-12-07), full size, before and after the replica's idle threads
free their OpenMP teams (inference/engines/openmp.py):

    live engine   p95_ratio        idle_rollouts_ratio   replica / dedicated s a call   live p95 without
    torch         0.961 -> 0.967   0.728 -> 0.952        0.166 / 0.125 -> 0.116 / 0.118  0.275 -> 0.137 s
    vllm          1.024 -> 0.992   0.711 -> 0.944        0.172 / 0.126 -> 0.119 / 0.119  0.155 -> 0.155 s

A second run after: torch 0.886 and 0.999, vllm 1.12 and 0.937 (p95_ratio, idle_rollouts_ratio);
the vLLM p95 ratio moves by about 0.1 from run to run on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.path[:1] != [str(ROOT)]:  # first: bench/inference.py must not shadow the package
    sys.path.insert(0, str(ROOT))

from bench._django import setup_django  # noqa: E402

DB = "flywheel_bench_offpeak"
VAR = ROOT / "var" / "bench-offpeak"
TOKEN = f"bench-offpeak-{os.getpid()}"
LIVE_TIMEOUT_S = 60.0
TIMEOUTS: list[float] = []  # live requests that timed out (their latency counts as the timeout)
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):", "with open(path) as f:",
           "try:\n    import json", "def __init__(self):", "if __name__ == '__main__':", "x = [1, 2", "return (a"]


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["torch", "vllm"], default="torch", help="the replica's live engine")
    parser.add_argument("--rate", type=float, default=2.0, help="live requests per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="each window")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=64,
                        help="the replica's K: background sequences at once (64: a call of 8 prompts x G 8 is one chunk)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout call")
    parser.add_argument("--G", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="per rollout completion")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch threads of the replica and of the dedicated worker alike")
    parser.add_argument("--quick", action="store_true", help="seconds, tiny sizes (the suite's check)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.rounds, args.rate, args.prompts, args.G = 3.0, 1, 2.0, 2, 4
        args.hidden, args.layers, args.vocab = 64, 2, 1024
    return args


# --------------------------------------------------------------------------------- set-up


def _prepare(args: argparse.Namespace) -> dict:
    from feedback.models import Project
    from feedback.services import api_key_create, project_create
    from training.pretrain import PolicyConfig, build_policy, stdlib_corpus
    from training.versions.services import policy_register

    Project.objects.filter(slug="offpeak").delete()
    creds = project_create("Bench off-peak", "offpeak")
    cfg = PolicyConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                       num_heads=max(args.hidden // 64, 1), num_kv_heads=max(args.hidden // 128, 1),
                       intermediate_size=3 * args.hidden, seed=0, tokenizer_lines=20_000)
    folder = build_policy(VAR / f"policy-{args.hidden}x{args.layers}", cfg, stdlib_corpus(20_000))
    policy_register(creds.project, folder, state="production")
    return {"project": creds.project, "folder": folder, "key": api_key_create(creds.project, ["serve"], "bench")}


def _environment() -> dict[str, str]:
    """The bench's and the replica's settings (set before Django is): one checkpoint store, one token."""
    from core import embedded

    return {"DJANGO_SETTINGS_MODULE": "webapp.settings", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "FLYWHEEL_INTERNAL_TOKEN": TOKEN, "FLYWHEEL_REPLICA_HEARTBEAT_S": "1",
            "REDIS_URL": os.environ.get("REDIS_URL") or embedded.redis_url(),
            "FLYWHEEL_CHECKPOINT_DIR": str(VAR / "checkpoints"), "CELERY_KEY_PREFIX": f"bench-offpeak-{os.getpid()}:"}


def _start_replica(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    from tests.processes import free_port, wait_http

    port, internal = free_port(), free_port()
    VAR.mkdir(parents=True, exist_ok=True)
    log = open(VAR / "replica.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "serve_policy", "--project", "offpeak", "--port", str(port),
         "--internal-port", str(internal), "--engine", args.engine, "--no-record",
         "--background-rollouts", str(args.slots)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/healthz", proc, 900, VAR / "replica.log")
    return proc, url


# --------------------------------------------------------------------------------- the users


def schedule(rate: float, seconds: float, seed: int) -> list[tuple[float, int, int]]:
    """(send at, max_tokens, seed) of each request: Poisson arrivals, the same for every window."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append((t, rng.randint(8, 24), rng.randrange(2**31)))


async def _users(url: str, key: str, plan: list[tuple[float, int, int]]) -> list[float]:
    import httpx

    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=LIVE_TIMEOUT_S, headers={"Authorization": f"Bearer {key}"}) as http:
        start = time.perf_counter()

        async def one(at: float, max_tokens: int, seed: int) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = time.perf_counter()
            try:
                response = await http.post(url + "/v1/completions", json={
                    "model": "offpeak", "prompt": PROMPTS[seed % len(PROMPTS)], "max_tokens": max_tokens, "seed": seed})
                response.raise_for_status()
            except httpx.TimeoutException:  # an overloaded replica (a shared machine): counted at the timeout
                TIMEOUTS.append(at)
            latencies.append(time.perf_counter() - sent)

        await asyncio.gather(*(one(*p) for p in plan))
    return latencies


# --------------------------------------------------------------------------------- the run


class Background:
    """The run's rollout calls on the replica, back to back on a thread, until stopped."""

    def __init__(self, sampler, prompts: list[list[int]], args: argparse.Namespace, state) -> None:
        from inference.engines import SamplingParams

        self.sampler, self.prompts, self.G, self.state = sampler, prompts, args.G, state
        self.sampling = SamplingParams(max_tokens=args.max_tokens, seed=1)
        self.rows, self.calls = 0, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def call(self) -> int:
        out = self.sampler.generate(self.prompts, self.G, self.sampling, weights="bench-candidate",
                                    state=self.state, version=1)
        self.calls += 1
        self.rows += len(out)
        return len(out)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.call()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _rate(work, seconds: float) -> float:
    """Rows per second of `work()` (returns rows) called back to back for about `seconds`."""
    rows, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        rows += work()
    return rows / (time.perf_counter() - start)


# --------------------------------------------------------------------------------- the bench


def run(args: argparse.Namespace) -> dict:
    from inference.engines import make_engine
    from training.models import ServingReplica
    from training.pretrain import perturbed_state_dict
    from training.replicas.background import ReplicaSampler

    state = _prepare(args)
    proc, url = _start_replica(args)
    try:
        deadline = time.monotonic() + 120
        while not ServingReplica.objects.filter(project=state["project"], background_slots__gt=0).exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the replica did not register; see {VAR / 'replica.log'}")
            time.sleep(0.2)
        import torch

        torch.set_num_threads(args.threads)  # as the replica's OMP_NUM_THREADS: the same threads on both sides
        dedicated = make_engine("torch", state["folder"], version=1, exact=False)
        candidate = perturbed_state_dict(state["folder"], scale=0.05, seed=3)
        dedicated.load_weights(candidate, 1)  # the run's candidate, on both sides
        prompts = [dedicated.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.prompts)]
        sampler = ReplicaSampler.setup(state["project"].pk, dedicated)
        assert sampler is not None
        sampler.deadline_s = 600.0  # the bench measures the replica: nothing comes back to this process
        bg = Background(sampler, prompts, args, candidate)
        bg.call()  # pushes the weights, warms the replica's background engine
        plan = schedule(args.rate, args.seconds, seed=7)
        asyncio.run(_users(url, state["key"], plan[:8]))  # warm the live path
        return _measure(args, url, state, bg, dedicated, plan)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _measure(args, url, state, bg: Background, dedicated, plan) -> dict:
    alone: list[float] = []
    shared: list[float] = []
    rows_live, seconds_live = 0, 0.0
    for _ in range(args.rounds):
        alone += asyncio.run(_users(url, state["key"], plan))
        before, start = bg.rows, time.perf_counter()
        bg.start()
        shared += asyncio.run(_users(url, state["key"], plan))
        bg.stop()
        rows_live, seconds_live = rows_live + bg.rows - before, seconds_live + time.perf_counter() - start
    def own() -> int:
        return len(dedicated.generate(bg.prompts, n=bg.G, sampling=bg.sampling))

    own()  # builds its fused decoder, as bg.call() warmed the replica's
    replica_rates, dedicated_rates, own_s = [], [], []

    def timed_own() -> int:
        start = time.perf_counter()
        rows = own()
        own_s.append(time.perf_counter() - start)
        return rows

    first_call = len(bg.sampler.calls)
    for _ in range(args.rounds):  # interleaved: both see the same machine load
        replica_rates.append(_rate(bg.call, args.seconds / 2))
        dedicated_rates.append(_rate(timed_own, args.seconds / 2))
    on_replica, on_dedicated = statistics.fmean(replica_rates), statistics.fmean(dedicated_rates)
    idle_calls = bg.sampler.calls[first_call:]
    per_call = {"round_trip_s": statistics.median(c["round_trip_s"] for c in idle_calls),
                "replica_sampled_s": statistics.median(c["sampled_s"] for c in idle_calls),
                "dedicated_s": statistics.median(own_s)}
    per_call["http_json_s"] = per_call["round_trip_s"] - per_call["replica_sampled_s"]
    p95 = {name: _p(xs, 95) for name, xs in (("alone", alone), ("shared", shared))}
    return {
        "engine": args.engine, "rate": args.rate, "requests_per_window": len(plan), "slots": args.slots,
        "live_p50_s_without": round(_p(alone, 50), 4), "live_p95_s_without": round(p95["alone"], 4),
        "live_p50_s_with": round(_p(shared, 50), 4), "live_p95_s_with": round(p95["shared"], 4),
        "p95_ratio": round(p95["shared"] / p95["alone"], 3),
        "background_rollouts_per_s_under_live": round(rows_live / seconds_live, 2),
        "idle_rollouts_per_s_replica": round(on_replica, 2), "idle_rollouts_per_s_dedicated": round(on_dedicated, 2),
        "idle_rollouts_ratio": round(on_replica / on_dedicated, 3),
        "per_call": {k: round(v, 4) for k, v in per_call.items()}, "rows_per_call": len(bg.prompts) * bg.G,
        "push": _pushes(bg), "load_avg": round(os.getloadavg()[0], 1),
        "live_timeouts": len(TIMEOUTS), "given_back": bg.sampler.given_back, "replica_errors": bg.sampler.errors[:3],
    }


def _pushes(bg: Background, rounds: int = 3) -> dict:
    """A run's later rounds: each pushes weights one small training step away from the last
    (every weight moved by 1e-4 of its tensor's spread, as an AdamW step does), as a delta; the
    first push of the call before was the whole set."""
    import torch

    whole = next(c for c in bg.sampler.calls if c["push_bytes"])
    gen, state, deltas = torch.Generator().manual_seed(5), {k: v.clone() for k, v in bg.state.items()}, []
    for r in range(rounds):
        for v in state.values():
            v.add_(torch.randn(v.shape, generator=gen) * 1e-4 * (float(v.std()) + 1e-3))
        bg.sampler.generate(bg.prompts[:1], 1, bg.sampling, weights=f"bench-round-{r}", state=state, version=1)
        deltas.append(bg.sampler.calls[-1])
    return {"whole_bytes": int(whole["push_bytes"]), "whole_s": round(whole["push_s"], 3),
            "delta_bytes": int(statistics.median(d["push_bytes"] for d in deltas)),
            "delta_s": round(statistics.median(d["push_s"] for d in deltas), 3)}


def _p(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs[0] if xs else 0.0)


def print_table(r: dict) -> None:
    print(f"live load: {r['rate']} req/s open-loop ({r['requests_per_window']} per window), engine {r['engine']}, "
          f"K = {r['slots']}")
    print(f"{'':34}{'without':>10}{'with':>10}{'ratio':>8}")
    print(f"{'live p50 (s)':34}{r['live_p50_s_without']:>10}{r['live_p50_s_with']:>10}")
    print(f"{'live p95 (s)':34}{r['live_p95_s_without']:>10}{r['live_p95_s_with']:>10}{r['p95_ratio']:>8}  (goal <= 1.15)")
    print(f"{'background rollouts/s under live':34}{'':>10}{r['background_rollouts_per_s_under_live']:>10}")
    print(f"{'idle rollouts/s':34}{'replica':>10}{'dedicated':>10}")
    print(f"{'':34}{r['idle_rollouts_per_s_replica']:>10}{r['idle_rollouts_per_s_dedicated']:>10}"
          f"{r['idle_rollouts_ratio']:>8}  (goal >= 0.8)")
    c = r["per_call"]
    print(f"one call of {r['rows_per_call']} rollouts, idle (median s): round trip {c['round_trip_s']}, of which the "
          f"replica sampled {c['replica_sampled_s']} and HTTP/JSON/queue {c['http_json_s']:.4f}; dedicated {c['dedicated_s']}")
    p = r["push"]
    print(f"weights push per round: whole {p['whole_bytes']:,} B in {p['whole_s']} s; delta {p['delta_bytes']:,} B "
          f"in {p['delta_s']} s (machine load {r['load_avg']})")
    if r["given_back"] or r["replica_errors"] or r["live_timeouts"]:
        print(f"given back: {r['given_back']}, errors: {r['replica_errors']}, live timeouts: {r['live_timeouts']}")


def main() -> None:
    args = _args()
    os.environ.update(_environment())
    setup_django(DB)
    result = run(args)
    print_table(result)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
