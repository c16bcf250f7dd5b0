"""Ingest throughput: naive one-ORM-save-per-event vs the real endpoint over HTTP.

    .venv/bin/python bench/ingest.py [--events 20000] [--clients 4] [--json]
    nice -n 0 .venv/bin/python bench/ingest.py --redaction-only --pairs 15 --json   # the redaction goal
    .venv/bin/python bench/ingest.py --quick --json                                   # seconds (CI)
    .venv/bin/python bench/ingest.py --before ../wt-before --rounds 3 --json          # before/after, interleaved

`--before PATH` serves another checkout (a git worktree of main) beside this one on the same
database and Redis and runs both at batch 100 and 1,000 in interleaved rounds (the order swapped
every round): the median events/s with their range, and the CPU each event cost the web server
and the database (microseconds, from /proc: a figure the load of a shared machine disturbs far
less than the wall clock). Every run counts the rows stored against the events sent.
Every run but --quick starts on a fresh bench database (dropped and migrated again; --keep-db keeps
the last one), so that runs compare on tables of the same size.

The redaction column: a project with every built-in redactor on (the default of a new project:
e-mail, API keys and tokens, IPv4, IPv6; one prompt in ten holds an address to replace) against
one with redaction off, at batch 1,000, through `feedback_ingest` in process (parse, redaction,
durable commit). The two are measured in interleaved pairs: a fresh batch into one project, then
one into the other, the order swapped every pair (AB BA AB ...), and each pair gives a ratio
on/off. Load that comes and goes (2 cores shared with other work) then hits both sides of a pair
alike; the line reports the median of the per-pair ratios with its quartiles and range, not a
ratio of two medians taken at different moments. The same pairs are then sent through the
endpoint (uvicorn, one sequential client). `--redaction-only` runs this column alone; `--quick`
runs the in-process pairs at batch 50.

(b) runs uvicorn serving webapp.asgi (a separate process) on a bench database of the embedded
PostgreSQL (or DATABASE_URL's server), with concurrent signed clients (feedback/client.py).
Half the events are trajectories with one step of 24 tokens (ids across a real vocabulary, log-probs
with a float32's digits, as an engine reports them), half feedback on them.
The embedded PostgreSQL is durable here (fsync, full-page writes and synchronous commit on): an
event counts only once its commit reached the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import struct
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


def _sampled(i: int) -> tuple[list[int], list[float]]:
    """24 token ids and their log-probs as an engine reports them: ids across a real vocabulary
    (Qwen2's 151,936), log-probs float32 values widened to float (up to 17 digits in JSON: the
    numbers PostgreSQL parses), the same for the same `i`."""
    rng = random.Random(i)
    ids = [rng.randrange(151_936) for _ in range(24)]
    logprobs = struct.unpack("24f", struct.pack("24f", *(-rng.expovariate(2.0) for _ in range(24))))
    return ids, list(logprobs)


def make_events(prefix: str, n: int) -> list[dict]:
    events: list[dict] = []
    for i in range(n // 2):
        ids, logprobs = _sampled(i)
        tid = f"{prefix}-t{i}"
        events.append({
            "type": "trajectory", "id": tid, "policy_version": 1, "task": "tab-completion",
            "prompt": [{"role": "user", "content": f"def f{i}(x):  # ask ann{i}@example.com, host 10.0.{i % 250}.1"
                        if i % 10 == 0 else f"def f{i}(x):  # returns x plus one, see the docs of version 1.2"}],
            "steps": [{"role": "assistant", "content": " return x + 1", "token_ids": ids, "logprobs": logprobs}],
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


def _serve(url: str, root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """uvicorn serving the checkout at `root` (this one, or the --before one) on database `url`."""
    import httpx

    from core import embedded

    port = _free_port()
    # Both sides on the same Redis too: a checkout without var/ would start a server of its own.
    redis = os.environ.get("REDIS_URL") or embedded.redis_url()
    env = {**os.environ, "DATABASE_URL": url, "REDIS_URL": redis, "DJANGO_SETTINGS_MODULE": "webapp.settings"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "webapp.asgi:application", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warning", "--no-access-log"], cwd=root, env=env)
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
    from training.lineage.services import data_policy_update

    creds = project_create(f"bench {uuid.uuid4().hex[:8]}")
    data_policy_update(creds.project, "bench:ingest", redactors=REDACTORS if redact else [])
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
    stored_count_check(creds.project, len(events) + 10)  # and the 10 of the warm-up
    return len(events) / elapsed


def stored_count_check(project, sent: int) -> None:
    """An acknowledged event is in the database: the rows stored equal the events sent (each
    trajectory with its one step), counted after the run, not taken from the answers."""
    from feedback.models import FeedbackEvent, Step, Trajectory

    trajectories = Trajectory.objects.filter(project=project).count()
    stored = trajectories + FeedbackEvent.objects.filter(project=project).count()
    steps = Step.objects.filter(trajectory__project=project).count()
    if stored != sent or steps != trajectories:
        raise RuntimeError(f"{sent} events were sent and acknowledged but the database holds {stored} "
                           f"({trajectories} trajectories with {steps} steps): events were lost")


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int, children: bool = False) -> float:
    """CPU seconds of process `pid` (user + system), with its waited-for children when asked."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12]) + ((int(fields[13]) + int(fields[14])) if children else 0)
    return ticks / _TICK


