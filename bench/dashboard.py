"""Dashboard render time per page at the seed_load volume.

    .venv/bin/python bench/dashboard.py [--events 1000000] [--trajectories 100000] [--repeat 20] [--json]
    .venv/bin/python bench/dashboard.py --quick --json    # seconds: a tiny load, 2 requests per page

Runs on a bench database of the embedded PostgreSQL (or DATABASE_URL's server), seeded once by
`manage.py seed_load` (kept between runs; a smaller load than asked is topped up), its rollups
refreshed before the timing as beat would. Each page is
rendered in-process through the full Django stack (middleware, session, templates) as a staff user
who is a viewer of the project: one warm-up request, then --repeat timed requests; p50/p95 per page
in milliseconds. `--quick` (its own database) checks that every page still renders, nothing more.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._django import setup_django  # noqa: E402

BENCH_DB = "flywheel_bench_dashboard"
SLUG = "bench"


def _seed(events: int, trajectories: int) -> tuple[int, int]:
    from django.core.management import call_command
    from django.db import connection

    from webapp.rollups import rollups_refresh

    def counts() -> tuple[int, int]:
        with connection.cursor() as cur:
            cur.execute("SELECT (SELECT count(*) FROM feedback_feedbackevent fe JOIN feedback_project p "
                        "ON p.id = fe.project_id WHERE p.slug = %s), (SELECT count(*) FROM feedback_trajectory t "
                        "JOIN feedback_project p ON p.id = t.project_id WHERE p.slug = %s)", [SLUG, SLUG])
            return cur.fetchone()

    have_events, have_trajectories = counts()
    if have_events < events:
        call_command("seed_load", events=events - have_events,
                     trajectories=max(trajectories - have_trajectories, 4), project=SLUG)
        with connection.cursor() as cur:
            cur.execute("VACUUM ANALYZE")
    # What beat does every minute; on a database kept from an older checkout, it fills what a newer
    # migration added to the rollups (they forget their watermarks).
    rollups_refresh()
    return counts()


def _pages() -> dict[str, str]:
    from feedback.models import Trajectory
    from training.models import TrainingRun

    runs = list(TrainingRun.objects.filter(project__slug=SLUG).order_by("id").values_list("id", flat=True)[:2])
    t = Trajectory.objects.filter(project__slug=SLUG, steps__routing__isnull=False).order_by("-id").first()
    return {
        "index": "/",
        "overview": f"/p/{SLUG}/",
        "runs": f"/p/{SLUG}/runs/?run={runs[0]}&compare={runs[1]}",
        "rubrics": f"/p/{SLUG}/rubrics/",
        "rubrics_filtered": f"/p/{SLUG}/rubrics/?task=chat&tag=ide",
        "rollouts": f"/p/{SLUG}/rollouts/?task=refactor",
        "replay": f"/p/{SLUG}/rollouts/{t.id}/?task={t.task}",
        "registry": f"/p/{SLUG}/registry/?at=2030-01-01T00:00",
        "corpora": f"/p/{SLUG}/corpora/",
        "data": f"/p/{SLUG}/data/",
    }


def _time_pages(repeat: int) -> dict[str, tuple[float, float]]:
    from django.contrib.auth.models import User
    from django.test import Client

    from feedback.models import Project
    from training.promotion.services import membership_grant

    user, _ = User.objects.get_or_create(username="bench-viewer", defaults={"is_staff": True})
    # Pages are shown to the project's members only (a staff flag alone sees nothing).
    membership_grant(Project.objects.get(slug=SLUG), user, "viewer", "system:bench", "bench/dashboard.py viewer")
    client = Client(HTTP_HOST="localhost")  # an allowed host of the default settings (testserver is not)
    client.force_login(user)
    out = {}
    for name, url in _pages().items():
        assert client.get(url).status_code == 200, url
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            response = client.get(url)
            samples.append((time.perf_counter() - start) * 1000)
            assert response.status_code == 200, url
        samples.sort()
        out[name] = (statistics.median(samples), samples[max(0, round(0.95 * len(samples)) - 1)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--trajectories", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a tiny load and 2 requests per page (CI)")
    args = parser.parse_args()
    if args.quick:
        args.events, args.trajectories, args.repeat = 2_000, 200, 2

    setup_django(BENCH_DB + ("_quick" if args.quick else ""))
    events, trajectories = _seed(args.events, args.trajectories)
    times = _time_pages(args.repeat)
    print(f"volume: {events} feedback events, {trajectories} trajectories; {os.cpu_count()} cores; "
          f"{args.repeat} requests per page")
    print(f"{'page':<18} {'p50 ms':>8} {'p95 ms':>8}")
    for name, (p50, p95) in times.items():
        print(f"{name:<18} {p50:>8.1f} {p95:>8.1f}")
    if args.json:
        out = {"p95_ms_max": round(max(p95 for _, p95 in times.values()), 1)}
        out.update({f"p95_ms_{name}": round(p95, 1) for name, (_, p95) in times.items()})
        out.update({f"p50_ms_{name}": round(p50, 1) for name, (p50, _) in times.items()})
        out.update({"events": events, "trajectories": trajectories, "cores": os.cpu_count()})
        print(json.dumps(out))


if __name__ == "__main__":
    main()
