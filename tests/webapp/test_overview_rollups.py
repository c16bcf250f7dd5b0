"""The overview read from rollups shows what the raw rows say: its charts, totals and usefulness per
version equal the same figures computed from the raw rows, after late feedback, feedback linked to
a trajectory that came later and an erasure; the retention sweep leaves the rollups' history (the
hours whose raw rows expired) as it was; and it reads a fixed number of queries."""

from __future__ import annotations

import os
from collections import defaultdict
from datetime import datetime, timedelta

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.db.models import Count, Exists, OuterRef, Q, Sum
from django.db.models.functions import TruncHour, TruncMinute
from django.test import Client
from django.utils import timezone

from feedback.models import FeedbackEvent, Trajectory
from feedback.userdata.services import data_policy_set, retention_sweep, user_rows_erase
from tests.factories import feedback, trajectory
from training.models import Reward
from webapp import selectors, usefulness
from webapp.db_roles import grant_app_role
from webapp.models import RollupDirty
from webapp.rollups import rollups_rebuild, rollups_refresh

pytestmark = pytest.mark.django_db

DAYS = 14


def _iso(delta: timedelta) -> str:
    return (timezone.now() - delta).isoformat()


def _served(ident: str, ago: timedelta, version: int, **fields) -> dict:
    return trajectory(ident, policy_version=version, occurred_at=_iso(ago),
                      steps=[{"role": "assistant", "content": f" return {ident}"}], **fields)


@pytest.fixture
def seeded(creds, post_events):
    """seed_load's 14 days (received in the past), then events received now: a late accept on an old
    trajectory, an accept that came before its trajectory, feedback whose trajectory never comes, a
    part hour at the range's start, the last minutes, and the rows of a user who will be erased."""
    call_command("seed_load", events=900, trajectories=160, project=creds.project.slug, run_steps=5, stdout=None)
    # Rewards computed long ago: a refresh then recomputes only the hours that new rows touch.
    Reward.objects.filter(trajectory__project=creds.project).update(computed_at=timezone.now() - timedelta(days=1))
    rollups_rebuild()
    old = Trajectory.objects.filter(project=creds.project, policy_version=6).order_by("occurred_at").first()
    events = [
        feedback("late-accept", old.external_id, "accept", value=12, occurred_at=_iso(timedelta(hours=1))),
        feedback("early-accept", "t-later", "accept", value=7, occurred_at=_iso(timedelta(days=2))),
        feedback("orphan-old", "t-never", "reject", occurred_at=_iso(timedelta(days=4))),  # no version, ever
        feedback("orphan-new", "t-never", "happy", occurred_at=_iso(timedelta(minutes=20))),
        _served("t-head", timedelta(days=DAYS, minutes=-20), 5),
        _served("t-recent", timedelta(minutes=30), 7),
        feedback("recent-accept", "t-recent", "accept", value=3, occurred_at=_iso(timedelta(minutes=29))),
        _served("t-erased", timedelta(days=3), 6, user="u-erase"),
        feedback("erased-own", "t-erased", "accept", value=5, user="u-erase", occurred_at=_iso(timedelta(days=3))),
        feedback("erased-other", old.external_id, "accept", value=9, user="u-erase",
                 occurred_at=_iso(timedelta(days=1))),
    ]
    assert post_events(events).status_code == 202
    rollups_refresh()
    assert post_events([_served("t-later", timedelta(days=2), 7)]).status_code == 202  # links early-accept
    rollups_refresh()
    return creds.project


# --- the same figures from the raw rows ---------------------------------------------------------


def _rate(pos: int, neg: int) -> float | None:
    return round(pos / (pos + neg), 4) if pos + neg else None


