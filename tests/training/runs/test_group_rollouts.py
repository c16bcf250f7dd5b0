"""More signal per prompt: a run samples G completions for prompts the users sent, scores them with
the spec's checks and a reward model fitted to the users' clicks, and trains on them with the live
samples (real database, real sandbox for the check, the torch engine).

    .venv/bin/python -m pytest tests/training/runs/test_group_rollouts.py -q
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch
from django.utils import timezone

from core.errors import BadRequest
from feedback.services import feedback_ingest
from tests.factories import feedback, trajectory
from training.models import EvalSuite, TrainingStep
from training.rewards.reward_model import MIN_LABELS, Labelled, fit_reward_model
from training.rewards.selectors import labelled_suggestions
from training.rewards.services import reward_spec_update, rewards_compute_pending, suggestions_reward
from training.rl.config import RLConfig
from training.runs.services import train_policy, training_run_start
from training.runs.settings import RunSettings

CHECKS = [{"name": "python_compiles", "weight": 0.25, "prompt_is_prefix": True}]
PROMPTS = ["total = (a", "name = str(x", "value = [1, 2", "if ok", "items = {}", "x = y +"]
# (completion, compiles after its prompt?) — the users accept exactly what compiles.
TAILS = [" and b\n", ")\n", " 3\n", "]\n", " + 1)\n", ":\n"]


def _spec(project):
    return reward_spec_update(project, judge={}, aspects=[], checks=CHECKS, settle_seconds=0)


def _ingest_clicks(project, tokenizer, n: int) -> None:
    from webapp.demo.simulator import compiles

    events = []
    for i in range(n):
        prompt, tail = PROMPTS[i % len(PROMPTS)], TAILS[(i // len(PROMPTS)) % len(TAILS)]
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        ids = tokenizer.encode(tail, add_special_tokens=False)
        step = {"role": "assistant", "content": tail, "token_ids": ids, "prompt_token_ids": prompt_ids}
        events.append(trajectory(f"t-{i}", prompt=[{"role": "user", "content": prompt}], steps=[step]))
        events.append(feedback(f"fb-{i}", f"t-{i}", signal="accept" if compiles(prompt + tail) else "reject"))
    feedback_ingest(project, events)


def test_the_demo_check_reads_the_prompt_as_the_code_before_the_completion(creds):
    spec = _spec(creds.project)
    [(compiled, parts), (broken, _)] = suggestions_reward(spec, [("x = (1", ")\n", [1]), ("x = (1", "\n", [1])], None)
    assert parts["check:python_compiles"] == 0.25 and compiled == pytest.approx(0.25)
    assert broken == 0.0  # no model yet: no expected click, only the check


def test_the_reward_model_is_fitted_on_live_clicks_with_their_check_outcomes(creds, production, tokenizer):
    spec = _spec(creds.project)
    _ingest_clicks(creds.project, tokenizer, 60)
    rewards_compute_pending(creds.project, now=timezone.now() + timedelta(seconds=1))
    labelled = labelled_suggestions(creds.project, spec)
    assert len(labelled) == 60
    # the label is the click; the check outcome is the spec's, read back from the reward components
    assert all(item.label == item.checks["python_compiles"] for item in labelled)
    model = fit_reward_model(labelled, ["python_compiles"])
    assert model is not None and model.calibration["heldout_auc"] > 0.9
    p = model.predict([Labelled("x = (1", ")\n", {"python_compiles": 1.0}, [1]),
                       Labelled("x = (1", "\n", {"python_compiles": 0.0}, [1])])
    assert float(p[0]) > 0.8 > 0.2 > float(p[1])


def test_a_run_with_group_rollouts_trains_on_them_with_the_live_samples(creds, production, tokenizer):
    _spec(creds.project)
    _ingest_clicks(creds.project, tokenizer, 2 * MIN_LABELS)
    rewards_compute_pending(creds.project, now=timezone.now() + timedelta(seconds=1))
    settings = RunSettings(steps=1, batch_size=64, rl=RLConfig(lr=1e-3), group={"prompts": 4, "G": 4, "max_tokens": 6},
                           epochs=1)
    run, _ = training_run_start(creds.project, settings, enqueue=False)
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    config = run.result
    assert config["rollout_prompts"] == 4  # the four newest distinct prompts the users sent
    assert 0 < config["rollouts"] <= 16
    assert config["samples"] == 2 * MIN_LABELS + config["rollouts"]
    assert config["reward_model"]["labels"] == 2 * MIN_LABELS
    # one pass over live samples and rollouts together
    assert config["steps"] == math.ceil(config["samples"] / 64)
    assert TrainingStep.objects.filter(run=run).count() == config["steps"]
    # rollouts come from the base weights through the torch engine: on-policy, no mismatch
    assert config["fresh_mismatch_kl"] is None or config["fresh_mismatch_kl"] < 1e-6


def test_rounds_sample_score_and_update_again_from_the_weights_the_run_reached(creds, production, tokenizer):
    _spec(creds.project)
    _ingest_clicks(creds.project, tokenizer, MIN_LABELS)
    rewards_compute_pending(creds.project, now=timezone.now() + timedelta(seconds=1))
    EvalSuite.objects.create(project=creds.project, version=1, max_tokens=8, n_samples=2,
                             prompts=[{"id": f"p{i}", "prompt": p} for i, p in enumerate(["import os", "x = [", "def f("])])
    settings = RunSettings(steps=1, batch_size=16, epochs=1,
                           rl=RLConfig(lr=1e-3, kl_to="production", kl_stop=1e6, length_stop=100.0),
                           group={"prompts": 4, "G": 4, "max_tokens": 6, "rounds": 3})
    run, _ = training_run_start(creds.project, settings, enqueue=False)
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    config = run.result
    assert config["rollout_rounds"] == 3 and len(config["rollout_reward_by_round"]) == 3
    # the region was measured before rounds 1 and 2 trained (wide bounds: no stop)
    assert config["stopped_after_round"] is None and set(config["length_ratio_by_round"]) == {"1", "2"}
    assert all(0 < x < 100 for x in config["length_ratio_by_round"].values())
    # the project has an eval suite: the region's KL is the gate's, on the suite's prompts
    assert config["kl_measured_on"] == "suite" and set(config["kl_by_round"]) == {"1", "2"}
    assert all(math.isfinite(k) and k > 0 for k in config["kl_by_round"].values())  # the rounds moved the weights
    first = config["samples"] - MIN_LABELS  # round 0's rollouts trained with the live samples
    assert 0 < first <= 16 and first < config["rollouts"] <= 3 * 16
    # round 0: one pass over live + rollouts; rounds 1 and 2: one pass over their own rollouts
    later = config["rollouts"] - first
    assert config["steps"] >= math.ceil(config["samples"] / 16) + math.ceil(later / 32)
    assert TrainingStep.objects.filter(run=run).count() == config["steps"]


def test_without_enough_clicks_there_is_no_reward_model_and_no_rollouts(creds, production, tokenizer):
    _spec(creds.project)
    _ingest_clicks(creds.project, tokenizer, MIN_LABELS // 2)
    rewards_compute_pending(creds.project, now=timezone.now() + timedelta(seconds=1))
    settings = RunSettings(steps=1, batch_size=8, group={"prompts": 4, "G": 4, "max_tokens": 6})
    run, _ = training_run_start(creds.project, settings, enqueue=False)
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    assert run.result["reward_model"] is None and run.result["rollouts"] == 0


@pytest.mark.parametrize("group", [{"prompts": 0, "G": 4}, {"G": 1}, {"prompts": 4, "G": 4, "size": 3},
                                   {"prompts": 4, "G": 4, "rounds": 0},
                                   {"prompts": "4"}, [4, 4]])
def test_a_bad_group_config_is_refused_with_the_reason(creds, production, group):
    with pytest.raises(BadRequest, match="group"):
        training_run_start(creds.project, RunSettings(group=group), enqueue=False)


def test_a_run_leaving_its_kl_region_to_production_takes_no_further_round(
    creds, production, tokenizer, django_capture_on_commit_callbacks
):
    _spec(creds.project)
    _ingest_clicks(creds.project, tokenizer, MIN_LABELS)
    rewards_compute_pending(creds.project, now=timezone.now() + timedelta(seconds=1))
    settings = RunSettings(steps=1, batch_size=16, epochs=1, rl=RLConfig(lr=1e-3, kl_to="production", kl_stop=1e-9),
                           group={"prompts": 4, "G": 4, "max_tokens": 6, "rounds": 3})
    run, _ = training_run_start(creds.project, settings, enqueue=False)
    with django_capture_on_commit_callbacks() as callbacks:
        run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    config = run.result
    # round 0 moved the weights off production, so round 1 measured KL > 1e-9 before it trained:
    # round 1 was sampled and not trained on, round 2 never ran
    assert config["rollout_rounds"] == 2 and config["stopped_after_round"] == 1 and config["stopped_by"] == "kl"
    assert set(config["kl_by_round"]) == {"1"} and config["kl_by_round"]["1"] > 1e-9
    assert config["kl_measured_on"] == "samples"  # no eval suite: on the round's own samples
    assert config["steps"] == math.ceil(config["samples"] / 16)  # live + round 0 only: round 1 not trained on
    # and no round was measured inside: the candidate went back to the run's base, production
    from inference.engines import read_state_dict
    from training.versions.services import policy_folder

    ours, base = read_state_dict(policy_folder(run.candidate)), read_state_dict(policy_folder(production))
    assert ours.keys() == base.keys() and all(torch.equal(ours[k], base[k]) for k in base)
    # nothing new to show the gate: flagged on the runs page, not gated; a success, not an error
    assert run.result["flag"].startswith("flagged: left its trust region to production at round 1 (KL ")
    assert run.error == ""
    assert callbacks == []  # the gate was not enqueued
    # the KL is only measured (beta 0): every step still reports it
    kls = [s.kl_ref for s in TrainingStep.objects.filter(run=run).order_by("step")]
    assert len(kls) == config["steps"] and all(math.isfinite(k) for k in kls)
