"""Connecting to the store and migrating it (SQLite by default, PostgreSQL by URL)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy import event
from sqlalchemy.engine import Connection, Dialect, Engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from store.tables import metadata

MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "migrations"


def _json(value: object) -> str:
    return msgspec.json.encode(value).decode()


def _sqlite_pragmas(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:  # sqlite3.Connection (DB-API: untyped)
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()


def _sqlite_path(url: str) -> None:
    path = url.split(":///", 1)[-1]
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)


# How long a store access may wait (for SQLite's write lock, a pooled connection, a PostgreSQL connect) before
# it fails. The async engine serves request handlers, which must answer 503 `store_unavailable` promptly when
# the store is locked or down rather than hang for half a minute; the recorder writes through its own engine
# (create_sync_sqlite_engine) or retries, so it keeps waiting as long as it takes.
STORE_WAIT_SECONDS = 5.0  # the gateway's --store-wait (gateway/settings.py) has the same default
RECORDER_BUSY_TIMEOUT = 30.0


def _connect_errors_as_dbapi_errors(engine: Engine) -> None:
    """asyncpg raises a refused or timed-out connect as a bare OSError / TimeoutError, which SQLAlchemy passes
    on unwrapped; re-raised as the driver's OperationalError, every store outage is one SQLAlchemy error kind."""

    @event.listens_for(engine, "do_connect")
    def _connect(dialect: Dialect, _record: Any, cargs: list[Any], cparams: dict[str, Any]) -> Any:
        try:
            return dialect.loaded_dbapi.connect(*cargs, **cparams)
        except (OSError, TimeoutError) as exc:
            raise dialect.loaded_dbapi.OperationalError(f"cannot connect to the store: {exc!r}") from exc


def keyset_page(
    query: sa.Select[Any],
    key: tuple[sa.ColumnElement[Any], ...],
    after: tuple[Any, ...] | None,
    limit: int,
    newest_first: bool = False,
) -> sa.Select[Any]:
    """`limit` rows of `query` in `key` order (ascending, or descending with `newest_first`), those after
    `after`: the key of the previous page's last row."""
    order = [column.desc() for column in key] if newest_first else list(key)
    query = query.order_by(*order).limit(limit)
    if after is not None:
        row, last = sa.tuple_(*key), sa.tuple_(*after)
        query = query.where(row < last if newest_first else row > last)
    return query


def check_url(url: str) -> None:
    """ValueError (one line, for `--db`) unless `url` names a store this project runs on: SQLite or PostgreSQL."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        backend = make_url(url).get_backend_name()
    except ArgumentError:
        backend = None
    if backend not in ("sqlite", "postgresql", "postgres"):
        shown = url if "@" not in url else url.split("://", 1)[0] + "://..."  # no password in a message
        raise ValueError(
            f"--db {shown!r} is not a store URL: give sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER:PW@HOST/DB"
        )


def create_engine(url: str, *, wait_seconds: float = STORE_WAIT_SECONDS) -> AsyncEngine:
    """An async engine; SQLite gets WAL and a busy timeout, PostgreSQL a pool with pre-ping. A store access
    waits at most about `wait_seconds` for a lock, a connection or a connect, then fails (OperationalError or
    SQLAlchemy's TimeoutError)."""
    if url.startswith("sqlite"):
        _sqlite_path(url)
        engine = create_async_engine(
            url, connect_args={"timeout": wait_seconds}, pool_timeout=wait_seconds, json_serializer=_json
        )
        _sqlite_pragmas(engine.sync_engine)
        return engine
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        url = "postgresql+asyncpg://" + url.split("://", 1)[1]
    engine = create_async_engine(
        url,
        pool_size=10,
        max_overflow=20,
        pool_pre_ping=True,
        pool_timeout=wait_seconds,
        connect_args={"timeout": wait_seconds},  # asyncpg's connect timeout
        json_serializer=_json,
    )
    _connect_errors_as_dbapi_errors(engine.sync_engine)
    return engine


def create_sync_sqlite_engine(url: str) -> Engine | None:
    """For SQLite, a plain sqlite3 engine the recorder drives from one worker thread: a whole batch
    costs one thread hop instead of one per statement (aiosqlite). None for other databases."""
    if not url.startswith("sqlite"):
        return None
    _sqlite_path(url)
    sync_url = url.replace("sqlite+aiosqlite", "sqlite", 1)
    engine = sa_create_engine(
        sync_url, connect_args={"timeout": RECORDER_BUSY_TIMEOUT, "check_same_thread": False}, json_serializer=_json
    )
    _sqlite_pragmas(engine)
    return engine


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def head_revision() -> str:
    """The newest schema revision the migrations define."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def _run(connection: Connection, action: str, revision: str) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    getattr(command, action)(config, revision)


# Any constant: the key of the PostgreSQL advisory lock that serializes migrations.
_MIGRATION_LOCK = 0x41525447  # "ARTG"


def _new_store(connection: Connection) -> bool:
    """True when the store holds none of the schema's tables and no revision: nothing is there to migrate."""
    from alembic.migration import MigrationContext

    if set(sa.inspect(connection).get_table_names()) & set(metadata.tables):
        return False
    return MigrationContext.configure(connection).get_current_revision() is None


def _create_at_head(connection: Connection) -> None:
    metadata.create_all(connection)
    _run(connection, "stamp", "head")


async def migrate(engine: AsyncEngine, revision: str = "head", *, replay: bool = False) -> None:
    """Bring the store to `revision`. A new store taken to head gets the schema at once (tables.py, stamped head:
    alembic's "building an up to date database from scratch"; ~6x less CPU than replaying the migrations at each
    fresh gateway's start: bench/store_start.py) unless `replay`: the migrations then run one by one
    (tests/integration/test_store.py checks that they make exactly tables.py)."""
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Replicas starting together all migrate on start: one runs the migrations, the others wait
            # here until its transaction commits (PostgreSQL's DDL is transactional) and then find the
            # store at head.
            await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
        if revision == "head" and not replay and await conn.run_sync(_new_store):
            await conn.run_sync(_create_at_head)
        else:
            await conn.run_sync(_run, "upgrade", revision)


async def downgrade(engine: AsyncEngine, revision: str) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(_run, "downgrade", revision)
