"""The reward queue's pass costs the project's new work, not its history: due rows written by the
database's triggers (training.models.RewardDue) name what a statement touched, and a pass scores
what is pending among them. Every way a trajectory becomes due is exercised here, through the
same services a deployment uses, and the rows a pass reads are counted by PostgreSQL itself.

    .venv/bin/python -m pytest tests/training/rewards/test_reward_queue.py -q
"""

from __future__ import annotations

from django.db import connection

from feedback.models import FeedbackEvent, Quarantine, Trajectory
from feedback.services import feedback_ingest, feedback_link_orphans, project_create
from tests.factories import feedback, trajectory
from tests.training.test_services import later, plain_spec
from training.models import Reward, RewardDue, RewardSpec
from training.rewards.services import (
    FULL_PASS_EVERY,
    reward_spec_update,
    rewards_compute_pending,
    rewards_drain,
)


def _tuples_read(table: str) -> int:
    """Rows of `table` this transaction has read so far (sequential and index fetches), as
    PostgreSQL counts them."""
    with connection.cursor() as cur:
        cur.execute("SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables "
                    "WHERE relname = %s", [table])
        return int(cur.fetchone()[0])


def _totals() -> dict[str, float]:
    return dict(Reward.objects.values_list("trajectory__external_id", "total"))


def _grown(project, n: int) -> None:
    """`n` trajectories with a click each, all scored, the full pass done: the queue is empty."""
    events = []
    for i in range(n):
        events += [trajectory(f"old-{i}"), feedback(f"old-fb-{i}", f"old-{i}", "accept")]
    feedback_ingest(project, events)
    assert rewards_compute_pending(project, limit=2 * n, now=later(3600)) == n  # settled whatever the spec says
    assert rewards_compute_pending(project, now=later(3600)) == 0
    assert not RewardDue.objects.exists()


def test_a_pass_reads_the_new_work_not_the_projects_history(creds):
    # The statistics as a busy deployment has them: taken while only another project's rewards
    # existed (autovacuum analyses again after a tenth of a table changed), so this project's
    # spec and trajectories look empty to the planner.
    other = project_create("Other", "other").project
    plain_spec(other, settle_seconds=0)
    _grown(other, 300)
    with connection.cursor() as cur:
        for table in ("feedback_trajectory", "feedback_feedbackevent", "training_reward"):
            cur.execute(f"ANALYZE {table}")
    plain_spec(creds.project, settle_seconds=0)
    _grown(creds.project, 1500)
    feedback_ingest(creds.project, [trajectory("new-1"), trajectory("new-2"), feedback("late", "old-7", "reject")])

    tables = ("feedback_trajectory", "feedback_feedbackevent", "training_reward")
    before = {t: _tuples_read(t) for t in tables}
    assert rewards_compute_pending(creds.project, now=later(3)) == 3
    read = {t: _tuples_read(t) - n for t, n in before.items()}
    assert all(n <= 30 for n in read.values()), read
    assert _totals()["old-7"] == 0.5 and _totals()["new-1"] == 0.0  # accept 0.75 + reject -0.25; silent

    # The whole-project pass (a new spec's first, then once every FULL_PASS_EVERY) reads it all.
    reward_spec_update(creds.project, signal_rewards={"accept": 1.0, "reject": -1.0})
    before = _tuples_read("feedback_trajectory")
    assert rewards_compute_pending(creds.project, limit=5000, now=later(4)) == 1502
    assert _tuples_read("feedback_trajectory") - before >= 1500


def test_feedback_before_its_trajectory_is_scored_when_the_trajectory_lands(creds):
    plain_spec(creds.project, settle_seconds=60)
    _grown(creds.project, 3)
    feedback_ingest(creds.project, [feedback("early", "t-late", "accept")])
    assert rewards_compute_pending(creds.project, now=later(61)) == 0  # no trajectory yet
    feedback_ingest(creds.project, [trajectory("t-late")])  # links the early feedback
    assert rewards_compute_pending(creds.project, now=later(30)) == 0  # not settled
    assert rewards_compute_pending(creds.project, now=later(61)) == 1
    assert _totals()["t-late"] == 0.75


def test_feedback_linked_after_its_reward_was_computed_scores_it_again(creds):
    plain_spec(creds.project, settle_seconds=0)
    _grown(creds.project, 3)
    feedback_ingest(creds.project, [feedback("early", "t-x", "accept")])
    # The trajectory landed without the link (the two batches raced) and was scored without the
    # click; the beat's safety net links it later. The click is older than the reward.
    feedback_ingest(creds.project, [trajectory("t-x")])
    FeedbackEvent.objects.filter(event_id="early").update(trajectory=None)
    assert rewards_compute_pending(creds.project, now=later(1)) == 1
    assert _totals()["t-x"] == 0.0  # silent
    assert feedback_link_orphans(creds.project) == 1
    assert rewards_compute_pending(creds.project, now=later(2)) == 1
    assert _totals()["t-x"] == 0.75
    assert rewards_compute_pending(creds.project, now=later(3)) == 0