def _postmaster_pid() -> int | None:
    """The database server's main process when it runs on this machine and we may read it."""
    from django.db import connection

    try:
        with connection.cursor() as cur:
            cur.execute("SHOW data_directory")
            return int((Path(cur.fetchone()[0]) / "postmaster.pid").read_text().split()[0])
    except Exception:  # noqa: BLE001 - a remote or locked-down server: no CPU column
        return None


def _db_cpu_s(postmaster: int | None) -> float | None:
    """CPU seconds of the whole database server: the postmaster, the backends it has reaped, the
    ones alive (connections, the WAL writer, the checkpointer, autovacuum)."""
    if postmaster is None:
        return None
    total = _cpu_s(postmaster, children=True)
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == postmaster:
                total += (int(stat[11]) + int(stat[12])) / _TICK
    return total


def bench_side(base: str, pid: int, postmaster: int | None, n: int, batch: int, clients: int) -> dict[str, float]:
    """One run of `bench_endpoint` with the CPU it cost: the web server's and the database's,
    in microseconds an event (noise-free next to the wall clock on a shared machine)."""
    web0, db0 = _cpu_s(pid), _db_cpu_s(postmaster)
    rate = bench_endpoint(base, n, batch, clients)
    web1, db1 = _cpu_s(pid), _db_cpu_s(postmaster)
    out = {"rate": rate, "web_us": (web1 - web0) / n * 1e6}
    if db0 is not None and db1 is not None:
        out["db_us"] = (db1 - db0) / n * 1e6
    return out


def compare(url: str, before: Path, n: int, clients: int, rounds: int) -> tuple[list[str], dict[str, object]]:
    """The checkout at `before` against this one, both served at once on the same database,
    interleaved: every round runs both sides at batch 100 and 1,000, the order swapped every
    round. Medians over the rounds, with the range; the load is the 1-minute average."""
    import statistics

    servers = {"before": _serve(url, before), "after": _serve(url, ROOT)}
    postmaster, loads = _postmaster_pid(), []
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        for _, base in servers.values():  # first requests import and connect: not measured
            bench_endpoint(base, 1000, 100, clients)
        for k in range(rounds):
            for side in (("before", "after") if k % 2 == 0 else ("after", "before")):
                proc, base = servers[side]
                for batch in (100, 1000):
                    runs.setdefault((side, batch), []).append(bench_side(base, proc.pid, postmaster, n, batch, clients))
                    loads.append(os.getloadavg()[0])
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(20)
    lines = [f"{'batch':>5} {'side':<7} {'events/s median':>16} {'range':>15} {'web CPU us/ev':>14} {'db CPU us/ev':>13}"]
    out: dict[str, object] = {"rounds": rounds, "events": n, "clients": clients,
                              "load_1m": [round(min(loads), 1), round(statistics.median(loads), 1), round(max(loads), 1)],
                              "cores": os.cpu_count()}
    for (side, batch), got in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0] != "before")):
        rates = [g["rate"] for g in got]
        web = statistics.median(g["web_us"] for g in got)
        db = statistics.median(g["db_us"] for g in got) if all("db_us" in g for g in got) else float("nan")
        lines.append(f"{batch:>5} {side:<7} {statistics.median(rates):>16.0f} {min(rates):>7.0f}-{max(rates):<7.0f} "
                     f"{web:>14.1f} {db:>13.1f}")
        out[f"{side}_batch{batch}"] = {"events_per_s": round(statistics.median(rates), 1),
                                       "range": [round(min(rates), 1), round(max(rates), 1)],
                                       "web_cpu_us_per_event": round(web, 1), "db_cpu_us_per_event": round(db, 1)}
    lines.append(f"load (1-minute average) during the runs: min {min(loads):.1f}, median {statistics.median(loads):.1f}, "
                 f"max {max(loads):.1f} on {os.cpu_count()} cores; every run's stored rows counted against what was sent")
    return lines, out


