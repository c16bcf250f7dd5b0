"""The KL term's reference policy: the run's base, or what is served (`rl.kl_to = "production"`), so
that a training lineage ahead of production stays within the gate's KL budget.

    .venv/bin/python -m pytest tests/training/runs/test_kl_reference.py -q
"""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.utils import timezone

from feedback.services import feedback_ingest
from tests.factories import feedback, trajectory
from training.models import TrainingStep
from training.rewards.services import reward_spec_update, rewards_compute_pending
from training.rl.config import RLConfig
from training.runs.job import kl_reference
from training.runs.services import train_policy, training_run_start
from training.runs.settings import RunSettings
from training.versions.services import policy_folder


def test_kl_to_names_one_of_two_references():
    assert RLConfig().kl_to == "base"
    with pytest.raises(ValueError, match='kl_to must be "base" or "production"'):
        RLConfig(kl_to="parent")


def test_the_reference_is_production_when_asked_and_the_runs_base_otherwise(creds, production):
    run = SimpleNamespace(project=creds.project)
    base = Path("/the/run/base")
    assert kl_reference(run, RLConfig(beta=0.05), base) == base
    assert kl_reference(run, RLConfig(beta=0.05, kl_to="production"), base) == policy_folder(production)


def test_a_run_with_a_kl_term_to_production_trains_and_reports_the_kl(creds, production, tokenizer):
    reward_spec_update(creds.project, judge={}, aspects=[], checks=[], settle_seconds=0)
    events = []
    for i in range(8):
        ids = tokenizer.encode(" x = 1\n", add_special_tokens=False)
        step = {"role": "assistant", "content": " x = 1\n", "token_ids": ids,
                "prompt_token_ids": tokenizer.encode(f"# {i}", add_special_tokens=False)}
        events.append(trajectory(f"t-{i}", prompt=[{"role": "user", "content": f"# {i}"}], steps=[step]))
        events.append(feedback(f"fb-{i}", f"t-{i}", signal="accept" if i % 2 else "reject"))
    feedback_ingest(creds.project, events)
    rewards_compute_pending(creds.project, now=timezone.now() + timedelta(seconds=1))
    rl = RLConfig(lr=1e-3, beta=0.05, kl_to="production", micro_batch_size=4)
    run, _ = training_run_start(creds.project, RunSettings(steps=2, batch_size=4, rl=rl), enqueue=False)
    run = train_policy(run.pk)
    assert run.state == "succeeded", run.error
    kls = [s.kl_ref for s in TrainingStep.objects.filter(run=run).order_by("step")]
    assert len(kls) == 2 and all(math.isfinite(k) and k >= 0 for k in kls)
    assert kls[0] < 1e-6  # the first step starts from production itself


def test_kl_stop_is_positive_or_off():
    assert RLConfig().kl_stop is None and RLConfig(kl_stop=2.5).kl_stop == 2.5
    with pytest.raises(ValueError, match="kl_stop must be > 0"):
        RLConfig(kl_stop=0)


def test_the_trust_region_stops_after_the_first_round_measured_past_it():
    from training.runs.trust_region import TrustRegion

    region = TrustRegion(2.0)
    region.measure(1, 1.5)
    assert not region.left(1)
    region.measure(2, 2.01)
    assert region.left(2)
    assert region.report() == {"kl_stop": 2.0, "kl_by_round": {"1": 1.5, "2": 2.01}, "stopped_after_round": 2,
                               "stopped_by": "kl"}
    off = TrustRegion(None)
    off.measure(1, 99.0)
    assert not off.left(1) and off.report() == {}
    assert not TrustRegion(1.0).left(3)  # a round not measured (no rollouts) never stops the run


def test_length_stop_is_above_one_or_off():
    assert RLConfig().length_stop is None and RLConfig(length_stop=1.6).length_stop == 1.6
    with pytest.raises(ValueError, match="length_stop must be > 1"):
        RLConfig(length_stop=1.0)


def test_the_trust_region_stops_on_length_both_ways_and_says_which_bound():
    from training.runs.trust_region import TrustRegion

    region = TrustRegion(None, 1.6)
    region.measure(1, kl=9.0, length_ratio=1.59)  # no KL stop: only the length bound counts
    assert not region.left(1)
    region.measure(2, kl=9.0, length_ratio=1.61)
    assert region.left(2) and region.report()["stopped_by"] == "length"
    assert region.report()["length_ratio_by_round"] == {"1": 1.59, "2": 1.61}
    shrinking = TrustRegion(4.0, 1.6)
    shrinking.measure(1, kl=1.0, length_ratio=1 / 1.59)
    assert not shrinking.left(1)
    shrinking.measure(2, kl=1.0, length_ratio=0.62)  # below 1 / 1.6
    assert shrinking.left(2) and shrinking.report()["stopped_after_round"] == 2
    both = TrustRegion(2.0, 1.6)
    both.measure(1, kl=2.5, length_ratio=3.0)
    assert both.left(1) and both.report()["stopped_by"] == "kl"  # the KL is named first