def test_late_feedback_is_scored_again_after_it_settles_and_only_then(creds):
    plain_spec(creds.project, settle_seconds=60)
    _grown(creds.project, 3)
    first = Reward.objects.get(trajectory__external_id="old-1")
    feedback_ingest(creds.project, [feedback("late", "old-1", "reject")])
    assert rewards_compute_pending(creds.project, now=later(30)) == 0
    assert RewardDue.objects.count() == 1  # kept until it settles
    assert rewards_compute_pending(creds.project, now=later(61)) == 1
    again = Reward.objects.get(trajectory__external_id="old-1")
    assert (again.pk, again.total) == (first.pk, 0.5) and again.computed_at > first.computed_at  # replaced in place
    assert not RewardDue.objects.exists()
    assert rewards_compute_pending(creds.project, now=later(3600)) == 0  # current now


def test_a_released_quarantine_is_offered_again(creds):
    plain_spec(creds.project, settle_seconds=0, checks=[{"name": "python_tests", "weight": 1.0}])
    tests = {"prefix": "def one():\n", "tests": "assert one() == 1"}
    steps = [{"role": "assistant", "content": "    return 1"}]
    feedback_ingest(creds.project, [trajectory(f"t-{i}", check_context=tests, steps=steps) for i in range(2)]
                    + [trajectory("bad", check_context=tests, steps=steps)])
    # A row ingest would refuse now (an empty test snippet passes anything), stored by an older one.
    Trajectory.objects.filter(external_id="bad").update(extra={"check_context": {"tests": ""}})
    assert rewards_compute_pending(creds.project, now=later(1)) == 3
    assert Quarantine.objects.filter(kind="reward").count() == 1 and "bad" not in _totals()
    Trajectory.objects.filter(external_id="bad").update(extra={"check_context": tests})  # the cause fixed by hand
    assert rewards_compute_pending(creds.project, now=later(2)) == 0
    Quarantine.objects.filter(kind="reward").delete()  # the admin's retry
    assert rewards_compute_pending(creds.project, now=later(3)) == 1
    assert _totals()["bad"] == 1.0


def test_more_due_than_a_pass_takes_goes_on_next_pass_oldest_first(creds):
    plain_spec(creds.project, settle_seconds=0)
    _grown(creds.project, 2)
    for i in range(5):
        feedback_ingest(creds.project, [trajectory(f"n-{i}")])
    assert rewards_compute_pending(creds.project, limit=2, now=later(1)) == 2
    assert set(_totals()) >= {"n-0", "n-1"} and "n-2" not in _totals()
    assert rewards_compute_pending(creds.project, limit=2, now=later(2)) == 2
    assert rewards_compute_pending(creds.project, limit=2, now=later(3)) == 1
    assert rewards_compute_pending(creds.project, limit=2, now=later(4)) == 0
    assert {f"n-{i}" for i in range(5)} <= set(_totals())


def test_an_edited_spec_is_scored_over_the_whole_project_again(creds):
    spec = plain_spec(creds.project, settle_seconds=0)
    feedback_ingest(creds.project, [trajectory("t-1"), feedback("fb-1", "t-1", "accept")])
    RewardDue.objects.all().delete()  # as if written before the queue existed
    assert rewards_compute_pending(creds.project, now=later(1)) == 1  # the first pass is a whole one
    spec.refresh_from_db()
    assert spec.full_pass_at is not None
    Reward.objects.all().delete()
    edited = reward_spec_update(creds.project, signal_rewards={"accept": 2.0})  # edited in place: unused
    assert edited.pk == spec.pk and edited.full_pass_at is None
    assert rewards_compute_pending(creds.project, now=later(2)) == 1
    assert _totals() == {"t-1": 2.0}


