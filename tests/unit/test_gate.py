"""The promotion gate's rule (gateway/promotion/gate.py) against hand-computed intervals."""

from __future__ import annotations

import math

import pytest

from gateway.promotion.gate import paired_gate, unpaired_gate

T_975_2DF = 4.302652729911275  # Student t, 97.5th percentile, 2 degrees of freedom (printed tables: 4.303)


def test_interval_of_the_paired_differences() -> None:
    # differences 0.1, 0.2, 0.3: mean 0.2, sample sd 0.1, half width t * 0.1 / sqrt(3)
    half = T_975_2DF * 0.1 / math.sqrt(3)
    verdict = paired_gate([0.6, 0.7, 0.8], [0.5, 0.5, 0.5], margin=0.05, confidence=0.95)
    assert verdict.scenarios == 3
    assert verdict.mean_difference == pytest.approx(0.2)
    assert verdict.ci_low == pytest.approx(0.2 - half)  # -0.0484
    assert verdict.ci_high == pytest.approx(0.2 + half)
    assert verdict.passed  # -0.0484 >= -0.05
    assert not paired_gate([0.6, 0.7, 0.8], [0.5, 0.5, 0.5], margin=0.04, confidence=0.95).passed


def test_a_better_mean_by_luck_is_held_back() -> None:
    # candidate better on average (differences 1, -1, 1, -0.6: mean +0.1) but all over the place
    verdict = paired_gate([1.0, 0.0, 1.0, 0.4], [0.0, 1.0, 0.0, 1.0], margin=0.05, confidence=0.95)
    assert verdict.mean_difference == pytest.approx(0.1)
    assert verdict.ci_low < -0.05 and not verdict.passed


def test_identical_differences_give_a_point_interval() -> None:
    slightly_worse = paired_gate([0.49, 0.49], [0.5, 0.5], margin=0.02, confidence=0.95)
    assert slightly_worse.ci_low == pytest.approx(-0.01) and slightly_worse.ci_high == pytest.approx(-0.01)
    assert slightly_worse.passed
    assert not paired_gate([0.47, 0.47], [0.5, 0.5], margin=0.02, confidence=0.95).passed


def test_higher_confidence_widens_the_interval() -> None:
    args = ([0.6, 0.9, 0.7, 0.8], [0.5, 0.6, 0.7, 0.6])
    at_90 = paired_gate(*args, margin=0.0, confidence=0.90)
    at_99 = paired_gate(*args, margin=0.0, confidence=0.99)
    assert at_99.ci_low < at_90.ci_low < at_90.mean_difference < at_90.ci_high < at_99.ci_high


def test_one_scenario_cannot_pass_and_bad_input_is_refused() -> None:
    one = paired_gate([1.0], [0.0], margin=0.5, confidence=0.95)
    assert not one.passed and one.ci_low == -math.inf
    with pytest.raises(ValueError, match="3 candidate scores for 2"):
        paired_gate([1.0, 1.0, 1.0], [0.0, 0.0], margin=0.0, confidence=0.95)
    with pytest.raises(ValueError, match="no scenarios"):
        paired_gate([], [], margin=0.0, confidence=0.95)


def test_welch_interval_of_two_arms() -> None:
    # candidate 1, 0, 1, 1 (mean 0.75, var 0.25); promoted 0, 0, 1 (mean 1/3, var 1/3)
    # se^2 = 0.25/4 + (1/3)/3 = 0.173611; df = se^4 / (0.0625^2/3 + 0.1111^2/2) = 0.030141 / 0.0074749 = 4.0323
    se = math.sqrt(0.25 / 4 + (1 / 3) / 3)
    t_4, t_5 = 2.7764, 2.5706  # Student t, 97.5th percentile, at 4 and 5 degrees of freedom: 4.03 lies between
    verdict = unpaired_gate([1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0], margin=0.1, confidence=0.95)
    difference = 0.75 - 1 / 3
    assert verdict.mean_difference == pytest.approx(difference)
    assert difference - t_4 * se < verdict.ci_low < difference - t_5 * se
    assert difference + t_5 * se < verdict.ci_high < difference + t_4 * se
    assert verdict.ci_low == pytest.approx(difference - (verdict.ci_high - difference))  # symmetric
    assert not verdict.passed  # low end about -0.74


def test_welch_decides_clear_arms_and_refuses_tiny_ones() -> None:
    better = unpaired_gate([0.9, 1.0] * 20, [0.1, 0.0] * 20, margin=0.05, confidence=0.95)
    assert better.passed and better.ci_low > 0.7
    worse = unpaired_gate([0.1, 0.0] * 20, [0.9, 1.0] * 20, margin=0.05, confidence=0.95)
    assert not worse.passed and worse.ci_high < -0.7
    same = unpaired_gate([1.0, 1.0], [1.0, 1.0], margin=0.0, confidence=0.95)
    assert same.passed and same.ci_low == same.ci_high == 0.0
    with pytest.raises(ValueError, match="2 rewards or more"):
        unpaired_gate([1.0], [0.0, 1.0], margin=0.0, confidence=0.95)
