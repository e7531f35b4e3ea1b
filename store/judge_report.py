"""Judge calibration: how well RULER's ranking of a group agrees with the caller's own rewards.

GRPO learns from the order of the rewards inside a group, so agreement is measured there: Spearman's rho
and Kendall's tau-b between the caller's rewards and the judge's scores of each group, averaged over the
groups where both sides vary, per (rubric, judge model). The correlation pooled over every member of every
group is reported beside it (it also compares members of different groups, which GRPO never does). A rubric
whose mean per-group Spearman falls below a threshold is flagged: its judge ranks the attempts unlike the
outcomes the caller measures, and training on its scores would teach the model to please the judge.

A group judged by a panel (several judges or samples, #29) reports under its panel's label, with the
agreement between its judgements (the groups' mean pairwise Spearman, as scored) beside the agreement with the
caller; a group scored on criteria reports each criterion's agreement with the caller too, so a criterion the
judge scores unlike the outcome shows by name.

`judged_groups` reads the store; everything else here is pure and works on what it returns.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from store.groups import group_name
from store.tables import group_members, groups

# agrees: mean per-group Spearman at or above the threshold; flagged: below it; no_ranked_groups: in no group
# do both the caller's rewards and the judge's scores vary, so there is nothing to judge the judge by yet.
AgreementState = Literal["agrees", "flagged", "no_ranked_groups"]
WORST_GROUPS = 5  # the worst-agreeing groups a report lists per rubric and judge


class JudgedGroup(msgspec.Struct, frozen=True):
    """A group's members that both the caller and the judge scored, in position order."""

    group_id: str
    judge_model: str
    rubric: str
    caller_rewards: tuple[float, ...]
    judge_scores: tuple[float, ...]
    criteria: dict[str, tuple[float, ...]] = {}  # criterion -> each member's score, with criteria
    judge_agreement: float | None = None  # the panel's judgements among themselves (mean pairwise Spearman)
    owner: str = ""  # whose group it is: `group_id` is as that owner named it


class CriterionAgreement(msgspec.Struct, frozen=True):
    """One criterion's scores against the caller's rewards, as the whole score is."""

    name: str
    ranked_groups: int
    spearman_mean: float | None


class Correlation(msgspec.Struct, frozen=True):
    spearman: float
    kendall: float  # tau-b: corrected for ties on either side


class GroupAgreement(msgspec.Struct, frozen=True):
    group_id: str  # as its owner named it (`GET /v1/art/groups/{id}`, with `?owner=` for the admin)
    members: int
    spearman: float
    kendall: float
    owner: str = ""  # whose group it is: a report lists only the groups its reader may read


class RubricAgreement(msgspec.Struct, frozen=True):
    """One (rubric, judge model): how its scores rank the attempts against the caller's rewards."""

    rubric_id: str  # the rubric's sha256, first 12 hex digits: a short label for tables and metrics
    rubric: str
    judge_model: str
    groups: int  # groups with at least 2 members scored by both
    ranked_groups: int  # of those, the groups where both sides vary: what the means are over
    pairs: int  # members scored by both, all groups together
    spearman_mean: float | None  # None: no ranked group
    kendall_mean: float | None
    pooled_spearman: float | None  # None: fewer than 2 pairs, or one side constant over all of them
    pooled_kendall: float | None
    state: AgreementState
    worst_groups: list[GroupAgreement]  # lowest per-group Spearman first, at most WORST_GROUPS
    judges_agreement: float | None = None  # a panel's judgements among themselves, mean over its groups
    criteria: list[CriterionAgreement] = []  # by name


class JudgeReport(msgspec.Struct, frozen=True):
    model: str
    threshold: float  # a rubric whose mean per-group Spearman is below it is flagged
    rubrics: list[RubricAgreement]  # by judge model, then rubric id
    object: str = "art.judge_report"


def rubric_id(rubric: str) -> str:
    return hashlib.sha256(rubric.encode()).hexdigest()[:12]


# ---------------------------------------------------------------- reading


async def judged_groups(conn: AsyncConnection, model: str) -> list[JudgedGroup]:
    """The groups of `model` that RULER scored and whose caller sent rewards too (any state: a group the
    trainer later dropped was still judged), with the members both scored; oldest group first."""
    query = (
        sa.select(
            groups.c.id,
            groups.c.owner,
            groups.c.ruler,
            groups.c.judge_agreement,
            group_members.c.caller_reward,
            group_members.c.ruler_score,
            group_members.c.ruler_criteria,
        )
        .join(group_members, group_members.c.group_id == groups.c.id)
        .where(
            groups.c.model == model,
            # Only RULER groups get scores (store.groups.scored), and their `ruler` holds the judge and rubric.
            group_members.c.caller_reward.is_not(None),
            group_members.c.ruler_score.is_not(None),
        )
        .order_by(groups.c.created_at, groups.c.id, group_members.c.position)
    )
    # (owner, store key) -> its ruler, agreement, the callers' rewards, the judges' scores, each criterion's scores
    found: dict[tuple[str, str], tuple[dict[str, Any], float | None, list[float], list[float], dict[str, list[float]]]]
    found = {}
    for key, owner, ruler, agreement, caller_reward, ruler_score, criteria in await conn.execute(query):
        _, _, callers, judges, by_criterion = found.setdefault((owner, key), (ruler, agreement, [], [], {}))
        callers.append(caller_reward)
        judges.append(ruler_score)
        for name, value in (criteria or {}).items():
            by_criterion.setdefault(name, []).append(value)
    return [
        JudgedGroup(
            group_name(owner, key),
            panel_label(ruler),
            ruler.get("rubric") or "",
            tuple(callers),
            tuple(judges),
            {name: tuple(values) for name, values in by_criterion.items() if len(values) == len(callers)},
            agreement,
            owner,
        )
        for (owner, key), (ruler, agreement, callers, judges, by_criterion) in found.items()
    ]


