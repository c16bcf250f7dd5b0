"""Training services on the real database: rewards with a settle window, spec versions, judge
failures, calibration, claiming the lineage, and runs that record steps and register candidates.

    .venv/bin/python -m pytest tests/training/test_services.py -q
"""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch
from django.db import connection
from django.utils import timezone

from feedback.models import Trajectory
from feedback.services import feedback_ingest
from tests.factories import feedback, trajectory
from training.models import PolicyVersion, Reward, RewardSpec, RubricScore, TrainingRun, TrainingStep
from training.rewards.selectors import judge_agreement
from training.rewards.services import (
    DEFAULT_JUDGE,
    reward_spec_current,
    reward_spec_update,
    rewards_compute_pending,
)
from training.rl.config import RLConfig
from training.runs.rollouts import rollout_and_train
from training.runs.services import WorkerRef, train_maybe, train_policy, training_run_start
from training.runs.settings import RunSettings, Schedule
from training.schedule import training_schedule_install
from training.versions.services import policy_folder

COMPLETIONS = [" return a + b", " return a - b", " pass", " return sum([a, b])"]


def plain_spec(project, **changes):
    """Feedback map only (no judge, no aspects), so totals are exact."""
    return reward_spec_update(project, judge={}, aspects=[], **changes)


def later(seconds: float):
    return timezone.now() + timedelta(seconds=seconds)


def ingest_live(project, tokenizer, n: int, version: int | None = 1, with_logprobs: bool = False) -> list[int]:
    events = []
    for i in range(n):
        text = COMPLETIONS[i % len(COMPLETIONS)]
        ids = tokenizer.encode(text, add_special_tokens=False)
        step = {"role": "assistant", "content": text, "token_ids": ids}
        if with_logprobs:
            step["logprobs"] = [-1.0] * len(ids)
        events.append(trajectory(f"t-{i}", policy_version=version, steps=[step]))
        events.append(feedback(f"fb-{i}", f"t-{i}", signal="accept" if i % 2 == 0 else "reject"))
    feedback_ingest(project, events)
    return list(Trajectory.objects.filter(project=project).values_list("pk", flat=True))


# ------------------------------------------------------------------------------------ rewards


def test_rewards_wait_for_the_settle_window_then_use_the_signal_map(creds):
    spec = plain_spec(creds.project, settle_seconds=60)
    feedback_ingest(creds.project, [trajectory("t-1"), feedback("fb-1", "t-1", "accept")])
    assert rewards_compute_pending(creds.project, now=later(30)) == 0
    assert rewards_compute_pending(creds.project, now=later(61)) == 1
    reward = Reward.objects.get()
    assert reward.spec == spec
    assert reward.total == pytest.approx(0.75)
    assert reward.components == {"feedback:accept": 0.75}
    assert rewards_compute_pending(creds.project, now=later(3600)) == 0


def test_a_trajectory_without_feedback_settles_as_silent(creds):
    plain_spec(creds.project, settle_seconds=0)
    feedback_ingest(creds.project, [trajectory("t-1")])
    assert rewards_compute_pending(creds.project, now=later(1)) == 1
    assert Reward.objects.get().components == {"feedback:silent": 0.0}


def test_late_feedback_recomputes_the_reward_after_it_settles(creds):
    plain_spec(creds.project, settle_seconds=60)
    feedback_ingest(creds.project, [trajectory("t-1"), feedback("fb-1", "t-1", "accept")])
    rewards_compute_pending(creds.project, now=later(61))
    first = Reward.objects.get()
    feedback_ingest(creds.project, [feedback("fb-2", "t-1", "reject")])
    assert rewards_compute_pending(creds.project, now=later(30)) == 0  # not settled yet
    assert rewards_compute_pending(creds.project, now=later(61)) == 1
    second = Reward.objects.get()
    assert second.components == {"feedback:accept": 0.75, "feedback:reject": -0.25}
    assert second.total == pytest.approx(0.5)
    assert second.computed_at > first.computed_at


def test_a_spec_is_edited_in_place_until_a_reward_uses_it_then_versioned(creds):
    spec = plain_spec(creds.project, settle_seconds=0)
    edited = reward_spec_update(creds.project, signal_rewards={"accept": 1.0})
    assert (edited.pk, edited.version) == (spec.pk, 1)
    feedback_ingest(creds.project, [trajectory("t-1"), feedback("fb-1", "t-1", "accept")])
    rewards_compute_pending(creds.project, now=later(1))
    v2 = reward_spec_update(creds.project, signal_rewards={"accept": 0.5})
    assert v2.version == 2 and v2.pk != spec.pk
    spec.refresh_from_db()
    assert spec.signal_rewards["accept"] == 1.0  # the used version did not change
    assert reward_spec_current(creds.project) == v2
    assert rewards_compute_pending(creds.project, now=later(1)) == 1  # scored again under v2
    assert sorted(Reward.objects.values_list("spec__version", "total")) == [(1, 1.0), (2, 0.5)]