def test_a_full_pass_goes_over_the_project_a_window_at_a_time(creds):
    """A new spec on a grown project is scored `limit` at a time, each pass going over one window
    of the project's trajectories (FULL_WINDOW_FACTOR x limit, in the order of their ids) from
    where the last stopped; a trajectory stored meanwhile, before the window in that order, is
    scored through its due row; the pass is recorded complete after the last window. (What a
    window reads: the next test; what a pass costs at 200,000 trajectories: bench/reward_queue.py.)"""
    plain_spec(creds.project, settle_seconds=0)
    _grown(creds.project, 600)
    spec = reward_spec_update(creds.project, signal_rewards={"accept": 2.0})  # a new version: all to score
    assert spec.full_pass_at is None
    limit, passes, scored = 25, 0, 0
    while True:
        got = rewards_compute_pending(creds.project, limit=limit, now=later(3600 + passes))
        scored, passes = scored + got, passes + 1
        spec.refresh_from_db()
        if passes == 3:  # mid-way: one stored with an id before where the pass has reached
            assert spec.full_pass_cursor > "a" and spec.full_pass_at is None
            feedback_ingest(creds.project, [trajectory("a-late"), feedback("a-late-fb", "a-late", "accept")])
        if passes == 5:  # a pass's worth of new work: the next pass is all due rows, the window waits
            feedback_ingest(creds.project, [trajectory(f"z-{i}") for i in range(limit)])
            reached = spec.full_pass_cursor
        if passes == 6:
            assert spec.full_pass_cursor == reached and set(_totals()) >= {f"z-{i}" for i in range(limit)}
        if spec.full_pass_at is not None:
            break
        assert got == limit and passes < 100
    # 626 at 25 a pass (the late ones through their due rows): the 26th finds the end of the project
    assert spec.full_pass_cursor is None and scored == 626 and passes == 26
    totals = dict(Reward.objects.filter(spec=spec).values_list("trajectory__external_id", "total"))
    assert len(totals) == 626 and {k for k, v in totals.items() if v != 2.0} == {f"z-{i}" for i in range(limit)}
    assert rewards_compute_pending(creds.project, limit=limit, now=later(4000)) == 0


def test_a_full_pass_window_reads_its_own_rows_whatever_the_statistics(creds):
    """One window of the project's trajectories is one range of the unique index, even where the
    planner knows nothing of the project (these tables as a new deployment has them): with sorting
    allowed it took another index of the project's and sorted all 600 rows for each window (1,150
    rows read for two windows of 50)."""
    from training.rewards.selectors import trajectory_window

    feedback_ingest(creds.project, [trajectory(f"t-{i:04d}") for i in range(600)])
    before = _tuples_read("feedback_trajectory")
    first = trajectory_window(creds.project, None, 50)
    second = trajectory_window(creds.project, first[-1][1], 50)
    assert _tuples_read("feedback_trajectory") - before <= 2 * 50 + 4
    assert [e for _, e in first + second] == [f"t-{i:04d}" for i in range(100)]
    with connection.cursor() as cur:
        cur.execute("SHOW enable_sort")
        assert cur.fetchone()[0] == "on"  # only that query planned without sorting


def test_the_daily_whole_pass_catches_what_no_trigger_saw(creds):
    plain_spec(creds.project, settle_seconds=0)
    _grown(creds.project, 3)
    Reward.objects.filter(trajectory__external_id="old-2").delete()  # by hand, outside Flywheel
    assert rewards_compute_pending(creds.project, now=later(3600)) == 0
    assert rewards_compute_pending(creds.project, now=later(3600) + FULL_PASS_EVERY) == 1
    assert RewardSpec.objects.get(project=creds.project).full_pass_at > later(3600)


def test_trajectories_written_through_the_orm_are_due_too(creds):
    plain_spec(creds.project, settle_seconds=0)
    _grown(creds.project, 2)
    made = Trajectory.objects.create(project=creds.project, external_id="orm-1", occurred_at=later(0))
    FeedbackEvent.objects.create(project=creds.project, event_id="orm-fb", trajectory_external_id="orm-1",
                                 trajectory=made, signal="accept", occurred_at=later(0))
    assert rewards_compute_pending(creds.project, now=later(1)) == 1
    assert _totals()["orm-1"] == 0.75


def test_one_batch_is_one_due_row_and_other_projects_rows_are_left_alone(creds, db):
    other = project_create("Other", "other").project
    plain_spec(creds.project, settle_seconds=0)
    _grown(creds.project, 2)
    feedback_ingest(other, [trajectory(f"o-{i}") for i in range(50)])
    feedback_ingest(creds.project, [trajectory(f"t-{i}") for i in range(50)]
                    + [feedback(f"fb-{i}", f"t-{i}") for i in range(50)])
    assert RewardDue.objects.filter(project=creds.project).count() == 2  # the trajectories, their feedback
    assert rewards_compute_pending(creds.project, now=later(1)) == 50
    assert len(RewardDue.objects.get(project=other).trajectory_ids) == 50


def test_beats_task_drains_the_queue_pass_after_pass_within_its_budget(creds):
    plain_spec(creds.project, settle_seconds=0)
    _grown(creds.project, 2)
    for i in range(5):
        feedback_ingest(creds.project, [trajectory(f"n-{i}"), feedback(f"f-{i}", "old-0", "reject")])
    assert rewards_drain(creds.project, budget_s=0, limit=2) == 2  # a spent budget: one pass
    assert rewards_drain(creds.project, budget_s=60, limit=2) == 4  # the other four, two passes and an empty one
    assert not RewardDue.objects.exists()
    assert rewards_drain(creds.project, budget_s=60, limit=2) == 0