def panel_label(ruler: dict[str, Any]) -> str:
    """Who judged a group, as the report names it: the judge model, or a panel's models and samples
    (`a + b x2`: two judges, two samples each)."""
    judges = ruler.get("judges") or [{"judge_model": ruler.get("judge_model")}]
    label = " + ".join(str(j.get("judge_model")) for j in judges)
    samples = int(ruler.get("samples") or 1)
    return f"{label} x{samples}" if samples > 1 else label


# ---------------------------------------------------------------- statistics (pure)


def rank_correlation(caller: Sequence[float], judge: Sequence[float]) -> Correlation | None:
    """Spearman's rho and Kendall's tau-b of paired values; None when fewer than 2 pairs or either side is
    constant (a correlation is undefined then: scipy would answer NaN with a warning)."""
    assert len(caller) == len(judge), "paired values"
    if len(caller) < 2 or len(set(caller)) < 2 or len(set(judge)) < 2:
        return None
    # scipy.stats takes about a second to import: the first report pays it, not every gateway start.
    from scipy.stats import kendalltau, spearmanr

    return Correlation(
        spearman=float(spearmanr(caller, judge).statistic),
        kendall=float(kendalltau(caller, judge, variant="b").statistic),
    )


def _rubric_agreement(judged: Sequence[JudgedGroup], threshold: float) -> RubricAgreement:
    first = judged[0]
    ranked: list[GroupAgreement] = []
    for group in judged:
        correlation = rank_correlation(group.caller_rewards, group.judge_scores)
        if correlation is not None:
            members = len(group.caller_rewards)
            ranked.append(
                GroupAgreement(group.group_id, members, correlation.spearman, correlation.kendall, group.owner)
            )
    pooled = rank_correlation(
        [r for g in judged for r in g.caller_rewards], [s for g in judged for s in g.judge_scores]
    )
    spearman_mean = statistics.fmean(g.spearman for g in ranked) if ranked else None
    panel = [g.judge_agreement for g in judged if g.judge_agreement is not None]
    state: AgreementState
    if spearman_mean is None:
        state = "no_ranked_groups"
    else:
        state = "flagged" if spearman_mean < threshold else "agrees"
    return RubricAgreement(
        rubric_id=rubric_id(first.rubric),
        rubric=first.rubric,
        judge_model=first.judge_model,
        groups=len(judged),
        ranked_groups=len(ranked),
        pairs=sum(len(g.caller_rewards) for g in judged),
        spearman_mean=spearman_mean,
        kendall_mean=statistics.fmean(g.kendall for g in ranked) if ranked else None,
        pooled_spearman=pooled.spearman if pooled else None,
        pooled_kendall=pooled.kendall if pooled else None,
        state=state,
        worst_groups=sorted(ranked, key=lambda g: (g.spearman, g.kendall, g.group_id))[:WORST_GROUPS],
        judges_agreement=statistics.fmean(panel) if panel else None,
        criteria=[_criterion_agreement(name, judged) for name in sorted({n for g in judged for n in g.criteria})],
    )


def _criterion_agreement(name: str, judged: Sequence[JudgedGroup]) -> CriterionAgreement:
    rhos = [
        correlation.spearman
        for g in judged
        if name in g.criteria and (correlation := rank_correlation(g.caller_rewards, g.criteria[name])) is not None
    ]
    return CriterionAgreement(name, len(rhos), statistics.fmean(rhos) if rhos else None)


def by_judge(judged: Sequence[JudgedGroup]) -> dict[tuple[str, str], list[JudgedGroup]]:
    """(judge model, rubric id) -> its groups, in that key order. Groups with fewer than 2 members scored by
    both sides say nothing about an order and are left out."""
    found: dict[tuple[str, str], list[JudgedGroup]] = {}
    for group in judged:
        if len(group.caller_rewards) >= 2:
            found.setdefault((group.judge_model, rubric_id(group.rubric)), []).append(group)
    return {key: found[key] for key in sorted(found)}


def judge_report(model: str, judged: Sequence[JudgedGroup], threshold: float) -> JudgeReport:
    """The report of `model`'s judged groups: one entry per (rubric, judge model)."""
    return JudgeReport(
        model=model,
        threshold=threshold,
        rubrics=[_rubric_agreement(same_judge, threshold) for same_judge in by_judge(judged).values()],
    )
