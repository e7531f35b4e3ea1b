"""Writing and reading recorded calls."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection

from store.access import Grant
from store.codec import CallCache, Head, compact, expand
from store.db import keyset_page
from store.errors import Invalid
from store.records import APIS, CALL_STATUSES, Api, CallRecord, CallStatus, RolloutKey
from store.tables import calls, group_members, rollouts


class RolloutFilter(msgspec.Struct, frozen=True, kw_only=True):
    """Which rollouts a list holds (`/v1/art/rollouts`, the UI's list, an export): each field given narrows it."""

    model: str | None = None
    key_id: str | None = None  # only those made with that API key
    since: float | None = None  # only those whose last call came at or after this time
    status: CallStatus | None = None  # only those with a call that ended so
    api: Api | None = None  # only those with a call of that API
    group_id: str | None = None  # only the members of that group (its store key: store.groups.group_key)

    def __post_init__(self) -> None:
        # msgspec checks a Literal when it decodes, not when a struct is built from a query string's values.
        if self.status is not None and self.status not in CALL_STATUSES:
            raise Invalid(f"'status' must be one of {', '.join(CALL_STATUSES)}.", param="status")
        if self.api is not None and self.api not in APIS:
            raise Invalid(f"'api' must be one of {', '.join(APIS)}.", param="api")


EVERY_ROLLOUT = RolloutFilter()


def _upsert(dialect: str) -> Callable[[sa.Table], postgresql.Insert | sqlite.Insert]:
    return postgresql.insert if dialect == "postgresql" else sqlite.insert


async def write_calls(conn: AsyncConnection, records: Sequence[CallRecord], cache: CallCache | None = None) -> int:
    """`write_calls_sync` on an async connection."""
    return await conn.run_sync(write_calls_sync, records, cache)


def stray_rollout_id(rollout_id: str, model: str | None) -> str:
    """Where a call naming a rollout of another model is kept: `ID@MODEL` (`@` is in no client's rollout id).
    The gateway refuses such calls (409 `rollout_id_taken`); only replicas racing on a new id get here."""
    return f"{rollout_id}@{model or 'base'}"


class RolloutOwner(msgspec.Struct, frozen=True):
    """What a recorded rollout is on: its trainable model and the step that served its first call of it."""

    model: str | None  # None: base calls only so far
    first_step: int | None  # None: its first call of the model is not recorded yet (or had no step)


def _is(key: RolloutKey, owner: sa.ColumnElement[str], rollout_id: sa.ColumnElement[str]) -> sa.ColumnElement[bool]:
    return sa.and_(owner == key.owner, rollout_id == key.id)


# What a recorded rollout is on: its model, then (for a trainable one) the step of its first call of that model.
_ROLLOUT_MODEL = sa.select(rollouts.c.model).where(
    rollouts.c.owner == sa.bindparam("owner"), rollouts.c.id == sa.bindparam("id")
)
_FIRST_STEP = (
    sa.select(calls.c.step)
    .where(
        calls.c.rollout_owner == sa.bindparam("owner"),
        calls.c.rollout_id == sa.bindparam("id"),
        calls.c.model == sa.bindparam("model"),
    )
    .order_by(calls.c.started_at, calls.c.id)
    .limit(1)
)


def _rollouts_in(keys: Iterable[RolloutKey]) -> sa.ColumnElement[bool]:
    """`rollouts` rows of these keys, as each owner's ids: SQLite searches its primary key for that, where a
    row-value IN, `(owner, id) IN (VALUES ...)`, scans the whole table (a write batch's cost grew with the store)."""
    by_owner: dict[str, list[str]] = {}
    for key in sorted(set(keys)):
        by_owner.setdefault(key.owner, []).append(key.id)
    if not by_owner:
        return sa.false()
    return sa.or_(*(sa.and_(rollouts.c.owner == owner, rollouts.c.id.in_(ids)) for owner, ids in by_owner.items()))


async def rollout_owners(conn: AsyncConnection, keys: Sequence[RolloutKey]) -> dict[RolloutKey, RolloutOwner]:
    """What each of these rollouts that is recorded is on (one query for all: a fresh rollout, the usual one, is
    in none; the first step is read for those with a trainable model only)."""
    found = await conn.execute(sa.select(rollouts.c.owner, rollouts.c.id, rollouts.c.model).where(_rollouts_in(keys)))
    owners: dict[RolloutKey, RolloutOwner] = {}
    for row in found.all():
        key = RolloutKey(row.owner, row.id)
        params = {"owner": key.owner, "id": key.id, "model": row.model}
        step = None if row.model is None else (await conn.execute(_FIRST_STEP, params)).scalar()
        owners[key] = RolloutOwner(row.model, step)
    return owners


class SqliteRolloutOwners:
    """`rollout_owners` of a SQLite store, read on the calling thread with the sqlite3 module: a look-up by
    primary key in a local WAL file takes microseconds and never waits for a writer, less than one hop to
    aiosqlite's thread and back. Raises sqlite3.Error (a store being recovered, a file gone): ask the async way."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        named = sqlite.dialect(paramstyle="named")
        model, step = (stmt.compile(dialect=named) for stmt in (_ROLLOUT_MODEL, _FIRST_STEP))
        self._model, self._step = (str(model), model.params), (str(step), step.params)

    @classmethod
    def of(cls, url: str) -> SqliteRolloutOwners | None:
        """For a SQLite store's URL (a file); None for any other store."""
        path = url.split(":///", 1)[-1]
        return cls(path) if url.startswith("sqlite") and path and path != ":memory:" else None

    def __call__(self, key: RolloutKey) -> RolloutOwner | None:
        if self._conn is None:  # read-only, and failing at once rather than waiting on a lock (timeout 0)
            self._conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=0, isolation_level=None)
        (model_sql, model_params), (step_sql, step_params) = self._model, self._step
        params = {**model_params, "owner": key.owner, "id": key.id}
        row = self._conn.execute(model_sql, params).fetchone()
        if row is None:
            return None
        if row[0] is None:
            return RolloutOwner(None, None)
        first = self._conn.execute(step_sql, {**step_params, **params, "model": row[0]}).fetchone()
        return RolloutOwner(row[0], None if first is None else first[0])


