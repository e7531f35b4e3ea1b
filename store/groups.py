"""Writing and reading groups, their members and the judge cache."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from store.tables import group_members, groups


class MemberRow(msgspec.Struct, frozen=True):
    position: int
    rollout_ref: str
    rollout_id: str
    choice: int | None
    reward: float | None
    caller_reward: float | None
    ruler_score: float | None
    ruler_explanation: str | None
    metrics: dict[str, float] | None


class GroupRow(msgspec.Struct, frozen=True):
    id: str
    model: str
    state: str
    failure_reason: str | None
    request_hash: str
    metadata: dict[str, Any] | None
    ruler: dict[str, Any] | None
    judge_usage: dict[str, Any] | None
    no_signal: bool | None
    created_at: float
    updated_at: float
    lease_owner: str | None
    lease_expires_at: float | None
    trained_step: int | None
    members: list[MemberRow] = []


def _plain(row: sa.Row[Any]) -> dict[str, Any]:
    return {str(k): v for k, v in row._asdict().items()}


async def insert_group(conn: AsyncConnection, group: dict[str, Any], members: Sequence[dict[str, Any]]) -> None:
    await conn.execute(sa.insert(groups), [group])
    await conn.execute(sa.insert(group_members), [{**m, "group_id": group["id"]} for m in members])


async def load_groups(conn: AsyncConnection, group_ids: Sequence[str]) -> list[GroupRow]:
    """Groups with their members, in the order of `group_ids` (unknown ids are left out)."""
    if not group_ids:
        return []
    rows = {r.id: _plain(r) for r in await conn.execute(sa.select(groups).where(groups.c.id.in_(group_ids)))}
    members: dict[str, list[MemberRow]] = {gid: [] for gid in rows}
    query = (
        sa.select(group_members)
        .where(group_members.c.group_id.in_(list(rows)))
        .order_by(group_members.c.group_id, group_members.c.position)
    )
    for m in await conn.execute(query):
        data = _plain(m)
        members[data.pop("group_id")].append(msgspec.convert(data, MemberRow))
    return [msgspec.convert({**rows[g], "members": members[g]}, GroupRow) for g in group_ids if g in rows]


async def taken_refs(conn: AsyncConnection, rollout_ids: Sequence[str]) -> dict[str, str]:
    """rollout_ref -> group id, for every member of any group that uses one of these rollouts."""
    query = sa.select(group_members.c.rollout_ref, group_members.c.group_id).where(
        group_members.c.rollout_id.in_(rollout_ids)
    )
    return {ref: gid for ref, gid in await conn.execute(query)}


async def list_group_ids(
    conn: AsyncConnection,
    *,
    model: str | None,
    state: str | None,
    limit: int,
    after: tuple[float, str] | None,
) -> list[tuple[float, str]]:
    query = sa.select(groups.c.created_at, groups.c.id).order_by(groups.c.created_at, groups.c.id).limit(limit)
    if model is not None:
        query = query.where(groups.c.model == model)
    if state is not None:
        query = query.where(groups.c.state == state)
    if after is not None:
        query = query.where(sa.tuple_(groups.c.created_at, groups.c.id) > sa.tuple_(*after))
    return [(row.created_at, row.id) for row in await conn.execute(query)]


async def set_scores(
    conn: AsyncConnection,
    group_id: str,
    scores: Sequence[tuple[int, float, str]],
    judge_usage: dict[str, Any],
    no_signal: bool,
) -> None:
    """RULER's scores become the rewards; the group turns `ready`."""
    for position, score, explanation in scores:
        await conn.execute(
            sa.update(group_members)
            .where(group_members.c.group_id == group_id, group_members.c.position == position)
            .values(reward=score, ruler_score=score, ruler_explanation=explanation)
        )
    await conn.execute(
        sa.update(groups)
        .where(groups.c.id == group_id, groups.c.state == "scoring")
        .values(state="ready", judge_usage=judge_usage, no_signal=no_signal, updated_at=time.time())
    )


