"""Judge calibration on fixtures with known agreement.

    .venv/bin/python -m pytest tests/training/rewards/test_calibration.py -q
"""

import pytest

from training.rewards.calibration import aspect_agreement, average_ranks, cohen_kappa, spearman


def test_average_ranks_share_ties_like_rankdata():
    assert average_ranks([10, 20, 20, 5]) == [2.0, 3.5, 3.5, 1.0]


def test_spearman_on_known_fixtures():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # d = (0, 0, 1, -1, 0): rho = 1 - 6 * 2 / (5 * 24) = 0.9
    assert spearman([1, 2, 3, 4, 5], [1, 2, 4, 3, 5]) == pytest.approx(0.9)
    assert spearman([1, 1, 1], [1, 2, 3]) is None  # undefined for a constant rater


def test_cohen_kappa_on_a_textbook_table():
    # 2x2 table: both yes 20, judge yes/human no 5, judge no/human yes 10, both no 15 (n = 50).
    judge = [True] * 20 + [True] * 5 + [False] * 10 + [False] * 15
    human = [True] * 20 + [False] * 5 + [True] * 10 + [False] * 15
    # p_o = 0.7; p_e = 0.5 * 0.6 + 0.5 * 0.4 = 0.5; kappa = 0.4
    assert cohen_kappa(judge, human) == pytest.approx(0.4)
    assert cohen_kappa([True, False], [True, False]) == pytest.approx(1.0)
    assert cohen_kappa([True, True], [True, True]) is None


def test_per_aspect_agreement_between_judge_and_humans():
    rows = [
        ("style", 0.9, 0.8), ("style", 0.2, 0.1), ("style", 0.6, 0.7), ("style", 0.4, 0.3),  # agrees
        ("correctness", 0.9, 0.0), ("correctness", 0.1, 1.0), ("correctness", 0.8, 0.2), ("correctness", 0.3, 0.9),
    ]
    out = aspect_agreement(rows, threshold=0.5)
    assert list(out) == ["correctness", "style"]
    assert out["style"].n == 4 and out["style"].spearman == pytest.approx(1.0)
    assert out["style"].kappa == pytest.approx(1.0) and out["style"].accuracy == 1.0
    assert out["correctness"].spearman == pytest.approx(-1.0) and out["correctness"].kappa == pytest.approx(-1.0)


def test_humans_may_label_on_their_own_scale():
    rows = [("style", 0.9, 5), ("style", 0.1, 1), ("style", 0.7, 4), ("style", 0.3, 2)]
    agreement = aspect_agreement(rows, threshold=0.5, human_threshold=3)["style"]
    assert agreement.kappa == pytest.approx(1.0) and agreement.spearman == pytest.approx(1.0)