def _keep_apart(conn: Connection, records: Sequence[CallRecord]) -> list[CallRecord]:
    """A rollout belongs to the trainable model of its calls (calls of the base model, `model` None, join any):
    a record of another trainable model never joins it (its calls would be read, grouped and trained as the
    other model's) but is kept, under `stray_rollout_id`. (Another key's calls are another owner's rollout.)"""
    keys = {r.rollout_key for r in records}
    found = conn.execute(sa.select(rollouts.c.owner, rollouts.c.id, rollouts.c.model).where(_rollouts_in(keys)))
    models: dict[RolloutKey, str | None] = {RolloutKey(row.owner, row.id): row.model for row in found}
    kept = []
    for record in records:
        key = record.rollout_key
        if key not in models:
            models[key] = record.model
        elif record.model is not None and models[key] is not None and record.model != models[key]:
            record = msgspec.structs.replace(record, rollout_id=stray_rollout_id(record.rollout_id, record.model))
            models.setdefault(record.rollout_key, record.model)
        else:
            models[key] = models[key] or record.model
        kept.append(record)
    return kept


def write_calls_sync(conn: Connection, records: Sequence[CallRecord], cache: CallCache | None = None) -> int:
    """Insert a batch of calls and bump their rollouts, in one transaction. Idempotent per call id.

    With a `cache` (the recorder's), each call is stored against the best of its rollout's last calls in the
    cache or earlier in this batch (store/codec.py); the batch's calls are staged in the cache and become
    bases only when the caller calls `cache.committed()` after the transaction commits. Without one, every
    call is stored whole. Returns how many calls were new (a retried batch whose first attempt did commit
    inserts none).
    """
    # One row per call id (a record queued twice counts once), in the order given: a rollout's calls are
    # compacted against the ones recorded before them.
    unique: dict[str, CallRecord] = {}
    for record in records:
        unique.setdefault(record.call_id, record)
    if cache is not None:
        cache.discard()  # whatever an earlier, failed, transaction staged
    if not unique:
        return 0
    unique = {record.call_id: record for record in _keep_apart(conn, list(unique.values()))}
    heads: dict[RolloutKey, list[Head]] = {}
    rows = []
    for record in unique.values():
        if cache is None:
            row, _ = compact(record, ())
        else:
            candidates = heads.get(record.rollout_key)
            if candidates is None:
                candidates = cache.heads(record.rollout_key)
            row, head = compact(record, candidates)
            # A made-up one-call rollout gets no next call: caching it would only push useful heads out.
            if record.rollout_explicit:
                heads[record.rollout_key] = [*candidates, head][-cache.per_rollout :]
        rows.append(row)
    # Sorted by call id: concurrent writers of the same calls (a replayed spill racing a live recorder) take
    # their locks in one order, no deadlock. References need no order: they are resolved when read.
    rows.sort(key=lambda row: row["id"])
    records = sorted(unique.values(), key=lambda r: r.call_id)
    insert = _upsert(conn.dialect.name)
    result = conn.execute(
        insert(calls).on_conflict_do_nothing(index_elements=["id"]).returning(calls.c.id, calls.c.rollout_id),
        rows,
    )
    new_ids = {row.id for row in result}
    if cache is not None:
        # Calls already in the store (a retried batch) are bases too: a call id is one call, stored once.
        cache.stage(heads)
    if not new_ids:
        return 0
    per_rollout: dict[RolloutKey, dict[str, Any]] = {}
    for record in records:
        if record.call_id not in new_ids:
            continue
        agg = per_rollout.setdefault(
            record.rollout_key,
            {
                "owner": record.rollout_key.owner,
                "id": record.rollout_id,
                "model": record.model,
                "key_id": record.key_id,
                "explicit": record.rollout_explicit,
                "call_count": 0,
                "first_call_at": record.started_at,
                "last_call_at": record.started_at,
            },
        )
        agg["call_count"] += 1
        agg["first_call_at"] = min(agg["first_call_at"], record.started_at)
        agg["last_call_at"] = max(agg["last_call_at"], record.started_at)
        agg["model"] = agg["model"] or record.model
        agg["key_id"] = agg["key_id"] or record.key_id
    stmt = insert(rollouts)
    stmt = stmt.on_conflict_do_update(
        index_elements=["owner", "id"],
        set_={
            "call_count": rollouts.c.call_count + stmt.excluded.call_count,
            "first_call_at": sa.func.min(rollouts.c.first_call_at, stmt.excluded.first_call_at)
            if conn.dialect.name == "sqlite"
            else sa.func.least(rollouts.c.first_call_at, stmt.excluded.first_call_at),
            "last_call_at": sa.func.max(rollouts.c.last_call_at, stmt.excluded.last_call_at)
            if conn.dialect.name == "sqlite"
            else sa.func.greatest(rollouts.c.last_call_at, stmt.excluded.last_call_at),
            "model": sa.func.coalesce(rollouts.c.model, stmt.excluded.model),
            "key_id": sa.func.coalesce(rollouts.c.key_id, stmt.excluded.key_id),
        },
    )
    # Sorted: concurrent writers (several gateway replicas) take row locks in the same order.
    conn.execute(stmt, [per_rollout[key] for key in sorted(per_rollout)])
    return len(new_ids)