def test_an_invalid_spec_edit_is_refused_with_the_reason(creds):
    from core.errors import BadRequest

    with pytest.raises(BadRequest, match="unknown judge kind"):
        reward_spec_update(creds.project, judge={"kind": "oracle"})
    assert RewardSpec.objects.get().judge == DEFAULT_JUDGE


def test_a_partial_accept_is_rewarded_by_its_accepted_characters(creds):
    from core.errors import BadRequest

    plain_spec(creds.project, settle_seconds=0)
    with pytest.raises(BadRequest, match="scale=0: give the accepted characters that earn the full reward"):
        reward_spec_update(creds.project, signal_rewards={"accept": {"reward": 0.8, "value": "chars", "scale": 0}})
    reward_spec_update(creds.project, signal_rewards={"accept": {"reward": 0.8, "value": "chars", "scale": 40}})
    feedback_ingest(creds.project, [trajectory("t-1"), feedback("fb-1", "t-1", "accept", value=10),
                                    trajectory("t-2"), feedback("fb-2", "t-2", "accept")])
    rewards_compute_pending(creds.project, now=later(1))
    totals = dict(Reward.objects.values_list("trajectory__external_id", "total"))
    assert totals == {"t-1": pytest.approx(0.2), "t-2": pytest.approx(0.8)}  # 0.8 x 10/40; a plain accept in full


def test_the_default_spec_scores_rubric_aspects_with_the_rule_judge(creds):
    spec = reward_spec_update(creds.project, settle_seconds=0)
    feedback_ingest(creds.project, [trajectory("t-1"), feedback("fb-1", "t-1", "accept")])
    rewards_compute_pending(creds.project, now=later(1))
    scores = {s.aspect: s for s in RubricScore.objects.all()}
    assert set(scores) == {"style", "concision"}
    assert all(s.score is not None and s.judge.startswith("rule_rubric:") for s in scores.values())
    reward = Reward.objects.get(spec=spec)
    assert reward.components["aspect:style"] == pytest.approx(0.1 * scores["style"].score)
    assert reward.total == pytest.approx(sum(reward.components.values()))


def test_a_failed_judge_stores_null_scores_with_the_error_and_no_aspect_reward(creds, monkeypatch):
    # A closed port: the judge's endpoint is down (a real failure, nothing patched).
    monkeypatch.setenv("FLYWHEEL_JUDGE_ALLOWED_NETWORKS", "127.0.0.0/8")
    judge = {"kind": "model", "base_url": "http://127.0.0.1:9/v1", "model": "judge", "retries": 0, "timeout_s": 2}
    reward_spec_update(creds.project, judge=judge, settle_seconds=0)
    feedback_ingest(creds.project, [trajectory("t-1"), feedback("fb-1", "t-1", "accept")])
    rewards_compute_pending(creds.project, now=later(1))
    scores = list(RubricScore.objects.all())
    assert {s.aspect for s in scores} == {"style", "concision"}
    assert all(s.score is None and "transport error" in s.error for s in scores)
    assert Reward.objects.get().components == {"feedback:accept": 0.75}


def test_the_calibration_selector_reports_agreement_per_judge_and_aspect(creds):
    events, labels = [], [0.1, 0.3, 0.6, 0.9]
    for i, human in enumerate(labels):
        events += [trajectory(f"t-{i}"), feedback(f"fb-{i}", f"t-{i}", "accept",
                                                  aspect_labels={"style": human, "concision": human})]
    feedback_ingest(creds.project, events)
    for i, t in enumerate(Trajectory.objects.order_by("external_id")):
        RubricScore.objects.create(trajectory=t, aspect="style", judge="j1", score=labels[i])  # agrees
        RubricScore.objects.create(trajectory=t, aspect="concision", judge="j1", score=1 - labels[i])  # inverts
        RubricScore.objects.create(trajectory=t, aspect="style", judge="j2", score=None, error="down")
    agreement = judge_agreement(creds.project)
    assert set(agreement) == {"j1"}  # failed scores are not agreement data
    style, concision = agreement["j1"]["style"], agreement["j1"]["concision"]
    assert (style.n, style.spearman, style.kappa, style.accuracy) == (4, pytest.approx(1.0), pytest.approx(1.0), 1.0)
    assert concision.spearman == pytest.approx(-1.0) and concision.kappa == pytest.approx(-1.0)


