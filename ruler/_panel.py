"""judge_group: several judges, several samples each, the trajectories shown in a different order each time.

One judgement is one `score_group` call (one judge, one order). With several samples the orders are rotations
of one base order (a shuffle seeded by the group's key): sample s shows the trajectory at base position
(k + s) mod n k-th; with one sample a judge sees the group in its own order, as a single judgement always did.
With `samples` a multiple of the group's size every trajectory is shown in every position equally often, so a
judge's position bias cancels exactly; with fewer it is spread as evenly as rotations allow. Two judgements
that show the same order to the same judge are one prompt: it is asked once (and cached as any prompt).

The reward is the mean of a trajectory's scores over the judgements, trimmed (the highest and the lowest
dropped) once there are five or more: every judgement scores on the same [0, 1] scale the schema enforces, and
GRPO uses a reward only relative to its group's others, so no further normalisation is needed, while the trim
keeps one judgement that misread the task from moving the reward. The spread (population standard deviation
of a trajectory's scores over the judgements) says how much the judgements disagree; agreement is the mean
pairwise Spearman correlation between judgements over the group.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import statistics
from collections.abc import Sequence
from typing import Any

import msgspec
from opentelemetry.trace import Tracer

from ruler._prompt import DEFAULT_RUBRIC, check_criteria, weighted_score
from ruler._score import score_group
from ruler._types import Criterion, JudgeCache, JudgeUsage, Score, ScoreResult, Trajectory

TRIM_FROM = 5  # judgements from which the highest and lowest score of a trajectory are dropped


class Judge(msgspec.Struct, frozen=True):
    """One judge: a litellm model and its call parameters (api_base, api_key, temperature, ...)."""

    judge_model: str
    litellm_params: dict[str, Any] = {}


class Judgement(msgspec.Struct, frozen=True):
    """One judge's scores for the group, shown in `order` (order[k]: the index of the trajectory shown k-th);
    `scores[i]` is trajectory i's, in the group's own order."""

    judge: int  # index into the judges
    sample: int
    order: list[int]
    scores: list[Score]


class PanelResult(msgspec.Struct, frozen=True):
    """`scores[i]`: trajectory i's aggregate (its criteria too, each aggregated alike); `spread[i]`: how much
    the judgements disagree on it."""

    scores: list[Score]
    spread: list[float]
    group_spread: float  # the mean of `spread`
    agreement: float | None  # mean pairwise Spearman between judgements; None with fewer than two
    judgements: list[Judgement]
    usage: JudgeUsage


def orders(n: int, samples: int, key: str) -> list[list[int]]:
    """The order each sample shows the n trajectories in: rotations of a base order seeded by `key`."""
    base = list(range(n))
    random.Random(hashlib.sha256(key.encode()).digest()).shuffle(base)
    return [[base[(k + s) % n] for k in range(n)] for s in range(samples)]


def robust_mean(values: Sequence[float]) -> float:
    """The mean, without the highest and the lowest value once there are TRIM_FROM or more."""
    return statistics.fmean(sorted(values)[1:-1] if len(values) >= TRIM_FROM else values)


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation of two score lists (ties share ranks); None when either is constant (no
    ranking to compare: scipy would answer NaN with a warning)."""
    if len(set(a)) < 2 or len(set(b)) < 2:
        return None
    # scipy.stats takes about a second to import: the first panel pays it, not every import of ruler.
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def agreement(judgements: Sequence[Sequence[float]]) -> float | None:
    """The mean Spearman correlation over pairs of judgements (pairs with a constant one left out)."""
    pairs = [
        rho
        for i in range(len(judgements))
        for j in range(i + 1, len(judgements))
        if (rho := spearman(judgements[i], judgements[j])) is not None
    ]
    return math.fsum(pairs) / len(pairs) if pairs else None


