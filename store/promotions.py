"""What `NAME` serves: the promotion history, the offline eval sets that gate it, and their evaluations.

The newest promotion row of a model is its promoted step (what `NAME` serves); `NAME@latest` is the newest
committed step (store/adapters.py). A model without a row serves the base weights (step 0).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from store.records import RolloutKey
from store.tables import calls, eval_sets, evaluations, group_members, promotions, rewards
from store.types import EvaluationStatus, PromotionAction, PromotionActor


class PromotionRow(msgspec.Struct, frozen=True):
    model: str
    step: int
    previous_step: int | None
    action: PromotionAction
    actor: PromotionActor
    reason: str
    created_at: float


class EvalSetRow(msgspec.Struct, frozen=True):
    model: str
    name: str
    spec: dict[str, Any]  # the posted set (scenarios, samples): decoded by the gateway, which owns its format
    created_at: float


class EvaluationRow(msgspec.Struct, frozen=True):
    """One step on one eval set; the gate compares it, scenario by scenario, with the promoted step."""

    model: str
    step: int
    eval_set: str
    status: EvaluationStatus
    scores: list[float] | None  # mean reward per scenario, in the set's order
    mean: float | None
    baseline_step: int | None
    baseline_mean: float | None
    ci_low: float | None  # interval of the mean paired difference (candidate - baseline)
    ci_high: float | None
    margin: float
    error: str | None
    created_at: float
    finished_at: float | None

    @classmethod
    def running(cls, model: str, step: int, eval_set: str, baseline_step: int, margin: float) -> EvaluationRow:
        """An evaluation (or a canary) of `step` against `baseline_step` as it starts, nothing measured yet."""
        return cls(
            model=model,
            step=step,
            eval_set=eval_set,
            status="running",
            scores=None,
            mean=None,
            baseline_step=baseline_step,
            baseline_mean=None,
            ci_low=None,
            ci_high=None,
            margin=margin,
            error=None,
            created_at=time.time(),
            finished_at=None,
        )


def _struct(row: sa.Row[Any], kind: type[Any]) -> Any:
    return msgspec.convert({str(k): v for k, v in row._asdict().items()}, kind)


def _insert(conn: AsyncConnection) -> Any:
    return postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert


# ---------------------------------------------------------------- promotions


async def record_promotion(
    conn: AsyncConnection,
    *,
    model: str,
    step: int,
    previous_step: int | None,
    action: PromotionAction,
    actor: PromotionActor,
    reason: str,
) -> PromotionRow:
    row = PromotionRow(model, step, previous_step, action, actor, reason, time.time())
    await conn.execute(sa.insert(promotions).values(msgspec.structs.asdict(row)))
    return row


async def promoted_steps(conn: AsyncConnection) -> dict[str, int]:
    """Every model's promoted step (models never promoted are absent: they serve the base weights)."""
    newest = sa.select(promotions.c.model, sa.func.max(promotions.c.id).label("id")).group_by(promotions.c.model)
    newest_ids = newest.subquery()
    query = sa.select(promotions.c.model, promotions.c.step).join(newest_ids, promotions.c.id == newest_ids.c.id)
    return dict((await conn.execute(query)).tuples().all())


async def promotion_history(conn: AsyncConnection, model: str, limit: int = 20) -> list[PromotionRow]:
    """Newest first."""
    query = (
        sa.select(*[promotions.c[f] for f in PromotionRow.__struct_fields__])
        .where(promotions.c.model == model)
        .order_by(promotions.c.id.desc())
        .limit(limit)
    )
    return [_struct(r, PromotionRow) for r in await conn.execute(query)]


# ---------------------------------------------------------------- eval sets


async def put_eval_set(conn: AsyncConnection, model: str, name: str, spec: dict[str, Any]) -> tuple[EvalSetRow, bool]:
    """Create or replace a named set; (the set, created). Replacing it does not touch past evaluations."""
    created = (
        await conn.execute(sa.select(eval_sets.c.name).where(eval_sets.c.model == model, eval_sets.c.name == name))
    ).first() is None
    row = EvalSetRow(model, name, spec, time.time())
    stmt = _insert(conn)(eval_sets).values(msgspec.structs.asdict(row))
    await conn.execute(
        stmt.on_conflict_do_update(index_elements=["model", "name"], set_={"spec": spec, "created_at": row.created_at})
    )
    return row, created


async def eval_sets_of(conn: AsyncConnection, model: str) -> list[EvalSetRow]:
    query = sa.select(eval_sets).where(eval_sets.c.model == model).order_by(eval_sets.c.name)
    return [_struct(r, EvalSetRow) for r in await conn.execute(query)]


async def delete_eval_set(conn: AsyncConnection, model: str, name: str) -> bool:
    done = await conn.execute(sa.delete(eval_sets).where(eval_sets.c.model == model, eval_sets.c.name == name))
    return bool(done.rowcount)


# ---------------------------------------------------------------- evaluations


async def save_evaluation(conn: AsyncConnection, row: EvaluationRow) -> None:
    values = msgspec.structs.asdict(row)
    stmt = _insert(conn)(evaluations).values(values)
    keys = ("model", "step", "eval_set")
    await conn.execute(
        stmt.on_conflict_do_update(index_elements=list(keys), set_={k: v for k, v in values.items() if k not in keys})
    )