async def count_calls(conn: AsyncConnection) -> int:
    return (await conn.execute(sa.select(sa.func.count()).select_from(calls))).scalar_one()


def _plain(row: sa.Row[Any]) -> dict[str, Any]:
    # Column names come back as SQLAlchemy's `quoted_name` (a str subclass msgspec refuses as a key).
    return {str(k): v for k, v in row._asdict().items()}


async def rollout_calls(conn: AsyncConnection, key: RolloutKey) -> list[CallRecord] | None:
    """Every recorded call of a rollout, whole again (store/codec.py), or None if the rollout is unknown."""
    explicit = (
        await conn.execute(sa.select(rollouts.c.explicit).where(_is(key, rollouts.c.owner, rollouts.c.id)))
    ).scalar_one_or_none()
    if explicit is None:
        return None
    return expand(await _rollout_rows(conn, key), explicit)


async def _rollout_rows(conn: AsyncConnection, key: RolloutKey) -> list[dict[str, Any]]:
    """A rollout's rows, by its index (ix_calls_rollout_owner), in the order they began."""
    rows = await conn.execute(
        sa.select(calls)
        .where(_is(key, calls.c.rollout_owner, calls.c.rollout_id))
        .order_by(calls.c.started_at, calls.c.id)
    )
    return [_plain(row) for row in rows]


