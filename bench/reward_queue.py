"""The reward queue's pass (beat runs it every 30 s per project): its cost as a project grows.

    .venv/bin/python bench/reward_queue.py [--sizes 20000,200000] [--repeat 5] [--json]
    .venv/bin/python bench/reward_queue.py --quick --json      # seconds (CI)

For each size, a project is filled with `seed_load` (trajectories with a step, two feedback events
each, every one already rewarded) on a fresh bench database, and the pass is timed three ways:

- `whole`: the pending query over the whole project, which was every pass before the due rows
  (and every pass of a new spec's first full pass, and of the daily net, before the windows):
  with nothing to score it reads every trajectory and its feedback;
- `idle`: the pass with nothing new (no due rows);
- `new`: the pass after a batch of 100 new events (50 trajectories, feedback on 50 old ones),
  scoring those 100 trajectories (median of `--repeat` batches; the scoring itself is in it).
  `whole+new` is the whole-project query over the same state, for the same work;
- `spec_whole` and `spec_window`: after a new spec (everything to score), the query that finds a
  pass's 1,000 to score: the whole project's (every pass of a full pass before) against the one
  window of the project's trajectories (FULL_WINDOW_FACTOR x 1,000 of its ids) a pass reads now.

Milliseconds of wall clock on an otherwise idle database (PostgreSQL's own work and Python's),
the median of `--repeat` passes with their range.

Then the drain (beat's task, `rewards_drain`): `--drain` trajectories with a click each, as
bench/ingest.py sends them, scored under a new project's default spec (the feedback map and the
rule judge's two aspects), passes until the queue is empty: rewards a second. Beat's task used
to make one pass of 1,000 every 30 s, at most 33 rewards a second a project.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._django import setup_django  # noqa: E402

BENCH_DB = "flywheel_bench_rewards"


def _ms(samples: list[float]) -> tuple[float, float, float]:
    return statistics.median(samples) * 1000, min(samples) * 1000, max(samples) * 1000


def _measure(slug: str, size: int, repeat: int) -> dict[str, tuple[float, float, float]]:
    from django.core.management import call_command
    from django.db import connection
    from django.utils import timezone

    from feedback.models import Project
    from feedback.services import feedback_ingest
    from training.models import RewardSpec
    from training.rewards import selectors
    from training.rewards.services import (
        FULL_WINDOW_FACTOR,
        reward_spec_current,
        reward_spec_update,
        rewards_compute_pending,
        rewards_drain,
    )

    call_command("seed_load", events=2 * size, trajectories=size, project=slug, run_steps=10, stdout=open(os.devnull, "w"))
    project = Project.objects.get(slug=slug)
    RewardSpec.objects.filter(project=project).update(judge={}, aspects=[], settle_seconds=0)
    with connection.cursor() as cur:
        # seed_load spreads feedback up to 5 minutes after its trajectory, the newest into the
        # future: moved into the past, so that the seeded rewards are current and nothing waits.
        cur.execute("UPDATE feedback_feedbackevent SET received_at = now() - interval '10 minutes' "
                    "WHERE project_id = %s AND received_at > now() - interval '10 minutes'", [project.pk])
        cur.execute("VACUUM ANALYZE")
    rewards_drain(project, budget_s=3600)  # the first full pass, window by window: the queue starts empty
    spec = reward_spec_current(project)
    assert spec.full_pass_at is not None

    def whole() -> int:
        return len(list(selectors.trajectories_reward_pending(project, spec, timezone.now())
                        .values_list("pk", flat=True)[:1000]))

    def a_pass() -> int:
        return rewards_compute_pending(project, now=timezone.now() + timedelta(seconds=1))

    out: dict[str, list[float]] = {"whole": [], "idle": [], "new": [], "whole+new": []}

    def measure(name: str, fn, expected: int) -> None:
        start = time.perf_counter()
        got = fn()
        out[name].append(time.perf_counter() - start)
        assert got == expected, (name, got)

    old = list(project.trajectories.order_by("id").values_list("external_id", flat=True)[:50 * repeat])
    for r in range(repeat):
        measure("whole", whole, 0)
        measure("idle", a_pass, 0)
        events = []
        for i in range(50):
            tid = f"bench-{r}-t{i}"
            events += [{"type": "trajectory", "id": tid, "policy_version": 1, "task": "tab-completion",
                        "prompt": [{"role": "user", "content": f"def g{i}(x):"}],
                        "steps": [{"role": "assistant", "content": " return x"}],
                        "occurred_at": "2026-11-29T08:00:00Z"},
                       {"type": "feedback", "id": f"bench-{r}-f{i}", "trajectory_id": old[r * 50 + i],
                        "signal": "accept", "occurred_at": "2026-11-29T08:00:05Z"}]
        feedback_ingest(project, events)
        measure("whole+new", whole, 100)
        measure("new", a_pass, 100)
    # A new spec (edited after rewards used the old one: a new version, everything to score). The
    # query that finds a pass's 1,000 was the whole project's each pass; it is one window now.
    spec = reward_spec_update(project, signal_rewards={"accept": 1.0, "reject": -1.0})
    out["spec_whole"], out["spec_window"] = [], []

    def window() -> int:
        rows = selectors.trajectory_window(project, None, FULL_WINDOW_FACTOR * 1000)
        return len(list(selectors.trajectories_reward_pending(project, spec, timezone.now(), [pk for pk, _ in rows])
                        .values_list("pk", flat=True)[:1000]))

    for _ in range(repeat):
        measure("spec_whole", lambda: len(list(selectors.trajectories_reward_pending(project, spec, timezone.now())
                                               .values_list("pk", flat=True)[:1000])), 1000)
        measure("spec_window", window, 1000)
    return {name: _ms(samples) for name, samples in out.items()}


def _drain(n: int) -> tuple[float, int]:
    from bench.ingest import make_events
    from feedback.services import feedback_ingest, project_create
    from training.rewards.services import reward_spec_update, rewards_drain

    project = project_create("Drain", "drain").project
    reward_spec_update(project, settle_seconds=0)
    for start in range(0, 2 * n, 1000):
        feedback_ingest(project, make_events(f"d{start}", min(1000, 2 * n - start)))
    gc.collect()
    gc.freeze()  # as a Celery worker's heap is (webapp/celery.py)
    begin = time.perf_counter()
    scored = rewards_drain(project, budget_s=3600)
    return time.perf_counter() - begin, scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20000,200000", help="trajectories per project, comma-separated")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--drain", type=int, default=5000, help="trajectories the drain scores")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2,000 trajectories, 2 rounds (CI)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeat, args.drain = "2000", 2, 500
    sizes = [int(s) for s in args.sizes.split(",")]

    setup_django(BENCH_DB + ("_quick" if args.quick else ""), fresh=True)
    rows = {size: _measure(f"bench{size}", size, args.repeat) for size in sizes}
    drain_s, drained = _drain(args.drain)
    assert drained == args.drain, drained
    print(f"reward queue pass, ms (median, range over {args.repeat}); {os.cpu_count()} cores")
    print(f"{'trajectories':>12} {'whole':>22} {'idle':>18} {'whole+new':>22} {'new':>22}")
    for size, row in rows.items():
        cells = [f"{m:.1f} ({lo:.1f}-{hi:.1f})" for m, lo, hi in (row[k] for k in ("whole", "idle", "whole+new", "new"))]
        print(f"{size:>12} {cells[0]:>22} {cells[1]:>18} {cells[2]:>22} {cells[3]:>22}")
    print("a new spec (everything to score), the query that finds a pass's 1,000, ms: the whole project's "
          "(every such pass before) against one window of the project's ids")
    for size, row in rows.items():
        (wm, wlo, whi), (nm, nlo, nhi) = row["spec_whole"], row["spec_window"]
        print(f"{size:>12} whole {wm:.1f} ({wlo:.1f}-{whi:.1f})  window {nm:.1f} ({nlo:.1f}-{nhi:.1f})")
    print(f"drain: {drained} trajectories scored in {drain_s:.2f} s, {drained / drain_s:.0f} rewards/s "
          "(default spec: feedback map and rule judge)")
    if args.json:
        out: dict[str, float] = {}
        for size, row in rows.items():
            for name, (median, _, _) in row.items():
                out[f"{name.replace('+', '_')}_ms_{size}"] = round(median, 2)
            out[f"idle_ratio_{size}"] = round(row["whole"][0] / max(row["idle"][0], 1e-3), 1)
        out["drain_per_s"] = round(drained / drain_s, 1)
        out["cores"] = os.cpu_count() or 0
        print(json.dumps(out))


if __name__ == "__main__":
    main()
