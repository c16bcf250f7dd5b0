"""Ingest throughput: naive one-ORM-save-per-event vs the real endpoint over HTTP.

    .venv/bin/python bench/ingest.py [--events 20000] [--clients 4] [--json]

The redaction column: a project with every built-in redactor on (e-mail, API keys and tokens,
IPv4, IPv6; one prompt in ten holds an address to replace) against one without, at batch 1,000:
through `feedback_ingest` in process (parse, redaction, durable commit; median of 15 batches,
alternating) and through the endpoint. `--redaction-only` runs the first alone.

(b) runs uvicorn serving webapp.asgi (a separate process) on a bench database of the embedded
PostgreSQL (or DATABASE_URL's server), with concurrent signed clients (feedback/client.py).
Half the events are trajectories with one step of 24 tokens, half feedback on them.
The embedded PostgreSQL is durable here (fsync, full-page writes and synchronous commit on): an
event counts only once its commit reached the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._django import setup_django  # noqa: E402

BENCH_DB = "flywheel_bench"


def make_events(prefix: str, n: int) -> list[dict]:
    events: list[dict] = []
    for i in range(n // 2):
        tid = f"{prefix}-t{i}"
        events.append({
            "type": "trajectory", "id": tid, "policy_version": 1, "task": "tab-completion",
            "prompt": [{"role": "user", "content": f"def f{i}(x):  # ask ann{i}@example.com, host 10.0.{i % 250}.1"
                        if i % 10 == 0 else f"def f{i}(x):  # returns x plus one, see the docs of version 1.2"}],
            "steps": [{"role": "assistant", "content": " return x + 1", "token_ids": list(range(24)),
                       "logprobs": [-0.25] * 24}],
            "occurred_at": "2026-11-29T08:00:00Z",
        })
        events.append({"type": "feedback", "id": f"{prefix}-f{i}", "trajectory_id": tid,
                       "signal": "accept" if i % 3 else "reject", "user": f"u-{i % 97}"})
    return events


def bench_naive(n: int) -> float:
    """One ORM save per event, each in its own autocommit transaction, check-then-insert."""
    from django.utils import timezone

    from feedback.models import FeedbackEvent, Project, Step, Trajectory

    project = Project.objects.create(slug=f"naive-{uuid.uuid4().hex[:8]}", name="naive")
    events = make_events("naive", n)
    start = time.perf_counter()
    for e in events:
        now = timezone.now()
        if e["type"] == "trajectory":
            if Trajectory.objects.filter(project=project, external_id=e["id"]).exists():
                continue
            t = Trajectory.objects.create(project=project, external_id=e["id"], policy_version=1,
                                          task=e["task"], prompt=e["prompt"], occurred_at=now)
            for i, s in enumerate(e["steps"]):
                Step.objects.create(trajectory=t, index=i, role=s["role"], content=s["content"],
                                    token_ids=s["token_ids"], logprobs=s["logprobs"])
        else:
            if FeedbackEvent.objects.filter(project=project, event_id=e["id"]).exists():
                continue
            t = Trajectory.objects.filter(project=project, external_id=e["trajectory_id"]).first()
            FeedbackEvent.objects.create(project=project, event_id=e["id"], trajectory=t, signal=e["signal"],
                                         trajectory_external_id=e["trajectory_id"], occurred_at=now)
    return len(events) / (time.perf_counter() - start)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(url: str) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    env = {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "webapp.settings"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "webapp.asgi:application", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warning", "--no-access-log"], cwd=ROOT, env=env)
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("uvicorn did not start")


REDACTORS = ["email", "api_key", "ipv4", "ipv6"]


def bench_endpoint(base: str, n: int, batch: int, clients: int, redact: bool = False) -> float:
    from feedback.client import FlywheelClient
    from feedback.services import project_create
    from feedback.userdata.services import data_policy_set

    creds = project_create(f"bench {uuid.uuid4().hex[:8]}")
    if redact:
        data_policy_set(creds.project, redactors=REDACTORS)
    events = make_events(f"b{batch}", n)
    batches = [events[i:i + batch] for i in range(0, len(events), batch)]
    senders = [FlywheelClient(base, creds.webhook_secret, project=creds.project.slug) for _ in range(clients)]
    senders[0].send(make_events("warmup", 10))

    def send(i: int) -> int:
        return senders[i % clients].send(batches[i]).accepted

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        accepted = sum(pool.map(send, range(len(batches))))
    elapsed = time.perf_counter() - start
    if accepted != len(events):
        raise RuntimeError(f"only {accepted} of {len(events)} events were accepted")
    return len(events) / elapsed


def bench_inprocess(batch: int = 1000, repeat: int = 15) -> tuple[float, float]:
    """Milliseconds to ingest one batch through feedback_ingest in this process (parse, redaction,
    the durable commit), without and with every redactor: the median of `repeat` fresh batches
    each, alternating the two projects so that both see the same machine."""
    import statistics

    from feedback.services import feedback_ingest, project_create
    from feedback.userdata.services import data_policy_set

    plain, redacted = (project_create(f"inproc {uuid.uuid4().hex[:8]}").project for _ in range(2))
    data_policy_set(redacted, redactors=REDACTORS)
    times: dict[int, list[float]] = {plain.pk: [], redacted.pk: []}
    for k in range(repeat):
        for project in (plain, redacted) if k % 2 == 0 else (redacted, plain):
            events = make_events(f"in{k}-{project.pk}", batch)
            start = time.perf_counter()
            feedback_ingest(project, events)
            times[project.pk].append(time.perf_counter() - start)
    return statistics.median(times[plain.pk]) * 1000, statistics.median(times[redacted.pk]) * 1000


def bench_redact_only(batch: int = 1000, repeat: int = 15) -> float:
    """Milliseconds the redaction of one batch takes by itself (median): the part of a redacted
    ingest that the plain one does not do, measured without the database's noise."""
    import statistics

    from feedback.userdata.redaction import redact_event, redactor_for

    redactor, events, times = redactor_for(REDACTORS), make_events("alone", batch), []
    for _ in range(repeat):
        counts: dict[str, int] = {}
        start = time.perf_counter()
        for event in events:
            redact_event(event, redactor, counts)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--naive-events", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--redaction-only", action="store_true", help="only the in-process redaction column")
    args = parser.parse_args()

    url = setup_django(BENCH_DB)
    inproc_plain, inproc_redacted = bench_inprocess()
    inproc_overhead = (inproc_redacted - inproc_plain) / inproc_plain
    alone = bench_redact_only()
    redaction_line = (f"redaction at batch 1000, in process (parse + durable commit): {inproc_plain:.0f} ms -> "
                      f"{inproc_redacted:.0f} ms a batch ({inproc_overhead:+.1%}); the redaction alone "
                      f"{alone:.0f} ms ({alone / inproc_plain:.1%} of the plain batch)")
    if args.redaction_only:
        print(redaction_line)
        if args.json:
            print(json.dumps({"inprocess_ms_batch1000": [round(inproc_plain, 1), round(inproc_redacted, 1)],
                              "redaction_overhead_inprocess_batch1000": round(inproc_overhead, 4),
                              "redaction_alone_ms_batch1000": round(alone, 1),
                              "redaction_alone_share": round(alone / inproc_plain, 4)}))
        return
    naive = bench_naive(args.naive_events)
    proc, base = _serve(url)
    try:
        rates = {b: bench_endpoint(base, args.events, b, args.clients) for b in (100, 1000)}
        redacting = bench_endpoint(base, args.events, 1000, args.clients, redact=True)
    finally:
        proc.terminate()
        proc.wait(20)
    best = max(rates.values())
    rows = [("naive ORM save per event", naive, 1.0)]
    rows += [(f"endpoint, HTTP+ASGI, batch {b}, {args.clients} clients", r, r / naive) for b, r in rates.items()]
    rows.append((f"endpoint, batch 1000, {args.clients} clients, redaction on", redacting, redacting / naive))
    http_overhead = rates[1000] / redacting - 1
    print(f"{'path':<48} {'events/s':>10} {'vs naive':>9}")
    for name, rate, ratio in rows:
        print(f"{name:<48} {rate:>10.0f} {ratio:>8.1f}x")
    print(redaction_line)
    print(f"redaction at batch 1000 over HTTP (4 clients, noisier): {http_overhead:+.1%} time")
    if args.json:
        print(json.dumps({
            "naive_events_per_s": round(naive, 1),
            "endpoint_events_per_s": round(best, 1),
            "endpoint_events_per_s_batch100": round(rates[100], 1),
            "endpoint_events_per_s_batch1000": round(rates[1000], 1),
            "speedup": round(best / naive, 2),
            "endpoint_events_per_s_batch1000_redacted": round(redacting, 1),
            "redaction_overhead_batch1000": round(http_overhead, 4),
            "inprocess_ms_batch1000": [round(inproc_plain, 1), round(inproc_redacted, 1)],
            "redaction_overhead_inprocess_batch1000": round(inproc_overhead, 4),
            "redaction_alone_share": round(alone / inproc_plain, 4),
            "clients": args.clients,
            "cores": os.cpu_count(),
        }))


if __name__ == "__main__":
    main()