def bench_inprocess(batch: int = 1000, pairs: int = 15) -> dict[str, float]:
    """Milliseconds to ingest one batch through feedback_ingest in this process (parse, redaction,
    the durable commit) with redaction off and with every redactor on, in `pairs` interleaved
    pairs (the order swapped every pair), after one warm-up batch each. Returns the medians of
    both sides and the per-pair ratios' median, quartiles and range."""
    import statistics

    from feedback.services import feedback_ingest, project_create
    from training.lineage.services import data_policy_update

    plain, redacted = (project_create(f"inproc {uuid.uuid4().hex[:8]}").project for _ in range(2))
    data_policy_update(plain, "bench:ingest", redactors=[])
    data_policy_update(redacted, "bench:ingest", redactors=REDACTORS)

    def once(project, tag: str) -> float:
        events = make_events(f"in{tag}-{project.pk}", batch)
        start = time.perf_counter()
        feedback_ingest(project, events)
        return time.perf_counter() - start

    once(plain, "warm"), once(redacted, "warm")
    off, on, ratios = [], [], []
    for k in range(pairs):
        first, second = (plain, redacted) if k % 2 == 0 else (redacted, plain)
        took = {first.pk: once(first, str(k)), second.pk: once(second, str(k))}
        off.append(took[plain.pk] * 1000)
        on.append(took[redacted.pk] * 1000)
        ratios.append(took[redacted.pk] / took[plain.pk])
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return {"pairs": pairs, "off_ms": statistics.median(off), "on_ms": statistics.median(on),
            "ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3,
            "ratio_min": min(ratios), "ratio_max": max(ratios), "best_off_ms": min(off), "best_on_ms": min(on)}


def bench_endpoint_pairs(base: str, batch: int = 1000, pairs: int = 15) -> dict[str, float]:
    """The same interleaved pairs through the endpoint (HTTP + ASGI, one sequential client, as a
    sender sees it: the client's encoding and signature are on both sides): seconds a batch
    with redaction off and on, and the per-pair ratios."""
    import statistics

    from feedback.client import FlywheelClient
    from feedback.services import project_create
    from training.lineage.services import data_policy_update

    sides = []
    for redactors in ([], REDACTORS):
        creds = project_create(f"pairs {uuid.uuid4().hex[:8]}")
        data_policy_update(creds.project, "bench:ingest", redactors=redactors)
        sides.append((creds.project.pk, FlywheelClient(base, creds.webhook_secret, project=creds.project.slug)))

    def once(side, tag: str) -> float:
        events = make_events(f"h{tag}-{side[0]}", batch)
        start = time.perf_counter()
        if side[1].send(events).accepted != len(events):
            raise RuntimeError("the endpoint refused events of the pairs bench")
        return time.perf_counter() - start

    once(sides[0], "warm"), once(sides[1], "warm")
    off, on, ratios = [], [], []
    for k in range(pairs):
        order = sides if k % 2 == 0 else sides[::-1]
        took = {side[0]: once(side, str(k)) for side in order}
        off.append(took[sides[0][0]] * 1000)
        on.append(took[sides[1][0]] * 1000)
        ratios.append(took[sides[1][0]] / took[sides[0][0]])
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return {"pairs": pairs, "off_ms": statistics.median(off), "on_ms": statistics.median(on),
            "ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3,
            "ratio_min": min(ratios), "ratio_max": max(ratios), "best_off_ms": min(off), "best_on_ms": min(on)}


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


def _pairs_line(where: str, batch: int, paired: dict[str, float]) -> str:
    return (f"redaction at batch {batch}, {where}, {paired['pairs']} interleaved pairs: off "
            f"{paired['off_ms']:.0f} ms, on {paired['on_ms']:.0f} ms a batch (medians); per-pair ratio on/off "
            f"median {paired['ratio']:.3f} ({paired['ratio'] - 1:+.1%}), quartiles {paired['ratio_q1']:.3f}-"
            f"{paired['ratio_q3']:.3f}, range {paired['ratio_min']:.3f}-{paired['ratio_max']:.3f}; fastest batches "
            f"{paired['best_off_ms']:.0f} -> {paired['best_on_ms']:.0f} ms "
            f"({paired['best_on_ms'] / paired['best_off_ms'] - 1:+.1%})")


