"""The adapter history, and the transaction that makes a trained step count: adapter served + groups trained."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from store.tables import adapters, groups


class AdapterRow(msgspec.Struct, frozen=True):
    model: str
    step: int
    path: str
    status: str
    metrics: dict[str, Any] | None
    error: str | None
    group_count: int
    created_at: float
    served_at: float | None


class LeaseLost(Exception):
    """The groups of a step are no longer claimed by the trainer that trained them."""


def _row(row: sa.Row[Any]) -> AdapterRow:
    return msgspec.convert({str(k): v for k, v in row._asdict().items()}, AdapterRow)


async def _upsert(conn: AsyncConnection, values: dict[str, Any]) -> None:
    key = (adapters.c.model == values["model"]) & (adapters.c.step == values["step"])
    updated = await conn.execute(sa.update(adapters).where(key).values(**values))
    if updated.rowcount == 0:
        await conn.execute(sa.insert(adapters), [values])


async def commit_step(
    conn: AsyncConnection,
    *,
    model: str,
    step: int,
    path: str,
    metrics: dict[str, Any] | None,
    group_ids: Sequence[str],
    lease_owner: str,
) -> None:
    """Record the step as serving and its groups as trained, atomically; LeaseLost if a group is not ours.

    This is the one place a group becomes `trained`: a trainer that dies before it leaves the groups
    claimable again, and the checkpoint it wrote is not a step (resume starts from the last committed one).
    """
    now = time.time()
    if group_ids:
        result = await conn.execute(
            sa.update(groups)
            .where(groups.c.id.in_(group_ids), groups.c.state == "training", groups.c.lease_owner == lease_owner)
            .values(state="trained", trained_step=step, lease_owner=None, lease_expires_at=None, updated_at=now)
        )
        if result.rowcount != len(group_ids):
            raise LeaseLost(f"{len(group_ids) - result.rowcount} of {len(group_ids)} groups are no longer claimed")
    await _upsert(
        conn,
        {
            "model": model,
            "step": step,
            "path": path,
            "status": "loaded",
            "metrics": metrics,
            "error": None,
            "group_count": len(group_ids),
            "created_at": now,
            "served_at": now,
        },
    )


async def record_failure(
    conn: AsyncConnection, *, model: str, step: int, path: str, metrics: dict[str, Any] | None, error: str
) -> None:
    await _upsert(
        conn,
        {
            "model": model,
            "step": step,
            "path": path,
            "status": "failed",
            "metrics": metrics,
            "error": error,
            "group_count": 0,
            "created_at": time.time(),
            "served_at": None,
        },
    )


async def set_status(conn: AsyncConnection, model: str, steps: Sequence[int], status: str) -> None:
    if steps:
        await conn.execute(
            sa.update(adapters).where(adapters.c.model == model, adapters.c.step.in_(steps)).values(status=status)
        )


async def adapter_history(conn: AsyncConnection, model: str, limit: int = 20) -> list[AdapterRow]:
    query = sa.select(adapters).where(adapters.c.model == model).order_by(adapters.c.step.desc()).limit(limit)
    return [_row(r) for r in await conn.execute(query)]


async def loaded_adapters(conn: AsyncConnection) -> list[AdapterRow]:
    """Adapters that should be loaded in the engine, every model, oldest step first."""
    query = sa.select(adapters).where(adapters.c.status == "loaded").order_by(adapters.c.model, adapters.c.step)
    return [_row(r) for r in await conn.execute(query)]


async def last_committed_step(conn: AsyncConnection, model: str) -> AdapterRow | None:
    """The newest step that served (loaded or since unloaded): where a restarted trainer resumes."""
    query = (
        sa.select(adapters)
        .where(adapters.c.model == model, adapters.c.status.in_(("loaded", "unloaded")))
        .order_by(adapters.c.step.desc())
        .limit(1)
    )
    row = (await conn.execute(query)).first()
    return _row(row) if row is not None else None
