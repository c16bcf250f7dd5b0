"""Poison pills: a stored item a queue cannot process is quarantined with its error (a Quarantine
row, shown under "last errors" on the overview) and the queue goes on: rewards, training runs,
the serving recorder. (Rollups: tests/webapp/test_dashboard_rollups.py.)

The bad rows are written through the ORM, as rows stored before ingest refused such input were.

    .venv/bin/python -m pytest tests/training/test_quarantine.py -q
"""

from __future__ import annotations

import pytest

from feedback.models import Quarantine, Step, Trajectory
from feedback.services import feedback_ingest
from inference.serving import Recorder
from tests.factories import trajectory
from tests.training.test_services import ingest_live, later, plain_spec
from training.management.commands.serve_policy import recorder_for
from training.models import Reward
from training.rewards.services import rewards_compute_pending
from training.runs.services import train_policy, training_run_start
from training.runs.settings import RunSettings


def _quarantined(kind: str) -> dict[str, str]:
    return dict(Quarantine.objects.filter(kind=kind).values_list("item", "error"))


def test_a_check_context_with_empty_tests_is_quarantined_and_the_reward_queue_goes_on(creds):
    plain_spec(creds.project, settle_seconds=0, checks=[{"name": "python_tests", "weight": 1.0}])
    tests = {"prefix": "def add(a, b):\n", "tests": "assert add(1, 2) == 3"}
    feedback_ingest(creds.project, [trajectory(f"t-{i}", check_context=tests,
                                               steps=[{"role": "assistant", "content": "    return a + b"}])
                                    for i in range(3)])
    Trajectory.objects.filter(external_id="t-0").update(extra={"check_context": {"tests": ""}})  # the oldest

    assert rewards_compute_pending(creds.project, now=later(1)) == 3
    rewards = dict(Reward.objects.values_list("trajectory__external_id", "components"))
    assert sorted(rewards) == ["t-1", "t-2"] and rewards["t-1"]["check:python_tests"] == 1.0
    (item, error), = _quarantined("reward").items()
    assert item == "trajectory t-0" and "needs a test snippet" in error
    assert Quarantine.objects.get().trajectory.external_id == "t-0"
    assert rewards_compute_pending(creds.project, now=later(2)) == 0  # never offered again


def test_a_released_quarantine_offers_the_trajectory_again(creds):
    plain_spec(creds.project, settle_seconds=0, checks=[{"name": "python_tests", "weight": 1.0}])
    feedback_ingest(creds.project, [trajectory("t-0", check_context={"tests": "assert True"})])
    Trajectory.objects.update(extra={"check_context": {"tests": ""}})
    rewards_compute_pending(creds.project, now=later(1))
    Trajectory.objects.update(extra={"check_context": {"tests": "assert True"}})  # fixed by an operator
    Quarantine.objects.all().delete()
    assert rewards_compute_pending(creds.project, now=later(2)) == 1
    assert Reward.objects.count() == 1


def test_trajectories_the_policy_cannot_take_are_quarantined_and_the_run_trains_on_the_rest(
    creds, production, tokenizer
):
    plain_spec(creds.project, settle_seconds=0)
    ingest_live(creds.project, tokenizer, 12)
    steps = {s.trajectory.external_id: s for s in Step.objects.select_related("trajectory")}
    Step.objects.filter(pk=steps["t-0"].pk).update(token_ids=[5, 500, 7])  # vocabulary: 384 ids
    Step.objects.filter(pk=steps["t-1"].pk).update(routing=[[[1, 2]], [[1]]])  # ragged
    Step.objects.filter(pk=steps["t-2"].pk).update(extra={"prompt_token_ids": [[1, 2], [3]]})  # nested
    Step.objects.filter(pk=steps["t-3"].pk).update(extra={"prompt_token_ids": [1, 99_999]})
    Step.objects.filter(pk=steps["t-4"].pk).update(routing=[[[0]]] * 40)  # the policy is dense
    rewards_compute_pending(creds.project, now=later(1))

    run, _ = training_run_start(creds.project, RunSettings(steps=2, batch_size=4), enqueue=False)
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    assert run.result["samples"] == 7 and run.candidate is not None
    errors = _quarantined("training")
    assert sorted(errors) == [f"trajectory t-{i}" for i in range(5)]
    assert "token id 500 is outside the policy's vocabulary of 384" in errors["trajectory t-0"]
    assert "routing is not a (positions, layers, top-k) array" in errors["trajectory t-1"]
    assert "prompt_token_ids is not a flat list" in errors["trajectory t-2"]
    assert "token id 99999 is outside" in errors["trajectory t-3"]
    assert "the policy is dense" in errors["trajectory t-4"]


@pytest.mark.django_db(transaction=True)  # the writer closes stale connections, as in the serving process
def test_the_serving_recorder_quarantines_a_completion_ingest_rejects_and_records_the_rest(creds):
    recorder = recorder_for(creds.project)
    bad = trajectory("served-bad", steps=[{"role": "assistant", "content": "x", "token_ids": [1],
                                           "logprobs": [float("nan")]}])
    recorder.put([trajectory("served-1"), bad, trajectory("served-2")])
    assert recorder.flush() == 3 and recorder.flush() == 0
    assert sorted(Trajectory.objects.values_list("external_id", flat=True)) == ["served-1", "served-2"]
    (item, error), = _quarantined("serving").items()
    assert item == "trajectory served-bad" and "rejected by ingest" in error and "logprobs[0]" in error


def test_a_write_that_raises_on_one_event_costs_that_event_and_not_the_batch():
    written, quarantined = [], []

    def write(batch):
        if any(e["id"] == "bad" for e in batch):
            raise ValueError("cannot store this one")
        written.extend(batch)

    recorder = Recorder(write=write, quarantine=lambda e, error: quarantined.append((e["id"], error)),
                        transient=lambda exc: not isinstance(exc, ValueError))
    recorder.put([{"id": "a"}, {"id": "bad"}, {"id": "b"}])
    assert recorder.flush() == 3
    assert [e["id"] for e in written] == ["a", "b"]
    assert quarantined == [("bad", "ValueError: cannot store this one")]
    assert recorder.flush() == 0  # nothing was queued again


def test_a_reward_the_database_refuses_is_quarantined_and_the_rest_of_the_pass_is_stored(creds):
    from feedback.models import FeedbackEvent
    from tests.factories import feedback

    plain_spec(creds.project, settle_seconds=0,
               signal_rewards={"accept": {"reward": 1.0, "value": "chars", "scale": 10}})
    feedback_ingest(creds.project, [e for i in range(3) for e in (trajectory(f"t-{i}"),
                                                                  feedback(f"fb-{i}", f"t-{i}", "accept", value=5))])
    # A value ingest refuses now (not a finite number), stored by an older one: its reward's
    # components hold NaN, which PostgreSQL's json refuses.
    FeedbackEvent.objects.filter(event_id="fb-1").update(value=float("nan"))
    assert rewards_compute_pending(creds.project, now=later(1)) == 3
    assert dict(Reward.objects.values_list("trajectory__external_id", "total")) == {"t-0": 0.5, "t-2": 0.5}
    assert list(_quarantined("reward")) == ["trajectory t-1"]
