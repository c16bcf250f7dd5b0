"""Users' data in training, on the real database and real runs: whose a trajectory is, consent
(no_train, the project default, the opt-out list) and the lineage of every run (which versions
learned from a user, a trajectory, a time window).

    .venv/bin/python -m pytest tests/training/lineage/test_lineage.py -q
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.db import connection

from feedback.models import ConsentOptOut, FeedbackEvent, Trajectory
from feedback.services import feedback_ingest, user_hash_of
from feedback.userdata.services import consent_opt_out_set, data_policy_set
from tests.factories import feedback, trajectory
from tests.training.test_services import COMPLETIONS, later, plain_spec
from training.lineage.selectors import lineage_of, run_lineage_summary
from training.models import RunLineage
from training.rewards.services import rewards_compute_pending
from training.runs.services import train_policy, training_run_start
from training.runs.settings import RunSettings


def ingest_users(project, tokenizer, users: dict[str, int], start: int = 0, **fields) -> None:
    """For each user, `n` trajectories served to them, each with their accept/reject."""
    events, i = [], start
    for user, n in users.items():
        for _ in range(n):
            text = COMPLETIONS[i % len(COMPLETIONS)]
            step = {"role": "assistant", "content": text, "token_ids": tokenizer.encode(text, add_special_tokens=False)}
            events.append(trajectory(f"t-{i}", steps=[step], user=user, **fields))
            events.append(feedback(f"fb-{i}", f"t-{i}", signal="accept" if i % 2 == 0 else "reject", user=user))
            i += 1
    results = feedback_ingest(project, events)
    assert {r.status for r in results} == {"accepted"}, [r.reason for r in results if r.status != "accepted"]


def run_once(project, **kw):
    rewards_compute_pending(project, now=later(1))
    run, created = training_run_start(project, RunSettings(steps=1, batch_size=4, **kw), enqueue=False)
    assert created
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    return run


def trained_trajectories(run) -> set[int]:
    with connection.cursor() as cur:
        cur.execute("SELECT x FROM training_runlineage l, unnest(l.trajectories) r, "
                    "generate_series(lower(r), upper(r) - 1) x WHERE l.run_id = %s", [run.pk])
        return {row[0] for row in cur.fetchall()}


def ids_of(project, user: str) -> set[int]:
    return set(Trajectory.objects.filter(project=project, user_hash=user_hash_of(project, user))
               .values_list("pk", flat=True))


def test_a_trajectory_names_whose_it_is_hashed_like_feedback(creds):
    feedback_ingest(creds.project, [trajectory("t-1", user="u-7"), feedback("fb-1", "t-1", user="u-7")])
    stored = Trajectory.objects.get(external_id="t-1").user_hash
    assert stored and stored != "u-7"
    assert stored == FeedbackEvent.objects.get(event_id="fb-1").user_hash == user_hash_of(creds.project, "u-7")


def test_consent_is_validated_and_the_project_default_applies_when_absent(creds):
    data_policy_set(creds.project, consent_default="no_train")
    results = feedback_ingest(creds.project, [trajectory("t-1"), trajectory("t-2", consent="train"),
                                              trajectory("t-3", consent="maybe")])
    assert [r.status for r in results] == ["accepted", "accepted", "rejected"]
    assert "'no_train'" in results[2].reason and "leave it out" in results[2].reason
    assert dict(Trajectory.objects.values_list("external_id", "no_train")) == {"t-1": True, "t-2": False}


def test_a_run_records_exactly_the_trajectories_and_feedback_it_trained_on(creds, production, tokenizer):
    plain_spec(creds.project, settle_seconds=0)
    ingest_users(creds.project, tokenizer, {"u-a": 4, "u-b": 4})
    run = run_once(creds.project)
    assert trained_trajectories(run) == ids_of(creds.project, "u-a") | ids_of(creds.project, "u-b")
    summary = run_lineage_summary(run.pk)
    assert summary["trajectories"] == 8 and summary["feedback"] == 8
    assert summary["trajectory_ranges"].count("[") == 1  # consecutive ids: one range, not a row each
    assert "trained_on" not in run.result and "trained_on" not in run.settings


def test_which_versions_learned_from_a_user_a_trajectory_or_a_window_is_one_query(
        creds, production, tokenizer, django_assert_num_queries):
    plain_spec(creds.project, settle_seconds=0)
    ingest_users(creds.project, tokenizer, {"u-a": 4})
    first = run_once(creds.project)
    ingest_users(creds.project, tokenizer, {"u-b": 4}, start=100, occurred_at="2026-11-30T08:00:00Z")
    second = run_once(creds.project)
    assert second.base_version == first.candidate
    with django_assert_num_queries(1):
        learned = lineage_of(creds.project, user="u-b")
    assert [(v.number, v.direct) for v in learned] == [(second.candidate.number, True)]
    # u-a's data reached v2 directly and v3 through the weights it continued from.
    assert [(v.number, v.direct) for v in lineage_of(creds.project, user="u-a")] == [(2, True), (3, False)]
    assert [v.number for v in lineage_of(creds.project, trajectory="t-100")] == [3]
    window = lineage_of(creds.project, since=datetime(2026, 11, 30, tzinfo=UTC))
    assert [v.number for v in window] == [3]
    assert lineage_of(creds.project, user="nobody") == []


def test_no_run_that_starts_after_an_opt_out_trains_on_that_users_data(creds, production, tokenizer):
    plain_spec(creds.project, settle_seconds=0)
    ingest_users(creds.project, tokenizer, {"u-a": 4, "u-b": 4})
    before = run_once(creds.project)
    assert ids_of(creds.project, "u-a") <= trained_trajectories(before)
    consent_opt_out_set(creds.project, "u-a", True)
    assert ConsentOptOut.objects.get().user_hash == user_hash_of(creds.project, "u-a")
    after = run_once(creds.project, trajectory_ids=tuple(Trajectory.objects.values_list("pk", flat=True)))
    assert trained_trajectories(after) == ids_of(creds.project, "u-b")
    assert [v.number for v in lineage_of(creds.project, user="u-a")] == [2, 3]  # v3 only through v2's weights
    assert [v.direct for v in lineage_of(creds.project, user="u-a")] == [True, False]


def test_feedback_from_an_opted_out_user_keeps_its_trajectory_out_of_training(creds, production, tokenizer):
    plain_spec(creds.project, settle_seconds=0)
    ingest_users(creds.project, tokenizer, {"u-a": 4, "u-b": 4})
    # u-c reacts to one of u-a's suggestions, then opts out: that trajectory is not trained on either.
    feedback_ingest(creds.project, [feedback("fb-c", "t-0", signal="reject", user="u-c")])
    consent_opt_out_set(creds.project, "u-c", True)
    run = run_once(creds.project)
    assert trained_trajectories(run) == (ids_of(creds.project, "u-a") | ids_of(creds.project, "u-b")) - {
        Trajectory.objects.get(external_id="t-0").pk}


def test_no_train_trajectories_are_stored_and_shown_but_never_trained_on(creds, production, tokenizer, client):
    plain_spec(creds.project, settle_seconds=0)
    ingest_users(creds.project, tokenizer, {"u-a": 4})
    ingest_users(creds.project, tokenizer, {"u-b": 4}, start=10, consent="no_train")
    run = run_once(creds.project)
    assert trained_trajectories(run) == ids_of(creds.project, "u-a")
    assert Trajectory.objects.filter(no_train=True).count() == 4
    listed = client.get("/api/v1/trajectories?limit=50", HTTP_AUTHORIZATION=f"Bearer {creds.api_key}").json()
    assert len(listed["results"]) == 8
    assert RunLineage.objects.get(run=run).trajectory_count == 4
