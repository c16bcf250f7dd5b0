"""Reward computation from a spec: signals, checks and aspects.

    .venv/bin/python -m pytest tests/training/rewards/test_reward_spec.py -q
"""

import pytest

from training.rewards.checks import CheckResult
from training.rewards.judges import AspectScore
from training.rewards.spec import DEFAULT_SIGNAL_REWARDS, RewardSpecData, compute_reward


def test_default_signal_map_follows_cursor_tab_and_happy_sad():
    spec = RewardSpecData()
    assert compute_reward(spec, ["accept"], {}, {}) == (0.75, {"feedback:accept": 0.75})
    assert compute_reward(spec, ["reject"], {}, {})[0] == -0.25
    assert compute_reward(spec, [], {}, {}) == (0.0, {"feedback:silent": 0.0})  # no signal is "silent"
    assert compute_reward(spec, ["happy"], {}, {})[0] == 1.0 and compute_reward(spec, ["sad"], {}, {})[0] == -1.0


def test_overrides_merge_over_defaults_and_round_trip_through_json():
    spec = RewardSpecData.from_json({"edit_kept": 0.3, "followup_dissatisfied": -0.9},
                                    checks=[{"name": "python_tests", "weight": 2, "tests": "assert f()"}],
                                    aspects=[{"name": "style", "weight": 0.5, "description": "tidy"}])
    assert spec.signal_rewards["edit_kept"] == 0.3 and spec.signal_rewards["accept"] == DEFAULT_SIGNAL_REWARDS["accept"]
    again = RewardSpecData.from_json(**spec.to_json())
    assert again == spec and again.checks[0].extra == {"tests": "assert f()"}


def test_total_sums_feedback_weighted_checks_and_weighted_aspects():
    spec = RewardSpecData.from_json(
        checks=[{"name": "python_tests", "weight": 2.0}, {"name": "python_compiles", "weight": 0.5}],
        aspects=[{"name": "style", "weight": 0.4}, {"name": "concision", "weight": 0.1}],
    )
    total, parts = compute_reward(
        spec,
        ["accept", "edit_kept", "accept"],  # the repeated accept counts once
        {"python_tests": CheckResult(0.0, "AssertionError"), "python_compiles": 1.0},
        {"style": AspectScore("style", 0.5, "ok"), "concision": 1.0},
    )
    assert parts == {"feedback:accept": 0.75, "feedback:edit_kept": 0.5, "check:python_tests": 0.0,
                     "check:python_compiles": 0.5, "aspect:style": 0.2, "aspect:concision": 0.1}
    assert total == pytest.approx(0.75 + 0.5 + 0.5 + 0.2 + 0.1)


def test_a_failed_judge_aspect_is_left_out_not_counted_as_zero():
    spec = RewardSpecData.from_json(aspects=[{"name": "style", "weight": 1.0}, {"name": "concision"}])
    total, parts = compute_reward(spec, ["accept"], {}, {"style": AspectScore("style", None, "judge failed")})
    assert parts == {"feedback:accept": 0.75} and total == 0.75


def test_custom_signals_use_their_value_and_missing_checks_are_an_error():
    spec = RewardSpecData.from_json(checks=[{"name": "python_tests"}])
    total, parts = compute_reward(spec, [("thumbs", 0.4), {"signal": "mystery", "value": None}],
                                  {"python_tests": 1.0}, {})
    assert parts["feedback:thumbs"] == 0.4 and parts["feedback:mystery"] == 0.0 and total == pytest.approx(1.4)
    with pytest.raises(ValueError, match="no result for check 'python_tests'"):
        compute_reward(spec, ["accept"], {}, {})


GRADED = {"accept": {"reward": 0.75, "value": "chars", "scale": 40}, "edit_kept": {"reward": 0.5, "value": "fraction"}}


@pytest.mark.parametrize(("signal", "value", "expected"), [
    ("accept", 10, 0.75 * 10 / 40),  # a partial accept of 10 characters: a quarter of the way to saturation
    ("accept", 40, 0.75),  # saturated at `scale`
    ("accept", 400, 0.75),  # and no further
    ("accept", 0, 0.0),
    ("accept", None, 0.75),  # a plain accept (no grade measured) earns the full reward
    ("edit_kept", 0.25, 0.125),
    ("edit_kept", 1.0, 0.5),
    ("edit_kept", None, 0.5),
    ("reject", 7, -0.25),  # an ungraded signal ignores a value
])
def test_a_graded_signal_scales_its_reward_by_its_value(signal, value, expected):
    spec = RewardSpecData.from_json(GRADED)
    total, parts = compute_reward(spec, [{"signal": signal, "value": value}], {}, {})
    assert parts == {f"feedback:{signal}": pytest.approx(expected)} and total == pytest.approx(expected)


def test_of_repeated_graded_events_the_last_value_counts_once():
    spec = RewardSpecData.from_json(GRADED)
    _, parts = compute_reward(spec, [("accept", 8.0), ("accept", 20.0)], {}, {})
    assert parts == {"feedback:accept": pytest.approx(0.375)}


def test_a_graded_spec_round_trips_through_json():
    spec = RewardSpecData.from_json(GRADED)
    assert spec.to_json()["signal_rewards"]["accept"] == {"reward": 0.75, "value": "chars", "scale": 40.0}
    assert RewardSpecData.from_json(**spec.to_json()) == spec
    assert spec.signal_rewards["accept"] == 0.75  # the full reward, as the reward model's expectation reads it


@pytest.mark.parametrize(("entry", "fix"), [
    ({"reject": {"reward": -0.25, "value": "chars", "scale": 4}}, "give reject a plain number"),
    ({"accept": {"reward": 0.75, "value": "fraction"}}, "set \"value\": 'chars'"),
    ({"accept": {"reward": 0.75, "value": "chars"}}, "scale=None: give a finite number"),
    ({"accept": {"reward": 0.75, "value": "chars", "scale": 0}}, r"a number in \[1, 100000\]"),
    ({"edit_kept": {"reward": 0.5, "value": "fraction", "scale": 3}}, "remove \"scale\""),
    ({"accept": {"reward": 0.75, "unit": "chars"}}, "grade a signal as"),
    ({"accept": {"reward": float("nan"), "value": "chars", "scale": 4}}, "reward=nan: give a finite number"),
    ({"accept": "lots"}, "accept='lots': give a finite number"),
])
def test_a_bad_grade_is_refused_with_the_fix(entry, fix):
    with pytest.raises(ValueError, match=fix):
        RewardSpecData.from_json(entry)
