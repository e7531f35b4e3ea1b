"""The set of trainable models, kept in the store so every replica (and every restart) serves the same set.

A model is added by `artgw serve --model-name` or `POST /v1/art/models`, and retired by
`DELETE /v1/art/models/{name}`: retired, it is neither served nor trained, and its rollouts, groups and
adapter history stay. Adding it again brings it back with its history.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from store.errors import NotFound
from store.tables import models


class ModelRow(msgspec.Struct, frozen=True):
    name: str
    created_at: float
    retired_at: float | None


async def add_models(conn: AsyncConnection, names: Sequence[str]) -> None:
    """Make these models active: new ones are created, retired ones come back. Idempotent."""
    if not names:
        return
    now = time.time()
    insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    stmt = insert(models).values([{"name": n, "created_at": now, "retired_at": None} for n in sorted(set(names))])
    await conn.execute(stmt.on_conflict_do_update(index_elements=["name"], set_={"retired_at": None}))


async def retire_model(conn: AsyncConnection, name: str) -> None:
    """NotFound if no such model is active."""
    done = await conn.execute(
        sa.update(models).where(models.c.name == name, models.c.retired_at.is_(None)).values(retired_at=time.time())
    )
    if done.rowcount == 0:
        raise NotFound(f"The model `{name}` does not exist", code="model_not_found")


async def active_models(conn: AsyncConnection) -> list[str]:
    query = sa.select(models.c.name).where(models.c.retired_at.is_(None)).order_by(models.c.name)
    return list((await conn.execute(query)).scalars())


async def all_models(conn: AsyncConnection) -> list[ModelRow]:
    rows = await conn.execute(sa.select(models).order_by(models.c.name))
    return [ModelRow(r.name, r.created_at, r.retired_at) for r in rows]
