"""Soak under kills: nothing acknowledged is lost, nothing is stored twice.

    nice -n 19 .venv/bin/python bench/soak.py [--duration 300] [--senders 4] [--json]
    nice -n 19 .venv/bin/python bench/soak.py --quick    # 20 s, one sender, one kill of each: that it runs

On loopback only, against a PostgreSQL and Redis of its own (embedded, under --var-dir, durable:
fsync, full-page writes and synchronous commit on), it runs the real processes: the ASGI web
server (uvicorn webapp.asgi), a Celery worker and beat, and the serving process
(`manage.py serve_policy`, torch engine, a tiny policy). For --duration seconds:

- N signed senders (feedback/client.py) post batches of trajectories and feedback; a delivery
  keeps its `webhook-id` through every retry, and a sender retries a batch until it is
  acknowledged (202), however long the outage;
- a completer asks the serving process for completions (each answer names its trajectory id);
- the chaos schedule (seeded) SIGKILLs the web server and the Celery worker at random moments and
  restarts them, stops PostgreSQL once in immediate mode (a crash: WAL replay at restart) and
  restarts Redis once.

Every sender and the completer log what they sent and what was acknowledged (JSON lines under
--var-dir/soak-logs/). At the end the logs are reconciled with the database: every acknowledged
event is stored exactly once (`lost`, `duplicates`), every batch was acknowledged in the end
(`unacked`), and every completion answered to its client is stored as a trajectory
(`served_lost`). The run is bounded in time (--duration, --grace) and count (--max-events).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.path[:1] != [str(ROOT)]:  # first: bench/inference.py must not shadow the package
    sys.path.insert(0, str(ROOT))

ACKED_STATUSES = ("accepted", "duplicate")


# --- reconciliation (pure: the logs and the database's counts in, the verdict out) -------------


@dataclass
class Delivery:
    """One batch as its sender's log tells it: the events' ids and, once a 202 came, their statuses."""

    webhook_id: str
    ids: list[str]
    statuses: dict[str, str] | None = None
    attempts: int = 0

    @property
    def acked(self) -> bool:
        return self.statuses is not None


def read_sender_logs(lines: Iterable[str]) -> dict[str, Delivery]:
    """Deliveries by webhook-id from the senders' JSON lines ({"send": wid, "ids"} then
    {"ack": wid, "statuses", "attempts"}); a line cut short by a crash is skipped."""
    deliveries: dict[str, Delivery] = {}
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if "send" in entry:
            deliveries[entry["send"]] = Delivery(entry["send"], entry["ids"])
        elif "ack" in entry and entry["ack"] in deliveries:
            delivery = deliveries[entry["ack"]]
            delivery.statuses, delivery.attempts = entry["statuses"], entry.get("attempts", 0)
    return deliveries


@dataclass
class Verdict:
    sent: int = 0
    acked: int = 0
    stored: int = 0
    lost: int = 0
    duplicates: int = 0
    unacked: int = 0
    rejected: int = 0
    phantom: int = 0
    retried: int = 0
    served: int = 0
    served_lost: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicates or self.unacked or self.rejected or self.phantom
                    or self.served_lost)


def reconcile(deliveries: dict[str, Delivery], stored: Counter, served: Iterable[str],
              stored_served: Counter, rows_per_event: dict[str, int] | None = None) -> Verdict:
    """`stored`: rows per sender event id in the database (trajectories and feedback events);
    `served`: trajectory ids the serving process answered with; `stored_served`: rows per served id;
    `rows_per_event`: for trajectories, the step rows stored (a second copy of a step is a duplicate).
    An event acknowledged `duplicate` was stored by an earlier delivery: it must be there too."""
    sent = {i for d in deliveries.values() for i in d.ids}
    acked = {i for d in deliveries.values() if d.acked for i, s in d.statuses.items() if s in ACKED_STATUSES}
    rejected = sorted(i for d in deliveries.values() if d.acked for i, s in d.statuses.items()
                      if s not in ACKED_STATUSES)
    unacked = sorted(i for d in deliveries.values() if not d.acked for i in d.ids)
    lost = sorted(acked - {i for i, n in stored.items() if n > 0})
    doubled = sorted(i for i, n in stored.items() if n > 1)
    doubled += sorted(i for i, n in (rows_per_event or {}).items() if n > 1)
    phantom = sorted(set(stored) - sent)
    served = list(dict.fromkeys(served))
    served_lost = [t for t in served if stored_served.get(t, 0) < 1]
    doubled += sorted(t for t in served if stored_served.get(t, 0) > 1)
    verdict = Verdict(sent=len(sent), acked=len(acked), stored=sum(1 for i in sent if stored.get(i, 0) > 0),
                      lost=len(lost), duplicates=len(doubled), unacked=len(unacked), rejected=len(rejected),
                      phantom=len(phantom), retried=sum(1 for d in deliveries.values() if d.attempts > 1),
                      served=len(served), served_lost=len(served_lost))
    named = {"lost": lost, "duplicates": doubled, "unacked": unacked, "rejected": rejected, "phantom": phantom,
             "served_lost": served_lost}
    verdict.examples = {k: v[:5] for k, v in named.items() if v}
    return verdict


# --- the processes -----------------------------------------------------------------------------


class Proc:
    """One of the project's processes, started again after a kill with the same command."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_dir: Path,
                 ready: Callable[[], bool] | None = None) -> None:
        self.name, self.cmd, self.env, self.ready = name, cmd, env, ready
        self.log = open(log_dir / f"{name}.log", "ab")
        self.proc: subprocess.Popen | None = None

    def start(self, wait_s: float = 600) -> None:
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + wait_s
        while self.ready is not None and not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; read its log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} was not ready within {wait_s} s; read its log")
            time.sleep(0.25)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


