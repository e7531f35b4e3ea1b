"""RULER with several judges and samples (ruler/_panel.py): order permutations cancel a judge's position bias,
criteria are scored and weighted, the aggregate, spread and agreement are what they say.

The judges here are stand-ins served over HTTP on 127.0.0.1 and called through litellm, as a real judge is
(`openai/...` with an `api_base`): no paid judge API can run on this machine. Each answers from what it is
shown, so what is measured is what the panel sends and does with the answers.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

import pytest

import ruler
from ruler import Criterion, Judge, Trajectory, judge_group


def first_shown_wins(blocks: list[tuple[str, str]], _: dict[str, Any]) -> dict[str, Any]:
    """A judge with nothing but position bias: the trajectory shown first gets 1, every other 0."""
    return {"scores": {tid: {"explanation": "shown first" if k == 0 else "not first", "score": float(k == 0)}
                       for k, (tid, _) in enumerate(blocks)}}  # fmt: skip


def group(n: int) -> list[Trajectory]:
    ask = {"role": "user", "content": "Name a prime number."}
    return [Trajectory([ask, {"role": "assistant", "content": f"answer {i}: {2 * i + 3}"}]) for i in range(n)]


@pytest.mark.parametrize("n", [2, 4])
async def test_without_permutations_the_first_rollout_wins_every_group(stand_in, n: int) -> None:
    judge = stand_in(first_shown_wins)
    for key in ("g-1", "g-2", "g-3"):
        result = await judge_group(group(n), judges=[judge.judge()], samples=4, permute=False, key=key)
        assert [s.score for s in result.scores] == [1.0] + [0.0] * (n - 1)
        assert result.spread == [0.0] * n  # the same answer every time: no disagreement seen
    assert judge.calls == 3  # four samples of one order are one prompt, asked once per group


@pytest.mark.parametrize("n", [2, 4])
async def test_with_four_permuted_samples_position_bias_cancels(stand_in, n: int) -> None:
    judge = stand_in(first_shown_wins)
    for key in ("g-1", "g-2", "g-3"):
        result = await judge_group(group(n), judges=[judge.judge()], samples=4, key=key)
        means = [s.score for s in result.scores]
        assert max(means) - min(means) < 1e-9, means
        assert means[0] == pytest.approx(1 / n)
        # Each trajectory shown first in 4/n of the samples: its scores are 1 that often and 0 otherwise.
        assert result.spread == pytest.approx([((1 / n) * (1 - 1 / n)) ** 0.5] * n)
        firsts = sorted(j.order[0] for j in result.judgements)
        assert firsts == sorted(list(range(n)) * (4 // n))
    assert judge.calls == 3 * n  # one call per distinct order: n rotations per group


def test_orders_are_rotations_of_a_seeded_shuffle() -> None:
    shown = ruler.orders(5, 5, "g-7")
    assert shown == ruler.orders(5, 5, "g-7")  # deterministic from the group
    assert all(sorted(order) == list(range(5)) for order in shown)
    for position in range(5):  # every trajectory in every position once
        assert sorted(order[position] for order in shown) == list(range(5))
    assert ruler.orders(5, 5, "g-8") != shown


def by_criterion(blocks: list[tuple[str, str]], request: dict[str, Any]) -> dict[str, Any]:
    """Scores each criterion from the answer's number: correctness 1 for a prime, clarity from its size."""
    system = request["messages"][0]["content"]
    assert "- correctness: Is the number prime?" in system and "- clarity: Is it short?" in system
    properties = request["response_format"]["json_schema"]["schema"]["properties"]["scores"]["properties"]
    assert properties["1"]["properties"]["criteria"]["required"] == ["correctness", "clarity"]
    scores = {}
    for tid, text in blocks:
        number = int(re.findall(r"(\d+)\"", text)[-1])
        prime = number > 1 and all(number % d for d in range(2, number))
        scores[tid] = {
            "explanation": f"{number}",
            "criteria": {"correctness": 1.0 if prime else 0.0, "clarity": round(1 / len(str(number)), 6)},
        }
    return {"scores": scores}