# ------------------------------------------------------------------------------------ runs


def test_a_run_recomputes_missing_behaviour_logprobs_records_steps_and_registers_a_candidate(
    creds, production, tokenizer
):
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 8)
    rewards_compute_pending(creds.project, now=later(1))
    run, created = training_run_start(creds.project, RunSettings(steps=3, batch_size=4, rl=RLConfig(lr=1e-3)), enqueue=False)
    assert created and run.state == "queued"
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    steps = list(TrainingStep.objects.filter(run=run))
    assert [s.step for s in steps] == [0, 1, 2]
    # mu was recomputed from v1, the policy being trained, so at step 0 it equals pi_old.
    assert steps[0].mismatch_kl == pytest.approx(0.0, abs=1e-6) and steps[0].staleness_kl is None  # all served by v1
    assert run.result["behaviour_unknown"] == 0 and run.result["samples"] == 8
    candidate = run.candidate
    assert (candidate.state, candidate.parent, candidate.number) == ("candidate", production, 2)
    assert candidate.manifest_hash and candidate.delta_bytes > 0
    from inference.engines import read_state_dict

    new, old = read_state_dict(policy_folder(candidate)), read_state_dict(policy_folder(production))
    assert any(not torch.equal(new[k], old[k]) for k in old)


def test_a_run_whose_data_disagrees_with_the_weights_that_served_it_is_flagged_and_not_gated(
    creds, production, tokenizer, django_capture_on_commit_callbacks
):
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 8, with_logprobs=True)  # log mu = -1.0: not what v1 gives
    rewards_compute_pending(creds.project, now=later(1))
    run, _ = training_run_start(creds.project, RunSettings(steps=1, batch_size=4), enqueue=False)
    with django_capture_on_commit_callbacks() as callbacks:
        run = train_policy(run.pk)
    assert run.state == "succeeded" and run.result["fresh_samples"] == 8
    assert run.result["fresh_mismatch_kl"] > 0.01
    assert run.result["flag"].startswith("flagged: train/inference mismatch KL") and run.error == ""
    assert run.candidate.state == "candidate" and callbacks == []  # the gate was not enqueued


def test_the_next_run_continues_from_the_training_lineage_not_from_production(creds, production, tokenizer):
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 8)
    rewards_compute_pending(creds.project, now=later(1))
    first = train_policy(training_run_start(creds.project, RunSettings(steps=1, batch_size=4), enqueue=False)[0].pk)
    assert first.candidate.parent == production
    second, created = training_run_start(creds.project, RunSettings(steps=1, batch_size=4), enqueue=False)
    assert created and second.base_version == first.candidate  # learning accumulates across runs


def test_the_lineage_restarts_from_production_after_a_run_that_left_its_trust_region(creds, production, tokenizer):
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 8)
    rewards_compute_pending(creds.project, now=later(1))
    first = train_policy(training_run_start(creds.project, RunSettings(steps=1, batch_size=4), enqueue=False)[0].pk)
    TrainingRun.objects.filter(pk=first.pk).update(result={**first.result, "stopped_after_round": 3})
    second, created = training_run_start(creds.project, RunSettings(steps=1, batch_size=4), enqueue=False)
    assert created and second.base_version == production  # not first.candidate, outside the region


def test_a_run_without_trainable_samples_fails_with_the_reason_and_no_candidate(creds, production):
    plain_spec(creds.project, settle_seconds=0)
    feedback_ingest(creds.project, [trajectory("t-1", steps=[{"role": "user", "content": "x"}])])  # no assistant turn
    rewards_compute_pending(creds.project, now=later(1))
    run, _ = training_run_start(creds.project, enqueue=False)
    run = train_policy(run.pk)
    assert run.state == "failed" and "no rewarded trajectories with an assistant turn" in run.error
    assert run.candidate is None
    assert not PolicyVersion.objects.filter(state="candidate").exists()


def test_a_second_start_sees_the_live_run_and_leaves(creds, production):
    first, created = training_run_start(creds.project, enqueue=False)
    TrainingRun.objects.filter(pk=first.pk).update(
        state="running", worker=str(WorkerRef.here()), started_at=timezone.now())
    again, created_again = training_run_start(creds.project, enqueue=False)
    assert created and not created_again and again == first