async def fail_group(conn: AsyncConnection, group_id: str, reason: str, judge_usage: dict[str, Any] | None) -> None:
    await conn.execute(
        sa.update(groups)
        .where(groups.c.id == group_id, groups.c.state == "scoring")
        .values(state="failed", failure_reason=reason, judge_usage=judge_usage, updated_at=time.time())
    )


async def scoring_group_ids(conn: AsyncConnection) -> list[str]:
    return list((await conn.execute(sa.select(groups.c.id).where(groups.c.state == "scoring"))).scalars())


async def count_by_state(conn: AsyncConnection) -> dict[tuple[str, str], int]:
    query = sa.select(groups.c.model, groups.c.state, sa.func.count()).group_by(groups.c.model, groups.c.state)
    return {(model, state): n for model, state, n in await conn.execute(query)}


# ---------------------------------------------------------------- the trainer's claims (leases)


def _claimable(now: float) -> sa.ColumnElement[bool]:
    # Ready, or claimed by a trainer whose lease ran out (it died): claimable again.
    return sa.or_(groups.c.state == "ready", sa.and_(groups.c.state == "training", groups.c.lease_expires_at < now))


async def claim_groups(conn: AsyncConnection, *, model: str, owner: str, lease_seconds: float, limit: int) -> list[str]:
    """Claim up to `limit` groups for training, oldest first, in one transaction.

    On PostgreSQL the candidates are locked with `FOR UPDATE SKIP LOCKED`, so concurrent trainers
    never wait on or double-claim a group; on SQLite the single writer serializes claims, and the
    guarded UPDATE ... RETURNING reports only what this claim really took.
    """
    now = time.time()
    candidates = (
        sa.select(groups.c.id)
        .where(groups.c.model == model, _claimable(now))
        .order_by(groups.c.created_at, groups.c.id)
        .limit(limit)
    )
    if conn.dialect.name == "postgresql":
        candidates = candidates.with_for_update(skip_locked=True)
    ids = list((await conn.execute(candidates)).scalars())
    if not ids:
        return []
    claimed = await conn.execute(
        sa.update(groups)
        .where(groups.c.id.in_(ids), _claimable(now))
        .values(state="training", lease_owner=owner, lease_expires_at=now + lease_seconds, updated_at=now)
        .returning(groups.c.id)
    )
    taken = set(claimed.scalars())
    return [gid for gid in ids if gid in taken]


async def renew_lease(conn: AsyncConnection, group_ids: Sequence[str], owner: str, lease_seconds: float) -> int:
    result = await conn.execute(
        sa.update(groups)
        .where(groups.c.id.in_(group_ids), groups.c.state == "training", groups.c.lease_owner == owner)
        .values(lease_expires_at=time.time() + lease_seconds)
    )
    return result.rowcount


async def release_groups(conn: AsyncConnection, group_ids: Sequence[str], owner: str) -> None:
    """A failed step gives its groups back: ready for the next claim."""
    await conn.execute(
        sa.update(groups)
        .where(groups.c.id.in_(group_ids), groups.c.state == "training", groups.c.lease_owner == owner)
        .values(state="ready", lease_owner=None, lease_expires_at=None, updated_at=time.time())
    )


async def drop_groups(conn: AsyncConnection, group_ids: Sequence[str], owner: str, reason: str) -> None:
    """Claimed groups the trainer will not train (too stale): `failed`, with the reason."""
    await conn.execute(
        sa.update(groups)
        .where(groups.c.id.in_(group_ids), groups.c.state == "training", groups.c.lease_owner == owner)
        .values(state="failed", failure_reason=reason, lease_owner=None, lease_expires_at=None, updated_at=time.time())
    )


async def finish_without_update(conn: AsyncConnection, group_ids: Sequence[str], owner: str, step: int) -> int:
    """Claimed groups with no learning signal (every advantage 0): consumed, trained at the served step."""
    result = await conn.execute(
        sa.update(groups)
        .where(groups.c.id.in_(group_ids), groups.c.state == "training", groups.c.lease_owner == owner)
        .values(state="trained", trained_step=step, lease_owner=None, lease_expires_at=None, updated_at=time.time())
    )
    return result.rowcount