async def test_criteria_are_scored_and_weighted(stand_in) -> None:
    judge = stand_in(by_criterion)
    criteria = [Criterion("correctness", "Is the number prime?", 3.0), Criterion("clarity", "Is it short?", 1.0)]
    ask = {"role": "user", "content": "Name a prime number."}
    answers = ["7", "9", "101"]
    trajectories = [Trajectory([ask, {"role": "assistant", "content": a}]) for a in answers]
    result = await judge_group(trajectories, judges=[judge.judge()], samples=3, key="g", criteria=criteria)
    assert [s.criteria for s in result.scores] == [
        {"correctness": 1.0, "clarity": 1.0},
        {"correctness": 0.0, "clarity": 1.0},
        {"correctness": 1.0, "clarity": 0.333333},
    ]
    assert [s.score for s in result.scores] == [(3 * 1.0 + 1.0) / 4, (0.0 + 1.0) / 4, (3 * 1.0 + 0.333333) / 4]
    assert result.spread == [0.0, 0.0, 0.0] and result.agreement == pytest.approx(1.0)


async def test_two_judges_their_disagreement_and_the_trimmed_mean(stand_in) -> None:
    def likes_long(blocks, _):
        return {"scores": {tid: {"explanation": "", "score": min(1.0, len(text) / 100)} for tid, text in blocks}}

    def likes_short(blocks, _):
        return {"scores": {tid: {"explanation": "", "score": max(0.0, 1 - len(text) / 100)} for tid, text in blocks}}

    long_judge, short_judge = stand_in(likes_long), stand_in(likes_short)
    trajectories = group(3)
    trajectories[2] = Trajectory([*trajectories[2].messages, {"role": "user", "content": "and another " * 3}])
    result = await judge_group(
        trajectories, judges=[long_judge.judge("long"), short_judge.judge("short")], samples=3, key="g"
    )
    assert len(result.judgements) == 6 and result.usage.judge_calls == 6 and result.usage.judgements == 6
    assert result.agreement == pytest.approx((3 * 3 * -1.0 + 3 * 1.0 + 3 * 1.0) / 15)  # 9 opposed pairs, 6 alike
    # Six judgements: each trajectory's highest and lowest dropped, the four in the middle averaged.
    for i, score in enumerate(result.scores):
        values = sorted(j.scores[i].score for j in result.judgements)
        assert score.score == pytest.approx(sum(values[1:-1]) / 4)
        assert result.spread[i] == pytest.approx(statistics.pstdev(values))
    assert min(result.spread) > 0.05 and result.group_spread == pytest.approx(sum(result.spread) / 3)


def test_spearman_and_agreement_by_hand() -> None:
    assert ruler.spearman([0.1, 0.5, 0.9], [0.2, 0.3, 0.4]) == pytest.approx(1.0)
    assert ruler.spearman([0.1, 0.5, 0.9], [0.4, 0.3, 0.2]) == pytest.approx(-1.0)
    assert ruler.spearman([0.1, 0.1, 0.9], [0.2, 0.3, 0.4]) == pytest.approx(0.8660254)  # ties share ranks
    assert ruler.spearman([0.5, 0.5], [0.1, 0.9]) is None  # a constant judgement ranks nothing
    assert ruler.agreement([[0.1, 0.9], [0.2, 0.8], [0.9, 0.1]]) == pytest.approx((1 - 1 - 1) / 3)


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"judges": []}, "at least one judge"),
        ({"samples": 0}, "samples must be >= 1"),
        ({"criteria": [Criterion("a", "x"), Criterion("a", "y")]}, "names must differ"),
        ({"criteria": [Criterion("a", "x", 0.0)]}, "weight > 0"),
    ],
)
async def test_rejects_bad_panels(kwargs: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        await judge_group(group(2), **{"judges": [Judge("openai/x")], **kwargs})