def _total(usages: Sequence[JudgeUsage], judgements: int) -> JudgeUsage:
    costs = [u.cost_usd for u in usages]
    return JudgeUsage(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cost_usd=None if any(c is None for c in costs) else math.fsum(c for c in costs if c is not None),
        judge_calls=sum(u.judge_calls for u in usages),
        cache_hits=sum(u.cache_hits for u in usages),
        judgements=judgements,
    )


async def judge_group(
    trajectories: Sequence[Trajectory],
    *,
    judges: Sequence[Judge],
    samples: int = 1,
    permute: bool = True,
    key: str = "",
    rubric: str = DEFAULT_RUBRIC,
    criteria: Sequence[Criterion] = (),
    cache: JudgeCache | None = None,
    max_concurrent: int = 4,
    slots: asyncio.Semaphore | None = None,
    max_retries: int = 3,
    backoff_seconds: float = 0.5,
    tracer: Tracer | None = None,
) -> PanelResult:
    """Score a group with every judge `samples` times (module docstring). `key` names the group (its id): the
    orders follow from it, the same for every run. `permute=False` shows every sample the group's own order
    (position bias kept: for comparison). At most `max_concurrent` judge calls run at once (or as many as
    `slots` lets through, a semaphore shared with other groups); a judge that fails fails the whole group
    (RulerError), as one judge does alone."""
    if not judges:
        raise ValueError("judge_group needs at least one judge")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if max_concurrent < 1:
        raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
    check_criteria(criteria)
    n = len(trajectories)
    shown = orders(n, samples, key) if permute and samples > 1 else [list(range(n))] * samples
    slots = slots or asyncio.Semaphore(max_concurrent)
    asked: dict[tuple[int, tuple[int, ...]], asyncio.Task[ScoreResult]] = {}

    async def one(judge: Judge, order: list[int]) -> ScoreResult:
        async with slots:
            return await score_group(
                [trajectories[i] for i in order],
                judge_model=judge.judge_model,
                rubric=rubric,
                criteria=criteria,
                litellm_params=judge.litellm_params,
                cache=cache,
                max_retries=max_retries,
                backoff_seconds=backoff_seconds,
                tracer=tracer,
            )

    plan = [(j, s, shown[s]) for j in range(len(judges)) for s in range(samples)]
    for j, _, order in plan:  # one call per distinct prompt: same judge, same order
        if (j, tuple(order)) not in asked:
            asked[(j, tuple(order))] = asyncio.ensure_future(one(judges[j], order))
    try:
        await asyncio.gather(*asked.values())
    finally:
        for task in asked.values():
            task.cancel()
    judgements = []
    for j, s, order in plan:
        shown_at = {index: position for position, index in enumerate(order)}  # the inverse of the order
        result = asked[(j, tuple(order))].result()
        judgements.append(Judgement(j, s, order, [result.scores[shown_at[i]] for i in range(n)]))
    usage = _total([task.result().usage for task in asked.values()], len(plan))
    return _aggregate(judgements, criteria, usage)


def _aggregate(judgements: list[Judgement], criteria: Sequence[Criterion], usage: JudgeUsage) -> PanelResult:
    n = len(judgements[0].scores)
    per_trajectory = [[jd.scores[i].score for jd in judgements] for i in range(n)]
    scores = []
    for i in range(n):
        explanation = judgements[0].scores[i].explanation
        if not criteria:
            scores.append(Score(robust_mean(per_trajectory[i]), explanation))
            continue
        # Each criterion aggregated alike; the score is their weighted mean, as for one judgement.
        by_criterion = {
            c.name: robust_mean([(jd.scores[i].criteria or {})[c.name] for jd in judgements]) for c in criteria
        }
        scores.append(Score(weighted_score(by_criterion, criteria), explanation, by_criterion))
    spreads = [statistics.pstdev(values) for values in per_trajectory]
    return PanelResult(
        scores=scores,
        spread=spreads,
        group_spread=math.fsum(spreads) / n,
        agreement=agreement([[s.score for s in jd.scores] for jd in judgements]),
        judgements=judgements,
        usage=usage,
    )
