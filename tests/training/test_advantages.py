"""Advantages against hand-computed values.

    .venv/bin/python -m pytest tests/training/test_advantages.py -q -p no:django
"""

import math

import pytest
import torch

from training.rl.advantages import RunningBaseline, group_advantages


def test_it_centres_rewards_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0])
    groups = torch.tensor([7, 7, 7, 3, 3])
    out = group_advantages(rewards, groups)
    assert torch.allclose(out, torch.tensor([0.5, -0.5, 0.0, -1.0, 1.0]))


def test_it_divides_by_the_population_std_when_asked():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0])
    groups = torch.tensor([7, 7, 7, 3, 3])
    out = group_advantages(rewards, groups, normalize_std=True, eps=0.0)
    s = math.sqrt((0.25 + 0.25 + 0.0) / 3)
    assert torch.allclose(out, torch.tensor([0.5 / s, -0.5 / s, 0.0, -1.0, 1.0]))


def test_a_group_of_one_or_of_equal_rewards_gets_zero_advantage():
    out = group_advantages(torch.tensor([3.0, 1.0, 1.0]), torch.tensor([0, 1, 1]), normalize_std=True)
    assert torch.equal(out, torch.zeros(3))


def test_running_baseline_is_an_ema_per_bucket():
    base = RunningBaseline(decay=0.5)
    assert base.update("tab", 1.0) == pytest.approx(1.0)  # baseline starts at 0
    assert base.update("tab", 0.0) == pytest.approx(-0.5)  # baseline was 0.5
    assert base.update("chat", 2.0) == pytest.approx(2.0)  # other buckets are independent
    assert base.baseline("tab") == pytest.approx(0.25)


def test_running_baseline_batch_sees_only_earlier_samples_and_round_trips():
    base = RunningBaseline(decay=0.5)
    adv = base.advantages(["a", "a", "b"], torch.tensor([1.0, 1.0, -1.0]))
    assert torch.allclose(adv, torch.tensor([1.0, 0.5, -1.0]))
    again = RunningBaseline.from_state_dict(base.state_dict())
    assert again.values == base.values and again.decay == 0.5