def _feedback_raw(project, since, cut) -> tuple[set, int, float | None]:
    rows = FeedbackEvent.objects.filter(project=project)
    hourly = (rows.annotate(at=TruncHour("occurred_at")).filter(at__gte=since, at__lt=cut)
              .values("at", "trajectory__policy_version"))
    minutes = (rows.filter(occurred_at__gte=max(since, cut)).annotate(at=TruncMinute("occurred_at"))
               .values("at", "trajectory__policy_version"))
    points, total, pos_all, rated = set(), 0, 0, 0
    for qs in (hourly, minutes):
        for r in qs.annotate(n=Count("id"), pos=Count("id", filter=Q(signal__in=selectors.POSITIVE)),
                             neg=Count("id", filter=Q(signal__in=selectors.NEGATIVE))):
            points.add((r["at"].isoformat(), r["trajectory__policy_version"], r["n"], _rate(r["pos"], r["neg"])))
            total, pos_all, rated = total + r["n"], pos_all + r["pos"], rated + r["pos"] + r["neg"]
    return points, total, (pos_all / rated if rated else None)


def _feedback_shown(project, since, cut) -> tuple[set, int, float | None]:
    series = selectors.feedback_series(project, since, cut)
    points = {(x, version, n, rate) for version, s in series["by_version"].items()
              for x, n, rate in zip(s["x"], s["n"], s["rate"], strict=True)}
    return points, series["total"], series["rate"]


def _latest_reward(t: Trajectory) -> float | None:
    rewards = sorted(t.rewards.all(), key=lambda r: r.spec.version, reverse=True)
    return rewards[0].total if rewards else None


def _rewards_raw(project, since, cut) -> dict[tuple, tuple]:
    buckets: dict[tuple, list] = defaultdict(lambda: [0, 0, 0.0])
    for t in Trajectory.objects.filter(project=project).prefetch_related("rewards__spec"):
        hour = t.occurred_at.replace(minute=0, second=0, microsecond=0)
        if since <= hour < cut:
            at = hour
        elif t.occurred_at >= max(since, cut):
            at = t.occurred_at.replace(second=0, microsecond=0)
        else:
            continue
        b, reward = buckets[(at.isoformat(), t.policy_version)], _latest_reward(t)
        b[0] += 1
        if reward is not None:
            b[1], b[2] = b[1] + 1, b[2] + reward
    return {(at, v): (n, round(s / r, 4) if r else None) for (at, v), (n, r, s) in buckets.items()}


def _rewards_shown(project, since, cut) -> dict[tuple, tuple]:
    return {(x, version): (n, reward) for version, s in selectors.reward_series(project, since, cut).items()
            for x, reward, n in zip(s["x"], s["reward"], s["trajectories"], strict=True)}


def _assert_rewards_equal(shown: dict, raw: dict) -> None:
    # Sums of floats in another order: a mean may round to the next 4th decimal (0.2129 vs 0.213).
    assert shown.keys() == raw.keys()
    for key, (n, reward) in raw.items():
        assert shown[key][0] == n, key
        assert (shown[key][1] is None) == (reward is None), key
        assert reward is None or shown[key][1] == pytest.approx(reward, abs=1.01e-4), key


def _usefulness_raw(project, numbers, since) -> dict[int, tuple]:
    """What accept_by_version computed from the raw rows before the rollups."""
    live = Trajectory.objects.filter(project=project, source="live", policy_version__in=numbers, occurred_at__gte=since)
    clicked = Exists(FeedbackEvent.objects.filter(trajectory=OuterRef("pk"), signal="accept"))
    counts = dict((v, (n, a)) for v, n, a in live.values_list("policy_version")
                  .annotate(n=Count("id"), a=Count("id", filter=Q(clicked))).order_by())
    chars = dict(FeedbackEvent.objects.filter(project=project, signal="accept", trajectory__source="live",
                                              trajectory__policy_version__in=numbers,
                                              trajectory__occurred_at__gte=since)
                 .values_list("trajectory__policy_version").annotate(chars=Sum("value")).order_by())
    return {v: (n, a / n, float(chars.get(v) or 0) / n) for v, (n, a) in counts.items()}


