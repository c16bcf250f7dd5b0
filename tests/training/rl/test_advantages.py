"""Advantages against hand-computed values.

    .venv/bin/python -m pytest tests/training/rl/test_advantages.py -q -p no:django
"""

import math

import pytest
import torch

from training.rl.advantages import RunningBaseline, group_advantages, turn_returns
from training.rl.config import RLConfig
from training.rl.trainer import Sample, compute_advantages


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


# ------------------------------------------------------------------ agent trajectories: credit across turns


def test_every_turn_gets_the_outcome_and_the_step_rewards_from_it_on():
    # steps: assistant(+0.25), tool, assistant(+0.5), user(-0.25), assistant; outcome 1.0
    returns = turn_returns(1.0, [0.25, None, 0.5, -0.25, None], [0, 2, 4])
    assert returns == [1.5, 1.25, 1.0]
    assert turn_returns(0.75, [None] * 5, [0, 2, 4]) == [0.75, 0.75, 0.75]  # default: the outcome to every turn


def _turns(rewards, episode, group=None, task="t"):
    return [Sample([1], [2], reward=r, episode=episode, episode_return=rewards[0], turn=k, group=group, task=task)
            for k, r in enumerate(rewards)]


def test_a_group_compares_trajectories_once_each_however_many_turns_they_have():
    samples = _turns([1.5, 1.25, 1.0], "e1", "g") + _turns([0.5], "e2", "g")
    out = compute_advantages(samples, RLConfig())
    # group mean over the two trajectories' returns (1.5, 0.5) is 1.0, not the turns' mean 1.0625
    assert out.tolist() == [0.5, 0.25, 0.0, -0.5]
    scaled = compute_advantages(samples, RLConfig(group_normalize_std=True))  # std of (1.5, 0.5) = 0.5
    assert torch.allclose(scaled, torch.tensor([1.0, 0.5, 0.0, -1.0]), atol=1e-5)


def test_the_running_baseline_moves_once_per_trajectory():
    baseline = RunningBaseline(decay=0.5)
    samples = _turns([1.0, 0.5], "e1") + _turns([2.0], "e2")
    out = compute_advantages(samples, RLConfig(), baseline)
    # e1 against 0 (both turns), then the baseline folds e1's return once: 0.5; e2 against 0.5
    assert out.tolist() == [1.0, 0.5, 1.5]
    assert baseline.baseline("t") == 1.25


def test_single_turn_samples_get_the_same_advantages_as_before_episodes_existed():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 4.0])
    groups = [7, 7, 7, 3, 3]
    samples = [Sample([1], [2], reward=float(r), group=g, episode=f"e{i}")
               for i, (r, g) in enumerate(zip(rewards, groups, strict=True))]
    cfg = RLConfig(group_normalize_std=True)
    assert torch.equal(compute_advantages(samples, cfg), group_advantages(rewards, torch.tensor(groups), True))
