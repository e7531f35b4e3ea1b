"""The promotion gate's rule (gateway/promotion/gate.py) against hand-computed intervals."""

from __future__ import annotations

import math

import pytest

from gateway.promotion.gate import paired_gate

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
