"""The one place the store's services are built: the gateway's lifespan, the CLI and the trainer all
open the store through `open_store`, and get the same typed services over one engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from store.db import STORE_WAIT_SECONDS, check_url, create_engine, head_revision, migrate
from store.errors import StoreMissing
from store.judge_cache import StoreJudgeCache
from store.rollouts import RolloutReader


def store_url(data_dir: Path, db: str | None) -> str:
    """The store's SQLAlchemy URL: `db` when given (ValueError if it is not one), else SQLite in `data_dir` (as
    `artgw serve` uses)."""
    if db is not None:
        check_url(db)
    return db or f"sqlite+aiosqlite:///{(data_dir / 'artgw.sqlite').resolve()}"


def _where(url: str) -> str:
    return url.split(":///", 1)[-1] if url.startswith("sqlite") else url.rsplit("@", 1)[-1]


@dataclass(frozen=True)
class Store:
    """The store's services over one engine."""

    url: str
    engine: AsyncEngine
    rollouts: RolloutReader
    judge_cache: StoreJudgeCache


async def check_migrated(engine: AsyncEngine, url: str) -> None:
    """StoreMissing unless the store exists and is at the newest schema."""
    try:
        async with engine.connect() as conn:
            version = (await conn.execute(sa.text("SELECT version_num FROM alembic_version"))).scalar_one_or_none()
    except (OperationalError, DBAPIError) as exc:
        if "alembic_version" in str(exc) or "does not exist" in str(exc):
            version = None
        else:
            raise StoreMissing(f"cannot open the store at {_where(url)}: {exc.orig or exc}") from None
    if version is None:
        raise StoreMissing(f"the store at {_where(url)} has no schema: run `artgw migrate` (or start `artgw serve`)")
    head = head_revision()
    if version != head:
        raise StoreMissing(f"the store at {_where(url)} is at schema {version}, not {head}: run `artgw migrate`")


@asynccontextmanager
async def open_store(
    url: str, *, migrate_schema: bool = False, wait_seconds: float = STORE_WAIT_SECONDS
) -> AsyncIterator[Store]:
    """Open the store at `url`. With `migrate_schema` it is created or upgraded; without, it must already
    exist at the newest schema (StoreMissing otherwise, and nothing is created: no empty SQLite file).
    `wait_seconds`: how long a store access waits for a lock or a connection before it fails."""
    if not migrate_schema and url.startswith("sqlite"):
        path = Path(_where(url))
        if not path.is_file():  # noqa: ASYNC240 - one stat, before anything else runs
            raise StoreMissing(
                f"no store at {path}: point --data-dir (ARTGW_DATA_DIR) or --db (ARTGW_DB) at the gateway's store"
            )
    engine = create_engine(url, wait_seconds=wait_seconds)
    try:
        if migrate_schema:
            await migrate(engine)
        else:
            await check_migrated(engine, url)
        yield Store(url=url, engine=engine, rollouts=RolloutReader(engine), judge_cache=StoreJudgeCache(engine))
    finally:
        await engine.dispose()