def _answers(url: str) -> Callable[[], bool]:
    import httpx

    def ready() -> bool:
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    return ready


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the load --------------------------------------------------------------------------------


class Budget:
    """The run's bound on events, shared by the senders."""

    def __init__(self, limit: int) -> None:
        self.left, self._lock = limit, threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.left < n:
                return False
            self.left -= n
            return True


def make_batch(sender: int, number: int, size: int) -> list[dict]:
    """size/2 trajectories and as many feedback events (on the previous batch's trajectories, so
    some arrive before or after theirs across deliveries)."""
    half = max(1, size // 2)
    events: list[dict] = []
    for i in range(half):
        tid = f"s{sender}-b{number}-t{i}"
        events.append({"type": "trajectory", "id": tid, "policy_version": 1, "task": "soak",
                       "prompt": [{"role": "user", "content": f"def f{i}(x):"}],
                       "steps": [{"role": "assistant", "content": " return x", "token_ids": [5, 6, 7],
                                  "logprobs": [-0.5, -0.25, -0.125]}]})
        target = f"s{sender}-b{max(0, number - 1)}-t{i}"
        events.append({"type": "feedback", "id": f"s{sender}-b{number}-f{i}", "trajectory_id": target,
                       "signal": "accept" if (number + i) % 3 else "reject", "user": f"u{i % 7}"})
    return events


def sender(index: int, base: str, secret: str, project: str, log_path: Path, args, stop: threading.Event,
           budget: Budget) -> None:
    from feedback.client import FlywheelClient, FlywheelError

    client = FlywheelClient(base, secret, project=project, max_retries=4, backoff_s=0.25, timeout_s=20,
                            max_wait_s=5)
    give_up = time.monotonic() + args.duration + args.grace
    with open(log_path, "a") as log:
        number = 0
        while not stop.is_set() and budget.take(args.batch):
            events, wid = make_batch(index, number, args.batch), f"msg_soak_{index}_{number}_{uuid.uuid4().hex[:6]}"
            log.write(json.dumps({"send": wid, "ids": [e["id"] for e in events]}) + "\n")
            log.flush()
            attempts = 0
            # A batch is retried until it is acknowledged (the client's own retries inside each
            # round), always under the same webhook-id: a retry of a stored delivery is a duplicate.
            while time.monotonic() < give_up:
                try:
                    result = client.send(events, webhook_id=wid)
                except FlywheelError as exc:
                    attempts += client.max_retries + 1
                    if exc.status is not None and exc.status < 500 and exc.status != 429:
                        raise
                    time.sleep(1)
                    continue
                attempts += result.attempts
                statuses = {r["id"]: r["status"] for r in result.results}
                log.write(json.dumps({"ack": wid, "statuses": statuses, "attempts": attempts}) + "\n")
                log.flush()
                break
            number += 1
            time.sleep(args.pause)
    client.close()


def completer(base: str, key: str, project: str, log_path: Path, stop: threading.Event, pause: float) -> None:
    import httpx

    headers = {"authorization": f"Bearer {key}"}
    with open(log_path, "a") as log, httpx.Client(timeout=30) as http:
        n = 0
        while not stop.is_set():
            n += 1
            body = {"model": project, "prompt": f"def g{n}(x):", "max_tokens": 4, "temperature": 1.0}
            try:
                answer = http.post(base + "/v1/completions", json=body, headers=headers)
            except httpx.TransportError:
                answer = None
            if answer is not None and answer.status_code == 200:
                for choice in answer.json()["choices"]:
                    log.write(json.dumps({"served": choice["trajectory_id"]}) + "\n")
                log.flush()
            time.sleep(pause)


# --- chaos ------------------------------------------------------------------------------------


def chaos_plan(duration: float, web_kills: int, worker_kills: int, seed: int) -> list[tuple[float, str]]:
    """(seconds from the start, action): kills spread over the run, PostgreSQL's crash and Redis'
    restart once each, in the middle, apart from each other."""
    rng = random.Random(seed)
    plan = [(rng.uniform(0.1, 0.9) * duration, "kill web") for _ in range(web_kills)]
    plan += [(rng.uniform(0.1, 0.9) * duration, "kill worker") for _ in range(worker_kills)]
    plan += [(rng.uniform(0.3, 0.45) * duration, "crash postgres"), (rng.uniform(0.6, 0.75) * duration, "restart redis")]
    return sorted(plan)


def run_chaos(plan: list[tuple[float, str]], procs: dict[str, Proc], start: float, stop: threading.Event,
              done: list[str], outage_s: float) -> None:
    from core import embedded

    for at, action in plan:
        if stop.wait(max(0.0, start + at - time.monotonic())):
            return
        if action == "kill web":
            procs["web"].kill()
            procs["web"].start()
        elif action == "kill worker":
            procs["worker"].kill()
            procs["worker"].start()
        elif action == "crash postgres":
            embedded.stop_postgres(mode="immediate")
            time.sleep(outage_s)
            embedded.start_postgres()
        elif action == "restart redis":
            embedded.stop_redis()
            time.sleep(outage_s)
            embedded.start_redis()
        done.append(f"{time.monotonic() - start:.0f}s {action}")


# --- set-up -----------------------------------------------------------------------------------


def setup(var_dir: Path) -> dict[str, str]:
    """Own embedded services (durable), migrated; a fresh project with a base policy; the
    environment every child process gets."""
    os.environ["FLYWHEEL_VAR_DIR"] = str(var_dir)
    # The soak measures durability: the test suite's switch must not reach its server.
    os.environ.pop("FLYWHEEL_TEST_PG_UNDURABLE", None)
    for name in ("DATABASE_URL", "REDIS_URL", "CELERY_KEY_PREFIX", "CACHE_KEY_PREFIX"):
        os.environ.pop(name, None)
    # Imported only now: core.embedded and core.devsecrets read FLYWHEEL_VAR_DIR when imported.
    from core import devsecrets, embedded

    devsecrets.setdefault_environ()
    os.environ.update(DATABASE_URL=embedded.postgres_url(), REDIS_URL=embedded.redis_url(),
                      DJANGO_SETTINGS_MODULE="webapp.settings", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                      OMP_NUM_THREADS="1")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return dict(os.environ)


def create_project(base: Path | None = None) -> dict[str, str]:
    """A fresh project, its base policy pretrained one step (or registered from the folder `base`)."""
    from django.core.management import call_command

    from feedback.services import api_key_create, project_create
    from training.runs.settings import Schedule
    from training.schedule import training_schedule_install

    creds = project_create("Soak", f"soak-{uuid.uuid4().hex[:8]}")
    key = api_key_create(creds.project, ["serve"], "soak-completer")
    source = ["--from", str(base)] if base is not None else ["--steps", "1"]
    call_command("bootstrap_policy", "--project", creds.project.slug, *source, verbosity=0)
    # Beat gives the worker real work (rewards, the outbox, the sweeper); training never starts.
    training_schedule_install([creds.project], Schedule(min_new=10**9, every_minutes=10**6), rewards_every_s=5,
                              outbox_every_s=5, sweep_every_s=30)
    return {"slug": creds.project.slug, "secret": creds.webhook_secret, "serve_key": key}


def stop_services() -> None:
    """The soak's own PostgreSQL and Redis stop with it (the next run starts them again)."""
    from django.db import connections

    from core import embedded

    connections.close_all()
    embedded.stop_postgres()
    embedded.stop_redis()


def processes(env: dict[str, str], slug: str, log_dir: Path) -> dict[str, Proc]:
    py, web, serve = sys.executable, _free_port(), _free_port()
    return {
        "web": Proc("web", [py, "-m", "uvicorn", "webapp.asgi:application", "--host", "127.0.0.1", "--port",
                            str(web), "--log-level", "warning", "--no-access-log"], env, log_dir,
                    _answers(f"http://127.0.0.1:{web}/healthz")),
        "worker": Proc("worker", [py, "-m", "celery", "-A", "webapp", "worker", "-l", "warning", "--pool", "solo",
                                  "-Q", "celery,ingest,rewards,train,rollouts,gate"], env, log_dir),
        "beat": Proc("beat", [py, "-m", "celery", "-A", "webapp", "beat", "-l", "warning", "-s",
                              str(log_dir / "celerybeat-schedule")], env, log_dir),
        "serving": Proc("serving", [py, str(ROOT / "manage.py"), "serve_policy", "--project", slug, "--engine", "torch",
                                    "--port", str(serve), "--internal-port", str(_free_port())], env, log_dir,
                        _answers(f"http://127.0.0.1:{serve}/healthz")),
    }


def url_of(proc: Proc) -> str:
    return f"http://127.0.0.1:{proc.cmd[proc.cmd.index('--port') + 1]}"


# --- after the run ------------------------------------------------------------------------------


def stored_counts(slug: str, served: list[str]) -> tuple[Counter, Counter, dict[str, int]]:
    from django.db import close_old_connections, connection
    from django.db.models import Count

    from feedback.models import FeedbackEvent, Project, Trajectory

    connection.close()  # the server restarted under this process's old connection
    close_old_connections()
    project = Project.objects.get(slug=slug)
    served_set = set(served)
    stored: Counter = Counter()
    stored_served: Counter = Counter()
    steps: dict[str, int] = {}
    for ext, n in Trajectory.objects.filter(project=project).annotate(n=Count("steps")).values_list("external_id", "n"):
        if ext in served_set:
            stored_served[ext] += 1
        else:
            stored[ext] += 1
            steps[ext] = n
    for ident in FeedbackEvent.objects.filter(project=project).values_list("event_id", flat=True):
        stored[ident] += 1
    return stored, stored_served, steps


def wait_recorded(slug: str, served: list[str], seconds: float) -> None:
    """The serving process records in the background: give its recorder time to drain."""
    from django.db import connection

    from feedback.models import Trajectory

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        connection.close()
        have = Trajectory.objects.filter(project__slug=slug, external_id__in=served).count()
        if have >= len(set(served)):
            return
        time.sleep(1)


def read_lines(paths: Iterable[Path]) -> list[str]:
    return [line for p in paths if p.exists() for line in p.read_text().splitlines()]


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=300, help="seconds of load and chaos")
    parser.add_argument("--grace", type=float, default=180, help="seconds a sender keeps retrying after the run")
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--batch", type=int, default=50, help="events per delivery")
    parser.add_argument("--pause", type=float, default=0.05, help="seconds a sender waits between deliveries")
    parser.add_argument("--max-events", type=int, default=500_000)
    parser.add_argument("--web-kills", type=int, default=3)
    parser.add_argument("--worker-kills", type=int, default=3)
    parser.add_argument("--outage", type=float, default=5.0, help="seconds PostgreSQL and Redis stay down")
    parser.add_argument("--completion-pause", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--var-dir", type=Path, default=ROOT / "var" / "soak")
    parser.add_argument("--quick", action="store_true",
                        help="20 s, one sender, one kill of each, a base built on 2,000 lines: that the bench runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.grace, args.senders, args.batch, args.pause = 20, 60, 1, 10, 0.2
        args.web_kills, args.worker_kills, args.outage = 1, 1, 1.0
        if args.var_dir == ROOT / "var" / "soak":
            args.var_dir = ROOT / "var" / "soak-quick"
    return args


def quick_base(var_dir: Path) -> Path:
    """A tiny untrained base (the standard library's first 2,000 lines for its tokenizer): pretraining
    reads the whole standard library, which a quick run has no time for."""
    from training.pretrain import PolicyConfig, build_policy, stdlib_corpus

    folder = var_dir / "quick-base"
    if not (folder / "config.json").exists():
        build_policy(folder, PolicyConfig(), stdlib_corpus(2_000))
    return folder


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    var_dir = args.var_dir.resolve()
    log_dir = var_dir / "soak-logs" / time.strftime("%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    env = setup(var_dir)
    project = create_project(quick_base(var_dir) if args.quick else None)
    procs = processes(env, project["slug"], log_dir)
    try:
        for proc in procs.values():
            proc.start()
        verdict, elapsed, kills = soak(args, procs, project, log_dir)
    finally:
        for proc in procs.values():
            proc.stop()
        stop_services()
    report(args, verdict, elapsed, kills)
    return 0 if verdict.ok else 1


def soak(args, procs: dict[str, Proc], project: dict[str, str], log_dir: Path) -> tuple[Verdict, float, list[str]]:
    stop, done, budget = threading.Event(), [], Budget(args.max_events)
    web, serving = url_of(procs["web"]), url_of(procs["serving"])
    sender_logs = [log_dir / f"sender-{i}.jsonl" for i in range(args.senders)]
    threads = [threading.Thread(target=sender, args=(i, web, project["secret"], project["slug"], path, args, stop,
                                                     budget)) for i, path in enumerate(sender_logs)]
    threads.append(threading.Thread(target=completer, args=(serving, project["serve_key"], project["slug"],
                                                            log_dir / "served.jsonl", stop, args.completion_pause)))
    plan = chaos_plan(args.duration, args.web_kills, args.worker_kills, args.seed)
    start = time.monotonic()
    chaos = threading.Thread(target=run_chaos, args=(plan, procs, start, stop, done, args.outage))
    for t in [*threads, chaos]:
        t.start()
    stop.wait(args.duration)
    stop.set()
    chaos.join()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    served = [json.loads(line)["served"] for line in read_lines([log_dir / "served.jsonl"])]
    wait_recorded(project["slug"], served, 60)
    stored, stored_served, steps = stored_counts(project["slug"], served)
    deliveries = read_sender_logs(read_lines(sender_logs))
    return reconcile(deliveries, stored, served, stored_served, steps), elapsed, done


def report(args, verdict: Verdict, elapsed: float, kills: list[str]) -> None:
    rate = verdict.acked / elapsed if elapsed else 0.0
    rows = [("duration (s)", f"{elapsed:.0f}"), ("senders", args.senders), ("events sent", verdict.sent),
            ("acknowledged", verdict.acked), ("stored", verdict.stored), ("lost", verdict.lost),
            ("duplicates", verdict.duplicates), ("never acknowledged", verdict.unacked),
            ("rejected", verdict.rejected), ("deliveries retried", verdict.retried),
            ("events/s acknowledged", f"{rate:.0f}"), ("completions served", verdict.served),
            ("served, not stored", verdict.served_lost), ("chaos", "; ".join(kills))]
    print(f"{'soak':<24} {'value':>10}")
    for name, value in rows:
        print(f"{name:<24} {value!s:>10}")
    for what, ids in verdict.examples.items():
        print(f"{what}: e.g. {ids}")
    if args.json:
        print(json.dumps({
            "acked": verdict.acked, "stored": verdict.stored, "lost": verdict.lost,
            "duplicates": verdict.duplicates, "unacked": verdict.unacked, "rejected": verdict.rejected,
            "phantom": verdict.phantom, "retried_deliveries": verdict.retried,
            "events_per_s": round(rate, 1), "kills": sum(1 for k in kills if "kill" in k),
            "restarts": sum(1 for k in kills if "kill" not in k), "served": verdict.served,
            "served_lost": verdict.served_lost, "duration_s": round(elapsed, 1), "senders": args.senders,
            "cores": os.cpu_count(), "quick": args.quick,
        }))


if __name__ == "__main__":
    sys.exit(main())
