"""Serving under concurrent clients: Flywheel's serving process against vLLM's own OpenAI server.

    nice -n 19 .venv/bin/python bench/serving.py [--model-dir DIR] [--seconds 6] [--json]
        [--no-serial] [--baseline CHECKOUT] [--clients 16 64] [--adapter-rounds 0] [--vllm-serve-tcmalloc]
        [--vllm-serve-logprobs]
    .venv/bin/python bench/serving.py --quick    # ours on the torch engine, 1 and 2 clients, 1 s: that it runs

The same tiny policy (the dense one the tests build, fp32, max_model_len 512, eager, 1 GiB of KV
cache) is served three ways, all up at once and driven in turn (interleaved, the order rotating
each round, so each system sees the same machine load):

- ours:   `manage.py serve_policy --engine vllm` (vLLM's async engine, continuous batching),
          recording every completion as a trajectory in PostgreSQL;
- vllm:   `python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs), default settings
          but the shared ones (VLLM_CPU_KVCACHE_SPACE=1 --gpu-memory-utilization 0.2 --enforce-eager);
          ours preloads tcmalloc in its engine processes, as vLLM's CPU guide says; `vllm serve` is
          started as a user starts it, without, unless --vllm-serve-tcmalloc (like for like); its
          clients ask for no log-probs (ours records each sampled token's for every completion)
          unless --vllm-serve-logprobs (logprobs=true, top_logprobs=0: like for like in the work done);
- serial: `serve_policy --serial` (one request at a time, in-process vLLM; recording on): the
          reference column (--no-serial leaves it out: at 64 clients it takes minutes);
- baseline (with --baseline CHECKOUT): `serve_policy` as another checkout of Flywheel has it (e.g.
          `git worktree add /tmp/base main`), driven in the same rounds: a change's before/after
          under the same machine load.

Load: the `openai` client (AsyncOpenAI), C concurrent clients (1, 4, 16, 64), each sending chat
completions back to back for `--seconds`, max_tokens drawn in [16, 64] and a seed per request
(the same sequence for every system). Reported: output tokens/s (completion tokens over wall
time) and p50/p95 request latency, requests left unanswered (a lost connection or a 5xx: counted
and shown with the first one's error, not retried, so one does not end a long run), and where the
CPU went per output token (the server process, vLLM's engine processes, PostgreSQL). With --json the last line is one JSON object with
ours_tokens_per_s_C, vllm_serve_tokens_per_s_C, serial_tokens_per_s_C, *_p50_s_C, *_p95_s_C, *_errors_C,
and per level C: ratio_C (ours / vllm throughput: the median of the rounds' paired ratios, with
ratio_range_C), p95_ratio_C (ours / vllm p95 over all rounds' requests) and engine_cpu_ratio_C (ours /
vllm engine CPU per output token) (and baseline_* for the baseline checkout), and the adapter side's
adapter_tokens_per_s_C, merged_tokens_per_s_C, adapter_ratio_C (bench/serving_adapters.py: two LoRA
adapters, production + canary, on one engine vs one merged model, the median of --adapter-rounds
paired rounds; --adapters runs it alone). `--quick` serves ours alone
on the torch engine (vLLM and its server are left out, and it says so), 1 and 2 clients, 1 s each.
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
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.path[:1] != [str(ROOT)]:  # first: bench/inference.py must not shadow the package
    sys.path.insert(0, str(ROOT))

from bench._django import setup_django  # noqa: E402
from bench.serving_adapters import adapter_side, adapter_summary, print_adapter_table, settle  # noqa: E402

BENCH_DB = "flywheel_bench_serving"
VLLM_SERVE_VENV = ROOT / "var" / "bench-vllm-serve-venv"
LEVELS = (1, 4, 16, 64)
SYSTEMS = ("ours", "vllm_serve", "serial")  # and "baseline" with --baseline
MAX_MODEL_LEN = 512
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):", "with open(path) as f:",
           "try:\n    import json", "def __init__(self):", "if __name__ == '__main__':"]


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds by part: frontend, engine, db
    rates: list[float] = field(default_factory=list)  # tokens/s of each round added, in order
    errors: list[str] = field(default_factory=list)  # requests that got no answer (connection lost, a 5xx)

    def add(self, other: Run) -> None:
        self.rates.append(other.tokens_per_s())
        self.errors += other.errors
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.latencies += other.latencies
        for part, seconds in other.cpu.items():
            self.cpu[part] = self.cpu.get(part, 0.0) + seconds

    def cpu_ms_per_token(self, part: str) -> float:
        return 1000 * self.cpu.get(part, 0.0) / max(self.tokens, 1)

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def quantile(self, q: float) -> float:
        if len(self.latencies) < 2:
            return self.latencies[0] if self.latencies else 0.0
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[round(q * 100) - 1]


# ----------------------------------------------------------------------------------- servers


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, seconds: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {seconds} s")


def _env() -> dict[str, str]:
    # The clients send back to back (64 of them, ~6,000 completions a minute on this policy):
    # serving's per-minute rate limits (600 a key) would answer most of them 429 and end the run.
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "DJANGO_SETTINGS_MODULE": "webapp.settings",
            "FLYWHEEL_SERVE_RATE_PER_KEY": "10000000", "FLYWHEEL_SERVE_RATE_PER_PROJECT": "10000000"}


def start_ours(model_dir: Path, project: str, logs: Path, serial: bool,
               checkout: Path = ROOT, engine: str = "vllm") -> tuple[subprocess.Popen, str]:
    port = _free_port()
    name = "baseline" if checkout != ROOT else "serial" if serial else "ours"
    cmd = [sys.executable, "manage.py", "serve_policy", "--project", project, "--model-dir", str(model_dir),
           "--policy-version", "1", "--engine", engine, "--port", str(port), "--internal-port", str(_free_port()),
           "--max-model-len", str(MAX_MODEL_LEN)] + (["--serial"] if serial else [])
    log = open(logs / f"serve-{name}.log", "wb")
    proc = subprocess.Popen(cmd, cwd=checkout, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def vllm_serve_python() -> Path:
    """var/bench-vllm-serve-venv: the shared venv's packages (a .pth) plus `jmespath`, which vLLM's
    OpenAI server imports (its SageMaker routes) and the project's venv does not carry; built on
    first use, like bench/rl_step.py's TRL venv, so the project's pinned environment is unchanged."""
    python = VLLM_SERVE_VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import jmespath, vllm"], capture_output=True).returncode == 0:
        return python
    print(f"building {VLLM_SERVE_VENV} (once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(VLLM_SERVE_VENV)], check=True)
    site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    shared = subprocess.run([sys.executable, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                            capture_output=True, text=True).stdout.strip()
    Path(site, "_flywheel_shared.pth").write_text(shared + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "jmespath"], check=True)
    return python


def start_vllm_serve(model_dir: Path, logs: Path, preload: str | None = None) -> tuple[subprocess.Popen, str]:
    """`preload`: a malloc library for `LD_PRELOAD` (vLLM's CPU guide: tcmalloc), which our serving
    engine preloads in its engine processes (inference/engines/vllm_async.py engine_preload)."""
    port = _free_port()
    cmd = [str(vllm_serve_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
           "--enforce-eager", "--gpu-memory-utilization", "0.2", "--seed", "0",
           "--host", "127.0.0.1", "--port", str(port)]
    log = open(logs / "vllm-serve.log", "wb")
    env = _env() if preload is None else {**_env(), "LD_PRELOAD": preload}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


# ----------------------------------------------------------------------------------- CPU


def _cpu_seconds(procs: list) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # noqa: BLE001 - a process that ended counts nothing
            pass
    return total


def cpu_parts(server_pid: int) -> dict[str, list]:
    """The processes whose CPU a run costs: the server's own (HTTP, engine frontend, recording),
    its children (vLLM's engine core and workers) and this checkout's PostgreSQL (the recorder's
    writes; its backends are its children)."""
    import psutil

    server = psutil.Process(server_pid)
    pg = [p for p in psutil.process_iter(["cmdline"])
          if p.info["cmdline"] and p.info["cmdline"][0].endswith("/postgres") and str(ROOT / "var") in " ".join(p.info["cmdline"])]
    return {"frontend": [server], "engine": server.children(recursive=True),
            "db": pg + [c for p in pg for c in p.children(recursive=True)]}


def cpu_snapshot(server_pid: int) -> dict[str, float]:
    return {part: _cpu_seconds(procs) for part, procs in cpu_parts(server_pid).items()}


# ----------------------------------------------------------------------------------- load


def requests_for(count: int, seed: int) -> list[tuple[str, int, int]]:
    """(prompt, max_tokens, seed) per request: the same list for every system."""
    rng = random.Random(seed)
    return [(rng.choice(PROMPTS), rng.randint(16, 64), rng.randrange(2**31)) for _ in range(count)]


async def drive(base: str, key: str, model: str, clients: int, seconds: float, seed: int,
                logprobs: bool = False) -> Run:
    """`clients` concurrent clients, each sending back to back until `seconds` have passed (asking
    for each sampled token's log-prob with `logprobs`)."""
    import httpx
    import openai

    plan = requests_for(100_000, seed)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=600,
                                http_client=httpx.AsyncClient(limits=limits, timeout=600))
    run, cursor = Run(), iter(range(len(plan)))
    start = time.perf_counter()
    deadline = start + seconds

    async def one_client() -> None:
        while time.perf_counter() < deadline:
            prompt, max_tokens, req_seed = plan[next(cursor)]
            sent = time.perf_counter()
            try:
                answer = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                    temperature=1.0, seed=req_seed, **({"logprobs": True, "top_logprobs": 0} if logprobs else {}))
            except (openai.APIConnectionError, openai.APIStatusError) as exc:  # counted and shown, not retried
                cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
                run.errors.append(f"{type(exc).__name__}: {exc}{cause}"[:300])
                continue
            run.latencies.append(time.perf_counter() - sent)
            run.tokens += answer.usage.completion_tokens

    try:
        await asyncio.gather(*(one_client() for _ in range(clients)))
    finally:
        await client.close()
    run.seconds = time.perf_counter() - start
    return run


# ----------------------------------------------------------------------------------- main


def prepare_project() -> tuple[str, str]:
    from feedback.models import Project
    from feedback.services import api_key_create, project_create

    project = Project.objects.filter(slug="bench-serving").first()
    if project is None:
        project = project_create("Bench serving", "bench-serving").project
    return project.slug, api_key_create(project, ["serve"], name=f"bench-{os.getpid()}")


def run(model_dir: Path, seconds: float, rounds: int, logs: Path, systems: tuple[str, ...],
        baseline: Path | None = None, levels: tuple[int, ...] = LEVELS,
        engine: str = "vllm", vllm_preload: str | None = None,
        vllm_logprobs: bool = False) -> dict[str, dict[int, Run]]:
    setup_django(BENCH_DB)

    project, key = prepare_project()
    servers = {"ours": start_ours(model_dir, project, logs, serial=False, engine=engine)}
    if "vllm_serve" in systems:
        servers["vllm_serve"] = start_vllm_serve(model_dir, logs, vllm_preload)
    if "serial" in systems:
        servers["serial"] = start_ours(model_dir, project, logs, serial=True)
    if baseline is not None:
        servers["baseline"] = start_ours(model_dir, project, logs, serial=False, checkout=baseline)
    models = {"ours": project, "serial": project, "baseline": project, "vllm_serve": "tiny"}
    results: dict[str, dict[int, Run]] = {s: {c: Run() for c in levels} for s in systems}
    try:
        for name, (proc, base) in servers.items():
            _wait(base + ("/health" if name == "vllm_serve" else "/healthz"), proc)
        for name, (_, base) in servers.items():  # warm-up: first requests build caches
            asyncio.run(drive(base, key, models[name], 2, 1.0, seed=99))
        for clients in levels:
            for r in range(rounds):
                order = systems[r % len(systems):] + systems[:r % len(systems)]
                for name in order:
                    proc, base = servers[name]
                    settle(engine)  # the previous system's engine gone idle (serving_adapters.py)
                    before = cpu_snapshot(proc.pid)
                    got = asyncio.run(drive(base, key, models[name], clients, seconds, seed=clients * 100 + r,
                                            logprobs=vllm_logprobs and name == "vllm_serve"))
                    after = cpu_snapshot(proc.pid)
                    got.cpu = {part: after[part] - before.get(part, 0.0) for part in after}
                    results[name][clients].add(got)
                    print(f"  {name:<11}{clients:>4} clients: {got.tokens_per_s():8.1f} tok/s "
                          f"({len(got.latencies)} requests" + (f", {len(got.errors)} unanswered: {got.errors[0]}"
                                                               if got.errors else "") + ")",
                          file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return results


def summary(results: dict[str, dict[int, Run]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in results:
        for clients, r in results[name].items():
            prefix = "vllm_serve" if name == "vllm_serve" else name
            out[f"{prefix}_tokens_per_s_{clients}"] = round(r.tokens_per_s(), 1)
            out[f"{prefix}_p50_s_{clients}"] = round(r.quantile(0.5), 4)
            out[f"{prefix}_p95_s_{clients}"] = round(r.quantile(0.95), 4)
            out[f"{prefix}_requests_{clients}"] = len(r.latencies)
            out[f"{prefix}_errors_{clients}"] = len(r.errors)
            for part in ("frontend", "engine", "db"):
                out[f"{prefix}_{part}_cpu_ms_per_token_{clients}"] = round(r.cpu_ms_per_token(part), 3)
    if "vllm_serve" not in results:
        return out
    for clients, theirs in results["vllm_serve"].items():
        for name in ("ours", "baseline"):
            if name not in results:
                continue
            prefix = "" if name == "ours" else "baseline_"
            mine = results[name][clients]
            ratio, low, high = paired_ratio(mine, theirs)
            out[f"{prefix}ratio_{clients}"] = round(ratio, 3)
            out[f"{prefix}ratio_range_{clients}"] = [round(low, 3), round(high, 3)]
            out[f"{prefix}p95_ratio_{clients}"] = round(mine.quantile(0.95) / max(theirs.quantile(0.95), 1e-9), 3)
            out[f"{prefix}engine_cpu_ratio_{clients}"] = round(
                mine.cpu_ms_per_token("engine") / max(theirs.cpu_ms_per_token("engine"), 1e-9), 3)
    return out


def paired_ratio(mine: Run, theirs: Run) -> tuple[float, float, float]:
    """The median of the rounds' throughput ratios (each round drives both back to back, so its two
    rates saw the same machine load), with their range."""
    ratios = [a / max(b, 1e-9) for a, b in zip(mine.rates, theirs.rates, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def print_table(results: dict[str, dict[int, Run]]) -> None:
    systems, levels = list(results), list(results["ours"])
    vs_vllm = "vllm_serve" in results
    print(f"{'clients':>7} | " + " | ".join(f"{TITLES[name]:>10} {'p50':>6} {'p95':>6}" for name in systems)
          + (f" | {'ours/vllm (range)':>17}" if vs_vllm else "")
          + (f" | {'base/vllm (range)':>17}" if "baseline" in results else ""))
    for c in levels:
        cells = []
        for name in systems:
            r = results[name][c]
            cells.append(f"{r.tokens_per_s():>10.1f} {r.quantile(0.5):6.3f} {r.quantile(0.95):6.3f}")
        ratios = [paired_ratio(results[name][c], results["vllm_serve"][c])
                  for name in ("ours", "baseline") if vs_vllm and name in results]
        print(f"{c:>7} | " + " | ".join(cells)
              + "".join(f" | {ratio:5.3f} ({low:.2f}-{high:.2f})" for ratio, low, high in ratios))
    if not vs_vllm:
        print("vllm serve: left out (--quick: ours on the torch engine alone)")
    for name in systems:
        for c in levels:
            if results[name][c].errors:
                print(f"{name} at {c} clients: {len(results[name][c].errors)} requests unanswered, the first: "
                      f"{results[name][c].errors[0]}")
    print("\nCPU ms per output token (where the time goes): frontend = the HTTP server process (API, engine")
    print("frontend, recording), engine = vLLM's engine core and workers, db = PostgreSQL (recorded writes)")
    print(f"{'clients':>7} | " + " | ".join(f"{name:>22}" for name in systems))
    print(f"{'':>7} | " + " | ".join(f"{'front engine     db':>22}" for _ in systems))
    for c in levels:
        cells = [" ".join(f"{results[name][c].cpu_ms_per_token(part):6.2f}" for part in ("frontend", "engine", "db"))
                 for name in systems]
        print(f"{c:>7} | " + " | ".join(f"{cell:>22}" for cell in cells))


TITLES = {"ours": "ours tok/s", "vllm_serve": "vllm serve", "serial": "serial", "baseline": "baseline"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="an HF folder (default: build the tiny dense policy)")
    parser.add_argument("--seconds", type=float, default=6.0, help="per system, level and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--adapter-rounds", type=int, default=5,
                        help="paired rounds of the adapter side (bench/serving_adapters.py; 0 leaves it out)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-serial", action="store_true", help="leave out the serialised reference")
    parser.add_argument("--baseline", type=Path, help="another checkout whose serve_policy is driven alike")
    parser.add_argument("--adapters", action="store_true",
                        help="only the adapter side: two adapters (production + canary) on one engine vs one "
                             "merged model, 1/4/16 clients (bench/serving_adapters.py)")
    parser.add_argument("--vllm-serve-tcmalloc", action="store_true",
                        help="preload tcmalloc in `vllm serve` too, as ours does in its engine (like for like)")
    parser.add_argument("--vllm-serve-logprobs", action="store_true",
                        help="`vllm serve`'s clients ask for each sampled token's log-prob (logprobs=true, "
                             "top_logprobs=0), which ours records for every completion (like for like)")
    parser.add_argument("--clients", type=int, nargs="+", choices=LEVELS, default=list(LEVELS),
                        help="the client levels to drive (default: all four)")
    parser.add_argument("--quick", action="store_true",
                        help="ours alone on the torch engine (no vLLM), 1 and 2 clients, 1 s: that the bench runs")
    args = parser.parse_args()
    systems = tuple(s for s in SYSTEMS if not (args.no_serial and s == "serial"))
    levels, engine = tuple(args.clients), "vllm"
    if args.quick:
        systems, levels, engine, args.seconds, args.rounds = ("ours",), (1, 2), "torch", 1.0, 1
    if args.baseline is not None:
        systems += ("baseline",)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_dir
        if folder is None:
            from training.pretrain import PolicyConfig, build_policy, stdlib_corpus

            lines = stdlib_corpus(2_000 if args.quick else 20_000)
            folder = build_policy(Path(tmp) / "policy", PolicyConfig(kind="dense"), lines)
        side = None if args.adapter_rounds == 0 and not args.quick else adapter_side(
            folder, Path(tmp), "torch" if args.quick else "vllm-async", (2,) if args.quick else (1, 4, 16),
            0.5 if args.quick else args.seconds, 1 if args.quick else args.adapter_rounds)
        if args.adapters and side is not None:
            print_adapter_table(side, "torch" if args.quick else "vllm-async")
            if args.json:
                print(json.dumps({**adapter_summary(side), "quick": args.quick}))
            return
        logs = ROOT / "var" / "bench-serving"
        logs.mkdir(parents=True, exist_ok=True)
        preload = None
        if args.vllm_serve_tcmalloc:
            from inference.engines.vllm_async import engine_preload

            preload = engine_preload()
            if preload is None:
                parser.error("--vllm-serve-tcmalloc: no tcmalloc found (make install installs it)")
        results = run(folder, args.seconds, args.rounds, logs, systems, args.baseline, levels, engine, preload,
                      args.vllm_serve_logprobs)
    print_table(results)
    if side is not None:
        print_adapter_table(side, "torch" if args.quick else "vllm-async")
    if args.json:
        print(json.dumps({**summary(results), **(adapter_summary(side) if side else {}), "quick": args.quick}))


if __name__ == "__main__":
    main()