async def evaluations_of(conn: AsyncConnection, model: str, limit: int = 50) -> list[EvaluationRow]:
    """Newest step first."""
    query = (
        sa.select(evaluations)
        .where(evaluations.c.model == model)
        .order_by(evaluations.c.step.desc(), evaluations.c.eval_set)
        .limit(limit)
    )
    return [_struct(r, EvaluationRow) for r in await conn.execute(query)]


async def evaluation_of(conn: AsyncConnection, model: str, step: int, eval_set: str) -> EvaluationRow | None:
    query = sa.select(evaluations).where(
        evaluations.c.model == model, evaluations.c.step == step, evaluations.c.eval_set == eval_set
    )
    row = (await conn.execute(query)).first()
    return _struct(row, EvaluationRow) if row is not None else None


# ---------------------------------------------------------------- counts, for /metrics


async def promotion_counts(conn: AsyncConnection) -> dict[tuple[str, str, str], int]:
    """(model, action, actor) -> how many times."""
    query = sa.select(promotions.c.model, promotions.c.action, promotions.c.actor, sa.func.count()).group_by(
        promotions.c.model, promotions.c.action, promotions.c.actor
    )
    return {(m, a, who): n for m, a, who, n in await conn.execute(query)}


async def evaluation_counts(conn: AsyncConnection) -> dict[tuple[str, str], int]:
    """(model, status) -> evaluations (a step on one eval set)."""
    query = sa.select(evaluations.c.model, evaluations.c.status, sa.func.count()).group_by(
        evaluations.c.model, evaluations.c.status
    )
    return {(m, status): n for m, status, n in await conn.execute(query)}


# ---------------------------------------------------------------- live rewards (the canary)

CANARY = "live-canary"  # the evaluations row of a step served to a share of live traffic (no eval set has it)


async def put_reward(conn: AsyncConnection, rollout: RolloutKey, model: str, reward: float) -> bool | None:
    """Record a single rollout's reward: True if new, False if the same reward was given before, None if a
    different one was (a conflict: rewards are not rewritten)."""
    mine = sa.and_(rewards.c.owner == rollout.owner, rewards.c.rollout_id == rollout.id)
    given = (await conn.execute(sa.select(rewards.c.reward).where(mine))).first()
    if given is not None:
        return False if given[0] == reward else None
    await conn.execute(
        sa.insert(rewards).values(
            owner=rollout.owner, rollout_id=rollout.id, model=model, reward=reward, created_at=time.time()
        )
    )
    return True


async def live_rewards(conn: AsyncConnection, model: str, steps: list[int], since: float) -> dict[int, list[float]]:
    """Rewards of the model's rollouts that started at `since` or later, by the step that served them: from
    groups (the caller's reward, else the group's) and single rewards. A rollout whose calls were served by
    several steps counts for none."""
    served = (
        sa.select(calls.c.rollout_owner, calls.c.rollout_id, sa.func.min(calls.c.step).label("step"))
        .where(calls.c.model == model)
        .group_by(calls.c.rollout_owner, calls.c.rollout_id)
        .having(sa.func.min(calls.c.step) == sa.func.max(calls.c.step))
        .having(sa.func.min(calls.c.started_at) >= since)
        .subquery()
    )
    given = sa.union_all(
        sa.select(
            group_members.c.rollout_owner,
            group_members.c.rollout_id,
            sa.func.coalesce(group_members.c.caller_reward, group_members.c.reward),
        ),
        sa.select(rewards.c.owner, rewards.c.rollout_id, rewards.c.reward).where(rewards.c.model == model),
    ).subquery()
    owner, rollout_id, reward = (given.c[name] for name in given.c.keys())
    query = (
        sa.select(served.c.step, reward)
        .join(served, sa.and_(served.c.rollout_owner == owner, served.c.rollout_id == rollout_id))
        .where(served.c.step.in_(steps), reward.is_not(None))
    )
    out: dict[int, list[float]] = {step: [] for step in steps}
    for step, value in await conn.execute(query):
        out[int(step)].append(float(value))
    return out


async def running_canaries(conn: AsyncConnection) -> dict[str, EvaluationRow]:
    """model -> its canary under way."""
    query = sa.select(evaluations).where(evaluations.c.eval_set == CANARY, evaluations.c.status == "running")
    return {row.model: row for row in (_struct(r, EvaluationRow) for r in await conn.execute(query))}


async def finish_canary(conn: AsyncConnection, row: EvaluationRow) -> bool:
    """End a running canary with `row`'s outcome; False if it was no longer running (decided elsewhere)."""
    values = {k: v for k, v in msgspec.structs.asdict(row).items() if k not in ("model", "step", "eval_set")}
    done = await conn.execute(
        sa.update(evaluations)
        .where(
            evaluations.c.model == row.model,
            evaluations.c.step == row.step,
            evaluations.c.eval_set == CANARY,
            evaluations.c.status == "running",
        )
        .values(values)
    )
    return bool(done.rowcount)


async def canary_rewards(conn: AsyncConnection) -> dict[tuple[str, str], list[float]]:
    """(model, candidate|promoted) -> the live rewards of each running canary's arms so far."""
    out: dict[tuple[str, str], list[float]] = {}
    for model, row in (await running_canaries(conn)).items():
        if row.baseline_step is None:
            continue
        arms = await live_rewards(conn, model, [row.step, row.baseline_step], since=row.created_at)
        out[model, "candidate"], out[model, "promoted"] = arms[row.step], arms[row.baseline_step]
    return out