def _pairs_json(paired: dict[str, float]) -> dict[str, object]:
    return {"ms_off_on": [round(paired["off_ms"], 1), round(paired["on_ms"], 1)],
            "ratio_median": round(paired["ratio"], 4), "overhead_median": round(paired["ratio"] - 1, 4),
            "ratio_quartiles": [round(paired["ratio_q1"], 4), round(paired["ratio_q3"], 4)],
            "ratio_range": [round(paired["ratio_min"], 4), round(paired["ratio_max"], 4)],
            # The fastest batch of each side: the one load disturbed least (best-of-N, a second view).
            "best_ms_off_on": [round(paired["best_off_ms"], 1), round(paired["best_on_ms"], 1)],
            "ratio_of_best": round(paired["best_on_ms"] / paired["best_off_ms"], 4)}


def redaction_summary(batch: int, pairs: int, base: str | None = None) -> tuple[list[str], dict[str, object]]:
    """The redaction column: interleaved pairs in process (and through the endpoint at `base`)."""
    paired = bench_inprocess(batch, pairs)
    alone = bench_redact_only(batch)
    lines = [_pairs_line("in process (parse + durable commit)", batch, paired)
             + f"; the redaction alone {alone:.1f} ms ({alone / paired['off_ms']:.1%} of the plain batch)"]
    out: dict[str, object] = {"batch": batch, "pairs": pairs, "order": "interleaved, swapped every pair",
                              "inprocess": _pairs_json(paired), "redaction_alone_ms": round(alone, 2),
                              "redaction_alone_share": round(alone / paired["off_ms"], 4)}
    if base is not None:
        http = bench_endpoint_pairs(base, batch, pairs)
        lines.append(_pairs_line("through the endpoint (HTTP + ASGI, 1 client)", batch, http))
        out["endpoint"] = _pairs_json(http)
    return lines, {**out, "load_1m": round(os.getloadavg()[0], 2), "cores": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--naive-events", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--redaction-only", action="store_true", help="only the in-process redaction column")
    parser.add_argument("--batch", type=int, default=1000, help="events a batch in the redaction column")
    parser.add_argument("--pairs", type=int, default=15, help="interleaved off/on pairs (at least 7)")
    parser.add_argument("--quick", action="store_true", help="the redaction column at batch 50, 7 pairs")
    parser.add_argument("--before", help="a checkout to compare with (git worktree add ../before main): both served "
                                         "on one database, batch 100 and 1,000 interleaved, CPU per event")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of --before")
    parser.add_argument("--keep-db", action="store_true", help="keep the bench database of earlier runs (by default "
                                                               "it is dropped and made again)")
    args = parser.parse_args()
    if args.pairs < 7:
        parser.error("--pairs must be at least 7: fewer pairs give no spread worth reading")

    # A fresh database each run: its tables grow by about 250,000 events a run, and on the
    # millionth row the same code measured 20-30% slower (its indexes out of PostgreSQL's cache).
    # --quick (the suite's check, in process, a few batches) keeps it: no migration to wait for.
    url = setup_django(BENCH_DB, fresh=not (args.keep_db or args.quick))
    if args.before is not None:
        lines, compared = compare(url, Path(args.before).resolve(), args.events, args.clients, args.rounds)
        print("\n".join(lines))
        if args.json:
            print(json.dumps(compared))
        return
    if args.quick:  # in process only: no server to start
        lines, redaction = redaction_summary(50, 7)
        print("\n".join(lines))
        if args.json:
            print(json.dumps(redaction))
        return
    proc, base = _serve(url)
    try:
        lines, redaction = redaction_summary(args.batch, args.pairs, base)
        if args.redaction_only:
            print("\n".join(lines))
            if args.json:
                print(json.dumps(redaction))
            return
        naive = bench_naive(args.naive_events)
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
    print("\n".join(lines))
    print(f"redaction at batch 1000 over HTTP (4 clients at once, not paired: noisier): {http_overhead:+.1%} time")
    if args.json:
        print(json.dumps({
            "naive_events_per_s": round(naive, 1),
            "endpoint_events_per_s": round(best, 1),
            "endpoint_events_per_s_batch100": round(rates[100], 1),
            "endpoint_events_per_s_batch1000": round(rates[1000], 1),
            "speedup": round(best / naive, 2),
            "endpoint_events_per_s_batch1000_redacted": round(redacting, 1),
            "redaction_overhead_batch1000": round(http_overhead, 4),
            "redaction_inprocess": redaction,
            "clients": args.clients,
            "cores": os.cpu_count(),
        }))


if __name__ == "__main__":
    main()