def test_a_run_whose_worker_process_is_gone_is_failed_by_the_next_start(creds, production):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    dead = WorkerRef("celery", "celery@gone", WorkerRef.here().host, proc.pid, "task-1")
    stuck = TrainingRun.objects.create(project=creds.project, base_version=production, state="running",
                                       worker=str(dead), started_at=timezone.now())
    run, created = training_run_start(creds.project, enqueue=False)
    stuck.refresh_from_db()
    assert created and run != stuck
    assert stuck.state == "failed" and f"worker process {proc.pid}" in stuck.error


def test_a_silent_run_on_another_host_is_failed_after_the_heartbeat_timeout(creds, production, settings):
    settings.FLYWHEEL_TRAIN_HEARTBEAT_TIMEOUT_S = 60
    remote = WorkerRef("celery", "celery@far", "another-host", 1, "task-1")
    stuck = TrainingRun.objects.create(project=creds.project, base_version=production, state="running",
                                       worker=str(remote), started_at=timezone.now())
    assert training_run_start(creds.project, enqueue=False)[1] is False
    TrainingRun.objects.filter(pk=stuck.pk).update(started_at=timezone.now() - timedelta(seconds=120))
    assert training_run_start(creds.project, enqueue=False)[1] is True
    stuck.refresh_from_db()
    assert stuck.state == "failed" and "no heartbeat" in stuck.error


@pytest.mark.django_db(transaction=True)
def test_two_concurrent_starts_claim_the_lineage_once(creds, production):
    barrier, results, errors = threading.Barrier(2), [], []

    def start() -> None:
        try:
            barrier.wait()
            results.append(training_run_start(creds.project, enqueue=False)[1])
        except Exception as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(results) == [False, True]
    assert TrainingRun.objects.filter(project=creds.project).count() == 1


def test_train_maybe_starts_a_run_only_with_enough_new_rewarded_trajectories(creds, production, tokenizer,
                                                                              django_capture_on_commit_callbacks):
    plain_spec(creds.project, settle_seconds=0)
    assert train_maybe(creds.project, Schedule(min_new=4, every_minutes=60)) is None  # nothing new, first run
    ingest_live(creds.project, tokenizer, 3)
    rewards_compute_pending(creds.project, now=later(1))
    # a first run waits for min_new, however long it has been
    assert train_maybe(creds.project, Schedule(min_new=4, every_minutes=0)) is None
    ingest_live(creds.project, tokenizer, 4)
    rewards_compute_pending(creds.project, now=later(1))
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        run = train_maybe(creds.project, Schedule(min_new=4, every_minutes=60))
    assert run is not None and run.state == "queued" and len(callbacks) == 1
    assert run.started_by.username == "service:scheduler"  # the beat's runs are the scheduler's (two-person rule)
    TrainingRun.objects.filter(pk=run.pk).update(state="succeeded")
    assert train_maybe(creds.project, Schedule(min_new=4, every_minutes=0)) is None  # no new data since


def test_the_schedule_install_is_idempotent(creds):
    from django_celery_beat.models import PeriodicTask

    training_schedule_install()
    training_schedule_install(schedule=Schedule(min_new=8))
    tasks = {t.task: t for t in PeriodicTask.objects.filter(name__endswith=creds.project.slug)}
    assert set(tasks) == {"training.tasks.rewards_compute_pending", "training.tasks.train_maybe"}
    assert '"min_new": 8' in tasks["training.tasks.train_maybe"].kwargs


def test_rollout_and_train_samples_groups_scores_and_trains_on_group_advantages(creds, production):
    reward_spec_update(creds.project, settle_seconds=0)  # rule-judged style + concision
    prompts = ["def add(a, b):", {"prompt": "import os", "task": "imports"}]
    run, created = rollout_and_train(creds.project, prompts, G=4, settings=RunSettings(steps=2), max_tokens=8)
    assert created and run.state == "succeeded", run.error
    sims = Trajectory.objects.filter(project=creds.project, source="simulated")
    assert sims.count() == 8
    groups = {t.extra["group"] for t in sims}
    assert len(groups) == 2
    step = sims.first().steps.get()
    assert len(step.token_ids) == len(step.logprobs) > 0
    assert Reward.objects.filter(trajectory__in=sims).count() == 8
    assert TrainingStep.objects.filter(run=run).count() == 2
    assert run.candidate.state == "candidate"