def _newest_raw(project, numbers, since) -> list[tuple[int, str, str]]:
    out = []
    for number in sorted(numbers):
        rows = (Trajectory.objects.filter(project=project, source="live", policy_version=number, occurred_at__gte=since)
                .order_by("-id").prefetch_related("steps")[:usefulness.NAME_SAMPLE])
        out += [(t.id, str(t.prompt[-1].get("content", "")),
                 "".join(s.content for s in t.steps.all() if s.role == "assistant")) for t in rows]
    return out


def _assert_overview_matches_raw(project) -> None:
    now = timezone.now()
    since, cut = now - timedelta(days=DAYS), selectors.recent_cut(now)
    assert _feedback_shown(project, since, cut) == _feedback_raw(project, since, cut)
    _assert_rewards_equal(_rewards_shown(project, since, cut), _rewards_raw(project, since, cut))
    rows = selectors.accept_by_version(project, DAYS)
    numbers = [r["number"] for r in rows]
    raw = _usefulness_raw(project, numbers, now - timedelta(days=DAYS))
    shown = {r["number"]: (r["served"], r["live"], r["accepted_chars"]) for r in rows if r["served"]}
    assert shown == raw
    newest = usefulness.newest_suggestions(project, numbers, since)
    assert [(s.id, s.prompt, s.completion) for s in newest] == _newest_raw(project, numbers, since)


# --- the tests ----------------------------------------------------------------------------------


def test_the_overview_from_rollups_equals_the_raw_rows_with_late_and_linked_feedback(seeded):
    _assert_overview_matches_raw(seeded)
    linked = FeedbackEvent.objects.get(event_id="early-accept")
    assert linked.trajectory.external_id == "t-later"  # the accept that came first counts for v7
    v7 = next(r for r in selectors.accept_by_version(seeded, DAYS) if r["number"] == 7)
    assert v7["accepted_chars"] > 0


def test_an_erasure_leaves_the_overview_equal_to_the_raw_rows(seeded):
    before = {r["number"]: r["served"] for r in selectors.accept_by_version(seeded, DAYS)}
    user_rows_erase(seeded, "u-erase")
    assert RollupDirty.objects.filter(project_id=seeded.id).exists()  # the delete triggers saw it
    rollups_refresh()
    assert not RollupDirty.objects.exists()
    _assert_overview_matches_raw(seeded)
    after = {r["number"]: r["served"] for r in selectors.accept_by_version(seeded, DAYS)}
    assert after[6] == before[6] - 1  # t-erased is no longer served


def _whole_hours(project, since, cut) -> tuple[dict, dict, dict]:
    """The overview's figures of the whole hours from `since` (an hour) to `cut`, from the rollups:
    feedback (volume, rate) and rewards (trajectories, mean) per (hour, version); and each version's
    usefulness (these hours and the raw minutes after `cut`)."""
    def whole(x: str) -> bool:
        return datetime.fromisoformat(x) < cut

    feedback = {(x, v): (n, rate) for x, v, n, rate in _feedback_shown(project, since, cut)[0] if whole(x)}
    rewards = {key: row for key, row in _rewards_shown(project, since, cut).items() if whole(key[0])}
    return feedback, rewards, usefulness.served_by_version(project, list(range(1, 10)), since, cut)


def _before(figures: dict, at: datetime) -> dict:
    return {key: row for key, row in figures.items() if datetime.fromisoformat(key[0]) < at}