async def last_chat_call(conn: AsyncConnection, key: RolloutKey) -> CallRecord | None:
    """A rollout's last answered chat call (of its calls answered with choices to a messages list, the last to
    end), whole again, or None: what a call continuing the rollout is spliced onto, read by a gateway that does
    not hold it (gateway/continuation.py). One read, by the rollout's index: its rows hold each call as what it
    adds to an earlier one (store/codec.py), so the rollout's rows are about as large as its last call alone."""
    records = expand(await _rollout_rows(conn, key), explicit=True)
    answered = (r for r in records if r.status == "ok" and r.choices and isinstance(r.request.get("messages"), list))
    return max(answered, key=lambda r: r.ended_at, default=None)


class RolloutRow(msgspec.Struct, frozen=True):
    id: str
    model: str | None
    explicit: bool
    call_count: int
    first_call_at: float
    last_call_at: float
    key_id: str | None = None
    owner: str = ""  # whose namespace its id is in (its `key_id`; "" for none): the admin lists every owner's


async def list_rollouts(
    conn: AsyncConnection,
    where: RolloutFilter = EVERY_ROLLOUT,
    *,
    grant: Grant,
    limit: int = 100,
    after: tuple[float, str] | None = None,
    newest_first: bool = False,
) -> list[RolloutRow]:
    """The rollouts `where` selects of the models `grant` covers and of its owner (every owner's: all), by
    (last_call_at, id), oldest first (`newest_first`: the other way); `after` is the keyset cursor of the
    previous page."""
    key = (rollouts.c.last_call_at, rollouts.c.id)
    query = keyset_page(sa.select(rollouts), key, after, limit, newest_first).where(
        grant.where(rollouts.c.model), grant.where_owner(rollouts.c.owner)
    )
    if where.status is not None or where.api is not None:  # one call must match both
        matching = sa.select(calls.c.rollout_id).where(
            calls.c.rollout_owner == rollouts.c.owner, calls.c.rollout_id == rollouts.c.id
        )
        if where.status is not None:
            matching = matching.where(calls.c.status == where.status)
        if where.api is not None:
            matching = matching.where(calls.c.api == where.api)
        query = query.where(matching.exists())
    if where.group_id is not None:
        members = sa.select(group_members.c.rollout_owner, group_members.c.rollout_id).where(
            group_members.c.group_id == where.group_id
        )
        query = query.where(sa.tuple_(rollouts.c.owner, rollouts.c.id).in_(members))
    if where.model is not None:
        query = query.where(rollouts.c.model == where.model)
    if where.key_id is not None:
        query = query.where(rollouts.c.key_id == where.key_id)
    if where.since is not None:
        query = query.where(rollouts.c.last_call_at >= where.since)
    return [msgspec.convert(_plain(row), RolloutRow) for row in await conn.execute(query)]
