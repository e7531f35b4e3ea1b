"""The adapter history, and the transaction that makes a trained step count: adapter served + groups trained."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from store.groups import mark_trained
from store.tables import adapter_events, adapters
from store.types import AdapterEventKind, AdapterStatus, StepMetrics

_COMMITTED: tuple[AdapterStatus, ...] = ("loaded", "unloaded")  # steps that served


class AdapterRow(msgspec.Struct, frozen=True):
    model: str
    step: int
    path: str
    status: AdapterStatus
    metrics: StepMetrics | None
    error: str | None
    group_count: int
    created_at: float
    served_at: float | None


class AdapterEvent(msgspec.Struct, frozen=True):
    """An adapter loaded into the engine, unloaded from it, or refused by it."""

    model: str
    step: int
    event: AdapterEventKind
    detail: str | None
    at: float


async def record_events(
    conn: AsyncConnection, model: str, steps: Sequence[int], event: AdapterEventKind, detail: str | None = None
) -> None:
    if steps:
        now = time.time()
        rows = [{"model": model, "step": s, "event": event, "detail": detail, "at": now} for s in steps]
        await conn.execute(sa.insert(adapter_events), rows)


async def adapter_event_history(conn: AsyncConnection, model: str, limit: int = 50) -> list[AdapterEvent]:
    """Newest first."""
    query = (
        sa.select(adapter_events.c.model, adapter_events.c.step, adapter_events.c.event, adapter_events.c.detail)
        .add_columns(adapter_events.c.at)
        .where(adapter_events.c.model == model)
        .order_by(adapter_events.c.id.desc())
        .limit(limit)
    )
    return [AdapterEvent(*row) for row in await conn.execute(query)]


def _row(row: sa.Row[Any]) -> AdapterRow:
    return msgspec.convert({str(k): v for k, v in row._asdict().items()}, AdapterRow)


async def _upsert(conn: AsyncConnection, values: dict[str, Any]) -> None:
    # ON CONFLICT: two replicas recording the same step at once must not fail on the primary key.
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    stmt = insert(adapters).values(**values)
    update = {k: stmt.excluded[k] for k in values if k not in ("model", "step")}
    await conn.execute(stmt.on_conflict_do_update(index_elements=["model", "step"], set_=update))


def _metrics(metrics: StepMetrics | None) -> dict[str, Any] | None:
    return msgspec.to_builtins(metrics) if metrics is not None else None


async def commit_step(
    conn: AsyncConnection,
    *,
    model: str,
    step: int,
    path: str,
    metrics: StepMetrics | None,
    group_ids: Sequence[str],
    lease_owner: str,
) -> None:
    """Record the step as serving and its groups as trained, atomically; LeaseLost if a group is not ours.

    This is the one place a group becomes `trained` by a step: a trainer that dies before it leaves the
    groups claimable again, and the checkpoint it wrote is not a step (resume starts from the last
    committed one).
    """
    now = time.time()
    await mark_trained(conn, group_ids, lease_owner, step)
    await record_events(conn, model, [step], "loaded", f"step {step}, {len(group_ids)} groups")
    await _upsert(
        conn,
        {
            "model": model,
            "step": step,
            "path": path,
            "status": "loaded",
            "metrics": _metrics(metrics),
            "error": None,
            "group_count": len(group_ids),
            "created_at": now,
            "served_at": now,
        },
    )


async def record_failure(
    conn: AsyncConnection, *, model: str, step: int, path: str, metrics: StepMetrics | None, error: str
) -> None:
    await _upsert(
        conn,
        {
            "model": model,
            "step": step,
            "path": path,
            "status": "failed",
            "metrics": _metrics(metrics),
            "error": error,
            "group_count": 0,
            "created_at": time.time(),
            "served_at": None,
        },
    )
    await record_events(conn, model, [step], "load_failed", error[:2000])


async def set_status(
    conn: AsyncConnection, model: str, steps: Sequence[int], status: AdapterStatus, detail: str | None = None
) -> None:
    """The steps' status, and the load or unload in their history."""
    if steps:
        await conn.execute(
            sa.update(adapters).where(adapters.c.model == model, adapters.c.step.in_(steps)).values(status=status)
        )
        if status in ("loaded", "unloaded"):
            await record_events(conn, model, steps, status, detail)
        elif status == "broken":
            await record_events(conn, model, steps, "load_failed", detail)


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
        .where(adapters.c.model == model, adapters.c.status.in_(_COMMITTED))
        .order_by(adapters.c.step.desc())
        .limit(1)
    )
    row = (await conn.execute(query)).first()
    return _row(row) if row is not None else None


async def committed_steps(conn: AsyncConnection, model: str) -> list[AdapterRow]:
    """Every step that served (loaded or since unloaded), newest first: where a trainer may resume."""
    query = (
        sa.select(adapters)
        .where(adapters.c.model == model, adapters.c.status.in_(_COMMITTED))
        .order_by(adapters.c.step.desc())
    )
    return [_row(r) for r in await conn.execute(query)]


async def committed_step(conn: AsyncConnection, model: str, step: int) -> AdapterRow | None:
    """That step, if it ever served (loaded or since unloaded): what may be promoted again."""
    query = sa.select(adapters).where(
        adapters.c.model == model, adapters.c.step == step, adapters.c.status.in_(_COMMITTED)
    )
    row = (await conn.execute(query)).first()
    return _row(row) if row is not None else None


class TrainerSummary(msgspec.Struct, frozen=True):
    """What `/metrics` shows of a model's training: committed steps and the newest one's metrics."""

    committed_steps: int
    last: StepMetrics


async def trainer_summaries(conn: AsyncConnection) -> dict[str, TrainerSummary]:
    """Per model: how many steps served, and the metrics of the newest."""
    committed = adapters.c.status.in_(_COMMITTED)
    counts: dict[str, int] = dict(
        (await conn.execute(sa.select(adapters.c.model, sa.func.count()).where(committed).group_by(adapters.c.model)))
        .tuples()
        .all()
    )
    newest = (
        sa.select(adapters.c.model, sa.func.max(adapters.c.step).label("step"))
        .where(committed)
        .group_by(adapters.c.model)
        .subquery()
    )
    rows = await conn.execute(
        sa.select(adapters.c.model, adapters.c.metrics).join(
            newest, (adapters.c.model == newest.c.model) & (adapters.c.step == newest.c.step)
        )
    )
    return {
        model: TrainerSummary(counts.get(model, 0), msgspec.convert(metrics or {}, StepMetrics))
        for model, metrics in rows
    }