def test_the_retention_sweep_keeps_the_rollups_history_and_an_erasure_still_removes_the_user(seeded):
    now = timezone.now()
    since, cut = usefulness.hour_after(now - timedelta(days=DAYS)), selectors.recent_cut(now)
    expired = now - timedelta(days=7)
    swept_hours = expired.replace(minute=0, second=0, microsecond=0)  # before it, every hour expired whole
    before = _whole_hours(seeded, since, cut)
    assert _before(before[0], swept_hours) and _before(before[1], swept_hours)

    data_policy_set(seeded, retention_days=7)
    swept = retention_sweep(seeded, now=now, batch=500)
    assert swept["feedback"] > 0 and swept["trajectories"] > 0
    assert not FeedbackEvent.objects.filter(project=seeded, received_at__lt=expired).exists()
    assert not FeedbackEvent.objects.filter(project=seeded, occurred_at__lt=swept_hours).exists()
    # t-head came now, so it is kept
    assert list(Trajectory.objects.filter(project=seeded, occurred_at__lt=swept_hours)
                .values_list("external_id", flat=True)) == ["t-head"]
    assert not RollupDirty.objects.exists()  # the sweep marked no unit dirty
    rollups_refresh()
    assert _whole_hours(seeded, since, cut) == before  # the rollups outlive the raw rows

    user_rows_erase(seeded, "u-erase")
    assert RollupDirty.objects.filter(project_id=seeded.id).exists()  # an erasure still marks its units
    rollups_refresh()
    feedback, rewards, served = _whole_hours(seeded, since, cut)
    assert _before(feedback, swept_hours) == _before(before[0], swept_hours)  # history still kept
    assert _before(rewards, swept_hours) == _before(before[1], swept_hours)
    # Hours within retention equal the raw rows: the user's rows are no longer counted. (A sweep's
    # trajectory takes its feedback of the next minutes along: the hour after the cut off may keep it.)
    kept = swept_hours + timedelta(hours=2)
    assert _feedback_shown(seeded, kept, cut) == _feedback_raw(seeded, kept, cut)
    _assert_rewards_equal(_rewards_shown(seeded, kept, cut), _rewards_raw(seeded, kept, cut))
    assert sum(n for n, _ in feedback.values()) == sum(n for n, _ in before[0].values()) - 2  # erased-own, -other
    assert served[6].served == before[2][6].served - 1  # t-erased


def test_a_refresh_that_rolls_back_leaves_the_deleted_units_for_the_next(seeded):
    user_rows_erase(seeded, "u-erase")
    dirty = RollupDirty.objects.count()
    with pytest.raises(RuntimeError), transaction.atomic():
        rollups_refresh()
        raise RuntimeError("the worker died before its commit")
    assert RollupDirty.objects.count() == dirty
    rollups_refresh()
    _assert_overview_matches_raw(seeded)


def test_the_overview_reads_a_fixed_number_of_queries(seeded, bob, post_events, django_assert_num_queries):
    client = Client()
    client.force_login(bob)
    url = f"/p/{seeded.slug}/"
    assert client.get(url).status_code == 200
    # session, user, project, membership; charts 5; versions; run 2; usefulness 5 (versions, served,
    # gate reports, newest suggestions, their clicks); errors 3
    with django_assert_num_queries(20):
        assert client.get(url).status_code == 200
    post_events([_served(f"t-more-{i}", timedelta(minutes=10 + i), 8) for i in range(30)]
                + [feedback(f"f-more-{i}", f"t-more-{i}", "accept", value=i) for i in range(30)])
    rollups_refresh()
    with django_assert_num_queries(20):
        assert client.get(url).status_code == 200


def test_the_application_role_erases_and_its_delete_triggers_mark_the_units(seeded):
    role = f"flywheel_app_rollups_{os.getpid()}"
    with connection.cursor() as cur:
        cur.execute(f"CREATE ROLE {role} NOLOGIN")  # rolled back with the test's transaction
    grant_app_role(role)
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute(f"SET LOCAL ROLE {role}")
        user_rows_erase(seeded, "u-erase")
        kinds = set(RollupDirty.objects.filter(project_id=seeded.id).values_list("kind", flat=True))
        cur.execute("RESET ROLE")
    assert kinds == {"feedback_hour", "trajectory_hour"}


def test_a_project_without_versions_or_rows_has_an_empty_overview(creds, bob):
    assert usefulness.served_by_version(creds.project, [], timezone.now() - timedelta(days=1), timezone.now()) == {}
    assert usefulness.newest_suggestions(creds.project, [], timezone.now() - timedelta(days=1)) == []
    client = Client()
    client.force_login(bob)
    body = client.get(f"/p/{creds.project.slug}/").content.decode()
    assert "No version yet." in body
