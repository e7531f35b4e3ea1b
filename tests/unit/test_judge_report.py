"""The judge report's statistics (store/judge_report.py) against a reference written here by hand.

The reference is the textbook definitions, nothing shared with the code under test: Spearman's rho is the
Pearson correlation of the ranks, tied values getting the mean of the ranks they span; Kendall's tau-b counts
every pair, (concordant - discordant) / sqrt((pairs - tied in x) * (pairs - tied in y)).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence

import pytest

from store.judge_report import WORST_GROUPS, JudgedGroup, judge_report, rank_correlation, rubric_id
from tests.rank_stats import average_ranks, reference_kendall_tau_b, reference_spearman

# ---------------------------------------------------------------- the reference


def test_the_reference_itself_on_values_worked_out_by_hand() -> None:
    assert average_ranks([10, 20, 20, 30]) == [1.0, 2.5, 2.5, 4.0]
    # x = 1,2,3 and y = 1,3,2: ranks differ by 0,1,1, so rho = 1 - 6*2 / (3*8) = 0.5; pairs: 2 concordant, 1 not.
    assert reference_spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert reference_kendall_tau_b([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    # One tie in x: pairs (1,2) tied in x; (1,3) and (2,3) concordant: 2 / sqrt(2 * 3).
    assert reference_kendall_tau_b([0, 0, 1], [1, 2, 3]) == pytest.approx(2 / math.sqrt(6))


# ---------------------------------------------------------------- rank_correlation


CASES = {
    "no ties": ([0.1, 0.5, 0.9, 0.3], [0.2, 0.4, 0.95, 0.1]),
    "perfect": ([1, 2, 3, 4], [0.1, 0.2, 0.3, 0.4]),
    "inverse": ([1, 2, 3], [0.9, 0.5, 0.1]),
    "two members": ([0.0, 1.0], [0.7, 0.2]),
    "ties in the caller's rewards": ([1, 1, 0, 0, 0.5], [0.9, 0.6, 0.3, 0.4, 0.5]),
    "ties on both sides": ([1, 1, 0, 0, 1], [0.8, 0.8, 0.2, 0.8, 0.5]),
    "binary rewards, graded scores": ([1, 0, 1, 0, 0, 1], [0.7, 0.3, 0.4, 0.35, 0.9, 0.65]),
}


@pytest.mark.parametrize("case", CASES)
def test_rank_correlation_matches_the_textbook_definitions(case: str) -> None:
    caller, judge = CASES[case]
    correlation = rank_correlation(caller, judge)
    assert correlation is not None
    assert correlation.spearman == pytest.approx(reference_spearman(caller, judge), abs=1e-12)
    assert correlation.kendall == pytest.approx(reference_kendall_tau_b(caller, judge), abs=1e-12)


def test_rank_correlation_on_random_groups_with_many_ties() -> None:
    rng = random.Random(15)
    for _ in range(200):
        n = rng.randrange(2, 12)
        caller = [float(rng.randrange(3)) for _ in range(n)]  # few levels: ties everywhere
        judge = [round(rng.random(), 1) for _ in range(n)]
        correlation = rank_correlation(caller, judge)
        if len(set(caller)) < 2 or len(set(judge)) < 2:
            assert correlation is None
            continue
        assert correlation is not None
        assert correlation.spearman == pytest.approx(reference_spearman(caller, judge), abs=1e-12)
        assert correlation.kendall == pytest.approx(reference_kendall_tau_b(caller, judge), abs=1e-12)


@pytest.mark.parametrize(
    ("caller", "judge"),
    [
        ([1.0, 1.0, 1.0], [0.1, 0.5, 0.9]),  # the caller saw no difference
        ([0.0, 1.0, 0.5], [0.4, 0.4, 0.4]),  # the judge saw none
        ([1.0], [0.3]),  # one member: no order at all
        ([], []),
    ],
)
def test_no_correlation_where_it_is_undefined(caller: list[float], judge: list[float]) -> None:
    assert rank_correlation(caller, judge) is None


# ---------------------------------------------------------------- judge_report

GOOD_RUBRIC = "Correct answers win; shorter wins a tie."
BAD_RUBRIC = "The longest answer wins."


def group(
    group_id: str,
    caller: Sequence[float],
    judge: Sequence[float],
    *,
    rubric: str = GOOD_RUBRIC,
    judge_model: str = "openai/judge",
) -> JudgedGroup:
    return JudgedGroup(group_id, judge_model, rubric, tuple(caller), tuple(judge))


def test_a_report_averages_over_groups_where_both_sides_vary_and_pools_all_members() -> None:
    groups = [
        group("g1", [1, 0, 0.5], [0.9, 0.1, 0.4]),
        group("g2", [1, 0, 1, 0], [0.8, 0.3, 0.2, 0.1]),
        group("g3", [1, 1, 1], [0.2, 0.5, 0.9]),  # the caller's rewards are all equal: no order to compare
        group("g4", [0.5], [0.5]),  # one member scored by both: left out altogether
    ]
    report = judge_report("my-agent", groups, threshold=0.5)
    assert report.model == "my-agent" and report.threshold == 0.5
    [row] = report.rubrics
    ranked = groups[:2]
    assert (row.groups, row.ranked_groups, row.pairs) == (3, 2, 10)
    assert row.spearman_mean == pytest.approx(
        sum(reference_spearman(g.caller_rewards, g.judge_scores) for g in ranked) / 2
    )
    assert row.kendall_mean == pytest.approx(
        sum(reference_kendall_tau_b(g.caller_rewards, g.judge_scores) for g in ranked) / 2
    )
    pooled_caller = [r for g in groups[:3] for r in g.caller_rewards]
    pooled_judge = [s for g in groups[:3] for s in g.judge_scores]
    assert row.pooled_spearman == pytest.approx(reference_spearman(pooled_caller, pooled_judge))
    assert row.pooled_kendall == pytest.approx(reference_kendall_tau_b(pooled_caller, pooled_judge))
    assert row.rubric == GOOD_RUBRIC and row.judge_model == "openai/judge"
    assert row.rubric_id == hashlib.sha256(GOOD_RUBRIC.encode()).hexdigest()[:12] == rubric_id(GOOD_RUBRIC)
    assert [g.group_id for g in row.worst_groups] == ["g2", "g1"]  # g2's rho is the lower
    # By hand: g1's order is the caller's (rho 1); g2's ranks [3.5, 1.5, 3.5, 1.5] vs [4, 3, 2, 1]: 2 / sqrt(4 * 5).
    assert row.spearman_mean == pytest.approx((1 + 2 / math.sqrt(20)) / 2)
    assert row.state == "agrees"


def test_rubrics_and_judges_are_reported_apart_and_a_disagreeing_one_is_flagged() -> None:
    groups = [
        group("good-1", [1, 0, 0], [0.9, 0.2, 0.1]),
        group("bad-1", [1, 0, 0], [0.1, 0.9, 0.5], rubric=BAD_RUBRIC),
        group("good-2", [0, 1], [0.3, 0.6]),
        group("bad-2", [0, 1, 0.5], [0.5, 0.5, 0.9], rubric=BAD_RUBRIC),
        group("other-judge", [0, 1], [0.9, 0.1], judge_model="hosted_vllm/other"),
    ]
    report = judge_report("my-agent", groups, threshold=0.5)
    keys = [(r.judge_model, r.rubric_id) for r in report.rubrics]
    assert keys == sorted(keys) and len(keys) == 3
    rows = {(r.judge_model, r.rubric): r for r in report.rubrics}
    good = rows["openai/judge", GOOD_RUBRIC]
    bad = rows["openai/judge", BAD_RUBRIC]
    other = rows["hosted_vllm/other", GOOD_RUBRIC]
    assert good.state == "agrees" and good.groups == 2
    assert good.spearman_mean == pytest.approx((reference_spearman([1, 0, 0], [0.9, 0.2, 0.1]) + 1) / 2)
    assert bad.state == "flagged" and bad.spearman_mean is not None and bad.spearman_mean < 0.5
    assert bad.spearman_mean == pytest.approx(
        (reference_spearman([1, 0, 0], [0.1, 0.9, 0.5]) + reference_spearman([0, 1, 0.5], [0.5, 0.5, 0.9])) / 2
    )
    assert other.state == "flagged" and other.spearman_mean == pytest.approx(-1.0)


def test_the_threshold_is_a_lower_bound_that_agreement_may_equal() -> None:
    groups = [group("g", [1, 2, 3], [1, 3, 2])]  # rho = 0.5 exactly
    assert judge_report("m", groups, threshold=0.5).rubrics[0].state == "agrees"
    assert judge_report("m", groups, threshold=0.51).rubrics[0].state == "flagged"


def test_only_constant_groups_leave_the_agreement_unknown_not_flagged() -> None:
    groups = [group("g1", [1, 1], [0.2, 0.9]), group("g2", [0, 1], [0.5, 0.5])]
    [row] = judge_report("m", groups, threshold=0.5).rubrics
    assert row.state == "no_ranked_groups"
    assert (row.groups, row.ranked_groups, row.pairs) == (2, 0, 4)
    assert row.spearman_mean is None and row.kendall_mean is None and row.worst_groups == []
    # Pooled over both groups the values do vary: [1, 1, 0, 1] against [0.2, 0.9, 0.5, 0.5].
    assert row.pooled_spearman == pytest.approx(reference_spearman([1, 1, 0, 1], [0.2, 0.9, 0.5, 0.5]))


def test_the_worst_groups_are_the_lowest_spearman_first_and_at_most_five() -> None:
    rng = random.Random(7)
    groups = []
    for k in range(9):
        caller = [float(v) for v in range(5)]
        groups.append(group(f"g{k}", caller, [rng.random() for _ in caller]))
    [row] = judge_report("m", groups, threshold=0.5).rubrics
    expected = sorted(groups, key=lambda g: reference_spearman(g.caller_rewards, g.judge_scores))[:WORST_GROUPS]
    assert [g.group_id for g in row.worst_groups] == [g.group_id for g in expected]
    for listed, source in zip(row.worst_groups, expected, strict=True):
        assert listed.members == 5
        assert listed.spearman == pytest.approx(reference_spearman(source.caller_rewards, source.judge_scores))
        assert listed.kendall == pytest.approx(reference_kendall_tau_b(source.caller_rewards, source.judge_scores))


def test_no_judged_group_is_an_empty_report() -> None:
    assert judge_report("m", [], threshold=0.5).rubrics == []


@pytest.mark.parametrize("threshold", [1.5, -1.01, float("nan")])
def test_the_threshold_setting_must_be_a_correlation(threshold: float) -> None:
    from gateway.settings import Settings

    with pytest.raises(ValueError, match="--judge-agreement-threshold"):
        Settings(upstream=("http://127.0.0.1:1",), judge_agreement_threshold=threshold)
    assert Settings(upstream=("http://127.0.0.1:1",)).judge_agreement_threshold == 0.5


# ---------------------------------------------------------------- panels and criteria (#29)


def test_a_panel_reports_its_judges_agreement_and_each_criterion() -> None:
    """Two groups judged by a panel on two criteria: `brief` ranks the attempts as the callers do (rho 1),
    `polite` the other way round (rho -1); the panel's own agreement is the mean of the groups'."""
    caller = (0.0, 1.0, 2.0)
    groups = [
        JudgedGroup(
            f"g{k}",
            "openai/a + openai/b x2",
            "R",
            caller,
            (0.2, 0.5, 0.9),
            {"brief": (0.1, 0.4, 0.8), "polite": (0.9, 0.5, 0.2)},
            agreement,
        )
        for k, agreement in enumerate((0.5, 0.9))
    ]
    (rubric,) = judge_report("my-agent", groups, threshold=0.5).rubrics
    assert rubric.judge_model == "openai/a + openai/b x2"
    assert rubric.judges_agreement == pytest.approx(0.7)
    assert [(c.name, c.ranked_groups, c.spearman_mean) for c in rubric.criteria] == [
        ("brief", 2, pytest.approx(1.0)),
        ("polite", 2, pytest.approx(-1.0)),
    ]


def test_the_cli_prints_the_panels_table(capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    from artgw.cli import _print_judge_report

    groups = [JudgedGroup("g", "openai/a + openai/b", "R", (0.0, 1.0), (0.2, 0.9), {"brief": (0.9, 0.1)}, 0.8)]
    _print_judge_report(Console(width=120), judge_report("my-agent", groups, threshold=0.5))
    out = capsys.readouterr().out
    assert "panels: the judges among themselves" in out
    row = next(line for line in out.splitlines() if "brief" in line)
    assert "+0.800" in row and "-1.000" in row
