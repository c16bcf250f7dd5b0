"""Lineage query time: "which versions learned from user U" over a project of 1M events.

    .venv/bin/python bench/lineage.py [--events 1000000] [--users 10000] [--runs 200] [--json]
    .venv/bin/python bench/lineage.py --quick          # 100,000 events

Seeds a bench database (its own, on the embedded PostgreSQL or DATABASE_URL's server) in SQL
(generate_series): half the events trajectories served to `--users` users, half feedback by
them on those trajectories; `--runs` training runs, each with a candidate version built on the
previous one and a lineage covering its slice of consecutive trajectories and their feedback
(as a run records it: id multiranges). Then times `training.lineage.selectors.lineage_of` for
one user (the median of `--repeat` calls, warm) and for one trajectory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._django import setup_django  # noqa: E402

BENCH_DB = "flywheel_bench_lineage"

_TRAJECTORIES = """
INSERT INTO feedback_trajectory (project_id, external_id, policy_version, source, task, tags, prompt, extra,
                                 occurred_at, received_at, user_hash, no_train)
SELECT %(p)s, 't-' || i, 1, 'live', 'tab-completion', '[]', '[{"role": "user", "content": "def f(x):"}]', '{}',
       now() - make_interval(secs => %(n)s - i), now() - make_interval(secs => %(n)s - i),
       (%(hashes)s::text[])[1 + (i::bigint * 7919) %% %(u)s], false
FROM generate_series(0, %(n)s - 1) AS i
"""
_FEEDBACK = """
INSERT INTO feedback_feedbackevent (project_id, event_id, trajectory_external_id, trajectory_id, signal, value, step,
                                    user_hash, aspect_labels, extra, occurred_at, received_at, no_train)
SELECT %(p)s, 'f-' || t.external_id, t.external_id, t.id, 'accept', NULL, 0, t.user_hash, NULL, '{}', t.occurred_at,
       t.received_at, false
FROM feedback_trajectory t WHERE t.project_id = %(p)s
"""
# Run k trained on the k-th slice of trajectories (by id) and on their feedback.
_LINEAGE = """
INSERT INTO training_runlineage (run_id, project_id, trajectories, feedback, trajectory_count, feedback_count,
                                 created_at)
SELECT r.run_id, %(p)s,
       (SELECT range_agg(int8range(t.id, t.id + 1)) FROM feedback_trajectory t
        WHERE t.project_id = %(p)s AND t.id >= %(t0)s + (r.k - 1) * %(per)s AND t.id < %(t0)s + r.k * %(per)s),
       (SELECT range_agg(int8range(f.id, f.id + 1)) FROM feedback_feedbackevent f
        WHERE f.project_id = %(p)s AND f.trajectory_id >= %(t0)s + (r.k - 1) * %(per)s
          AND f.trajectory_id < %(t0)s + r.k * %(per)s),
       %(per)s, %(per)s, now()
FROM unnest(%(runs)s::bigint[]) WITH ORDINALITY AS r(run_id, k)
"""


def seed(events: int, users: int, runs: int) -> tuple[object, float]:
    from django.db import connection

    from feedback.models import Project
    from feedback.services import user_hash_of
    from training.models import PolicyVersion, TrainingRun

    project = Project.objects.create(slug=f"lineage-{uuid.uuid4().hex[:8]}", name="lineage bench")
    hashes = [user_hash_of(project, f"u-{k}") for k in range(users)]
    n = events // 2
    start = time.perf_counter()
    with connection.cursor() as cur:
        cur.execute(_TRAJECTORIES, {"p": project.pk, "n": n, "hashes": hashes, "u": users})
        cur.execute(_FEEDBACK, {"p": project.pk})
        cur.execute("SELECT min(id) FROM feedback_trajectory WHERE project_id = %s", [project.pk])
        t0 = cur.fetchone()[0]
    parent = PolicyVersion.objects.create(project=project, number=1, state="production")
    run_ids = []
    for k in range(runs):
        version = PolicyVersion.objects.create(project=project, number=k + 2, parent=parent, state="candidate")
        run_ids.append(TrainingRun.objects.create(project=project, base_version=parent, candidate=version,
                                                  state="succeeded").pk)
        parent = version
    with connection.cursor() as cur:
        cur.execute(_LINEAGE, {"p": project.pk, "t0": t0, "per": max(1, n // runs), "runs": run_ids})
        cur.execute("ANALYZE feedback_trajectory; ANALYZE feedback_feedbackevent; ANALYZE training_runlineage")
    return project, time.perf_counter() - start


def timed(fn, repeat: int) -> tuple[float, object]:
    out, times = None, []
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="100,000 events")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.events = 100_000
    setup_django(BENCH_DB)
    from training.lineage.selectors import lineage_of

    project, seconds = seed(args.events, args.users, args.runs)
    lineage_of(project, user="u-42")  # warm
    user_ms, versions = timed(lambda: lineage_of(project, user="u-42"), args.repeat)
    traj_ms, _ = timed(lambda: lineage_of(project, trajectory="t-12345"), args.repeat)
    direct = sum(1 for v in versions if v.direct)
    print(f"{'query':<48} {'median ms':>10} {'versions':>9}")
    print(f"{'one user (their trajectories and feedback)':<48} {user_ms:>10.1f} {len(versions):>9}")
    print(f"{'one trajectory':<48} {traj_ms:>10.1f}")
    print(f"seeded {args.events:,} events, {args.users:,} users, {args.runs} runs in {seconds:.1f} s; "
          f"the user's data reached {direct} version(s) directly")
    if args.json:
        print(json.dumps({"events": args.events, "users": args.users, "runs": args.runs,
                          "user_query_ms": round(user_ms, 2), "trajectory_query_ms": round(traj_ms, 2),
                          "versions_learned": len(versions), "direct": direct, "goal_ms": 200,
                          "meets_goal": user_ms <= 200}))


if __name__ == "__main__":
    main()
