"""The store against real databases: SQLite (a temp file) and PostgreSQL (the server `scripts/postgres` runs).

Every test gets an empty database of its own: a fresh SQLite file, or on PostgreSQL a uniquely-named
database created for the test and dropped after it. The PostgreSQL server comes from $ARTGW_TEST_PG_URL, or
else from running `scripts/postgres` (which installs and starts one if needed).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from store import create_engine, downgrade, migrate
from store.access import EVERYTHING, NOTHING, Grant
from store.adapters import adapter_event_history, commit_step, record_failure, set_status
from store.calls import (
    RolloutFilter,
    RolloutOwner,
    count_calls,
    list_rollouts,
    rollout_calls,
    rollout_owners,
    write_calls,
)
from store.codec import CallCache, compact
from store.db import alembic_config
from store.errors import Invalid, NotFound
from store.groups import (
    NewGroup,
    NewMember,
    claim_groups,
    group_key,
    insert_group,
    list_group_ids,
    load_groups,
    renew_lease,
)
from store.records import CallRecord, ChoiceRecord, RolloutKey
from store.responses import ResponseStore, StoredResponse
from store.rollouts import RolloutReader
from store.tables import calls, group_members, groups, metadata, rewards, rollouts
from tests.conftest import make_call

# --- databases ---------------------------------------------------------------------------------------


# --- records -----------------------------------------------------------------------------------------


def call(call_id: str, rollout_id: str, started_at: float, *, model: str | None = "agent", **fields: Any) -> CallRecord:
    """A plain successful call of `agent@3` (tests.conftest.make_call with this module's defaults)."""
    defaults: dict[str, Any] = {
        "step": 3,
        "upstream_model": "agent@3",
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "first_token_at": started_at + 0.125,
    }
    return make_call(call_id, started_at, rollout_id=rollout_id, model=model, **{**defaults, **fields})


async def write(engine: AsyncEngine, records: list[CallRecord], cache: CallCache | None = None) -> int:
    async with engine.begin() as conn:
        new = await write_calls(conn, records, cache)
    if cache is not None:
        cache.committed()
    return new


async def rollout_row(engine: AsyncEngine, rollout_id: str) -> sa.Row:
    async with engine.connect() as conn:
        return (await conn.execute(sa.select(rollouts).where(rollouts.c.id == rollout_id))).one()


async def call_ids(engine: AsyncEngine) -> list[str]:
    async with engine.connect() as conn:
        return list((await conn.execute(sa.select(calls.c.id).order_by(calls.c.id))).scalars())


# --- migrations --------------------------------------------------------------------------------------


def _tables(conn: Connection) -> set[str]:
    return set(sa.inspect(conn).get_table_names()) - {"alembic_version"}


def _current_revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def _drift(conn: Connection) -> list[object]:
    """What differs between the migrated database and tables.py (tables, columns, types, indexes, constraints)."""
    return compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), metadata)


def _schema(conn: Connection) -> dict[str, dict[str, object]]:
    """Each table as the database describes it: columns, keys, indexes, constraints. Column order aside: a
    migration appends a column where tables.py declares it among the others, and the store names every column it
    reads or writes."""
    inspector = sa.inspect(conn)

    columns = inspector.get_columns

    def described(items: list[Any]) -> list[str]:
        return sorted(repr(sorted(item.items())) for item in items)

    return {
        table: {
            "columns": sorted((c["name"], str(c["type"]), c["nullable"], c["default"]) for c in columns(table)),
            "primary_key": inspector.get_pk_constraint(table)["constrained_columns"],
            "indexes": described(inspector.get_indexes(table)),
            "unique": described(inspector.get_unique_constraints(table)),
            "foreign_keys": described(inspector.get_foreign_keys(table)),
            "checks": sorted(" ".join(c["sqltext"].split()) for c in inspector.get_check_constraints(table)),
        }
        for table in sorted(_tables(conn))
    }


DECLARED_ORDER = {name: [column.name for column in table.columns] for name, table in metadata.tables.items()}


def _column_order(conn: Connection) -> dict[str, list[str]]:
    inspector = sa.inspect(conn)
    return {table: [column["name"] for column in inspector.get_columns(table)] for table in _tables(conn)}


async def test_migrations_upgrade_downgrade_upgrade(store_url: str) -> None:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    engine = create_engine(store_url)
    try:
        await migrate(engine, "head", replay=True)
        async with engine.connect() as conn:
            assert await conn.run_sync(_tables) == set(metadata.tables)
            assert await conn.run_sync(_current_revision) == head
            # The migrations make exactly the schema tables.py declares.
            assert await conn.run_sync(_drift) == []
            replayed = await conn.run_sync(_schema)
            assert await conn.run_sync(_column_order) != DECLARED_ORDER  # migrations append the columns they add

        await downgrade(engine, "base")
        async with engine.connect() as conn:
            assert await conn.run_sync(_tables) == set()
            assert await conn.run_sync(_current_revision) is None

        # A new store (as the downgrade left it) taken to head gets the schema at once: the one the migrations made.
        await migrate(engine, "head")
        async with engine.connect() as conn:
            assert await conn.run_sync(_tables) == set(metadata.tables)
            assert await conn.run_sync(_current_revision) == head
            assert await conn.run_sync(_drift) == []
            assert await conn.run_sync(_schema) == replayed
            # Made at once, not replayed: every table has its columns in tables.py's order.
            assert await conn.run_sync(_column_order) == DECLARED_ORDER
        # Upgrading at head is a no-op, and the re-made schema takes writes.
        await migrate(engine, "head")
        assert await write(engine, [call("c1", "r1", 100.0)]) == 1
    finally:
        await engine.dispose()


async def test_migrations_step_by_step(store_url: str) -> None:
    """Every revision upgrades from the one before and downgrades back to it."""
    scripts = ScriptDirectory.from_config(alembic_config())
    revisions = [script.revision for script in reversed(list(scripts.walk_revisions()))]
    engine = create_engine(store_url)
    try:
        seen: list[set[str]] = [set()]
        for revision in revisions:
            await migrate(engine, revision)
            async with engine.connect() as conn:
                assert await conn.run_sync(_current_revision) == revision
                seen.append(await conn.run_sync(_tables))
        for revision, tables in zip(reversed(["base", *revisions[:-1]]), reversed(seen[:-1]), strict=True):
            await downgrade(engine, revision)
            async with engine.connect() as conn:
                assert await conn.run_sync(_tables) == tables, revision
    finally:
        await engine.dispose()


async def test_migration_0012_files_each_rollout_under_its_owner(store_url: str) -> None:
    """Rollouts recorded before rollout ids were per owner (#40) read back under the key of their first call
    ("" for none), with their calls (the admin's call in a key's rollout included), group membership and reward;
    after it, another key's calls naming the same id are a rollout of its own."""
    key_a_call = msgspec.structs.replace(call("m1", "r1", 1.0), key_id="key_a")
    records = [key_a_call, call("m2", "r1", 2.0), call("m3", "r2", 3.0)]  # m2: the admin's, in key_a's rollout
    engine = create_engine(store_url)
    try:
        await migrate(engine, "0011")  # the revision before rollout ids were per owner

        def fill(conn: Connection) -> None:
            old = sa.MetaData()
            table = {name: sa.Table(name, old, autoload_with=conn) for name in ("calls", "rollouts", "groups")}
            table |= {name: sa.Table(name, old, autoload_with=conn) for name in ("group_members", "rewards")}
            rows = [{k: v for k, v in compact(r, ())[0].items() if k != "rollout_owner"} for r in records]
            conn.execute(table["calls"].insert(), rows)
            rollout = {"model": "agent", "explicit": True, "first_call_at": 1.0, "last_call_at": 3.0}
            conn.execute(
                table["rollouts"].insert(),
                [
                    rollout | {"id": "r1", "call_count": 2, "key_id": "key_a"},
                    rollout | {"id": "r2", "call_count": 1, "key_id": None},
                ],
            )
            group = {"model": "agent", "state": "ready", "request_hash": "h", "created_at": 1.0, "updated_at": 1.0}
            conn.execute(table["groups"].insert(), [group | {"id": "g1"}])
            conn.execute(
                table["group_members"].insert(),
                [{"group_id": "g1", "position": 0, "rollout_ref": "r1", "rollout_id": "r1", "reward": 1.0}],
            )
            conn.execute(
                table["rewards"].insert(), [{"rollout_id": "r2", "model": "agent", "reward": 0.5, "created_at": 3.0}]
            )

        async with engine.begin() as conn:
            await conn.run_sync(fill)
        await migrate(engine, "head")
        await write(engine, [msgspec.structs.replace(call("m4", "r1", 4.0), key_id="key_b")])

        async with engine.connect() as conn:
            kept = {
                key: [c.call_id for c in await rollout_calls(conn, key) or []]
                for key in (RolloutKey("key_a", "r1"), RolloutKey("", "r2"), RolloutKey("key_b", "r1"))
            }
            assert await rollout_calls(conn, RolloutKey("", "r1")) is None
            (group,) = await load_groups(conn, [group_key("key_a", "g1")], grant=EVERYTHING)  # 0013: key_a's g1
            assert await load_groups(conn, [group_key("key_a", "g1")], grant=Grant(None, owner="key_b")) == []
            rewarded = (await conn.execute(sa.select(rewards.c.owner, rewards.c.rollout_id))).all()
        assert kept == {
            RolloutKey("key_a", "r1"): ["m1", "m2"],
            RolloutKey("", "r2"): ["m3"],
            RolloutKey("key_b", "r1"): ["m4"],
        }
        assert group.owner == "key_a" and [m.rollout_key for m in group.members] == [RolloutKey("key_a", "r1")]
        assert [tuple(row) for row in rewarded] == [("", "r2")]
    finally:
        await engine.dispose()


async def test_migration_0013_files_each_group_id_under_its_owner(store_url: str) -> None:
    """Groups made before group ids were per owner (#40) read back under their owner's key with their members
    (the admin's keep their ids); after it, two keys' groups may share an id; downgrading gives the ids back."""
    engine = create_engine(store_url)
    try:
        await migrate(engine, "0012")

        def fill(conn: Connection) -> None:
            old = sa.MetaData()
            table = {name: sa.Table(name, old, autoload_with=conn) for name in ("groups", "group_members")}
            group = {"model": "agent", "state": "ready", "request_hash": "h", "created_at": 1.0, "updated_at": 1.0}
            made = [group | {"id": "g1", "owner": "key_a"}, group | {"id": "g2", "owner": ""}]
            conn.execute(table["groups"].insert(), made)
            member = {"position": 0, "reward": 1.0}
            conn.execute(
                table["group_members"].insert(),
                [
                    member | {"group_id": "g1", "rollout_owner": "key_a", "rollout_ref": "r1", "rollout_id": "r1"},
                    member | {"group_id": "g2", "rollout_owner": "", "rollout_ref": "r2", "rollout_id": "r2"},
                ],
            )

        async with engine.begin() as conn:
            await conn.run_sync(fill)
        await migrate(engine, "head")
        longest = "x" * 128  # a client's longest id, under a key's: the widened column holds it
        async with engine.begin() as conn:
            now = {"model": "agent", "state": "ready", "request_hash": "h", "created_at": 2.0, "updated_at": 2.0}
            made = [now | {"id": group_key("key_b", name), "owner": "key_b"} for name in ("g1", longest)]
            await conn.execute(sa.insert(groups), made)
        async with engine.connect() as conn:
            stored = sorted((await conn.execute(sa.select(groups.c.id))).scalars())
            found = await load_groups(conn, ["key_a/g1", "g2"], grant=EVERYTHING)
            assert await load_groups(conn, ["g1"], grant=EVERYTHING) == []
        assert stored == sorted(["key_a/g1", "g2", "key_b/g1", f"key_b/{longest}"])
        assert [(g.id, g.name, [m.rollout_id for m in g.members]) for g in found] == [
            ("key_a/g1", "g1", ["r1"]),
            ("g2", "g2", ["r2"]),
        ]

        async with engine.begin() as conn:
            await conn.execute(sa.delete(groups).where(groups.c.owner == "key_b"))
        await downgrade(engine, "0012")
        async with engine.connect() as conn:
            members = (await conn.execute(sa.text("SELECT group_id, rollout_id FROM group_members"))).all()
        assert sorted(tuple(m) for m in members) == [("g1", "r1"), ("g2", "r2")]
    finally:
        await engine.dispose()


@pytest.mark.postgres
async def test_replicas_migrating_at_once_on_postgresql(pg_database_url: str) -> None:
    """Gateway replicas started together all migrate the empty store: one does, the others wait and find head."""
    engines = [create_engine(pg_database_url) for _ in range(4)]
    try:
        await asyncio.gather(*(migrate(engine) for engine in engines))
        head = ScriptDirectory.from_config(alembic_config()).get_current_head()
        async with engines[0].connect() as conn:
            assert await conn.run_sync(_current_revision) == head
            assert await conn.run_sync(_tables) >= {"calls", "rollouts", "groups", "adapters"}
    finally:
        for engine in engines:
            await engine.dispose()


# --- writing -----------------------------------------------------------------------------------------


async def test_write_calls_is_idempotent_per_call_id(engine: AsyncEngine) -> None:
    batch = [call("c1", "r1", 100.0), call("c2", "r1", 101.0), call("c3", "r2", 102.0)]
    assert await write(engine, batch) == 3
    # The same batch again (a retry whose first attempt did commit): nothing new, nothing counted twice.
    assert await write(engine, batch) == 0
    # A batch mixing written and new calls counts only the new ones.
    assert await write(engine, [call("c2", "r1", 101.0), call("c4", "r1", 103.0)]) == 1

    assert await call_ids(engine) == ["c1", "c2", "c3", "c4"]
    async with engine.connect() as conn:
        assert await count_calls(conn) == 4
    assert (await rollout_row(engine, "r1")).call_count == 3
    assert (await rollout_row(engine, "r2")).call_count == 1


async def test_write_calls_duplicate_within_a_batch_counts_once(engine: AsyncEngine) -> None:
    record = call("c1", "r1", 100.0)
    assert await write(engine, [record, call("c2", "r1", 101.0), record]) == 2
    assert await call_ids(engine) == ["c1", "c2"]
    assert (await rollout_row(engine, "r1")).call_count == 2


async def test_write_calls_empty_batch(engine: AsyncEngine) -> None:
    assert await write(engine, []) == 0
    async with engine.connect() as conn:
        assert await count_calls(conn) == 0


async def test_rollout_counters_across_batches(engine: AsyncEngine) -> None:
    # First batch: base-model calls (model None), out of time order within the batch.
    await write(engine, [call("c1", "r1", 105.0, model=None), call("c2", "r1", 103.0, model=None)])
    row = await rollout_row(engine, "r1")
    assert (row.call_count, row.first_call_at, row.last_call_at, row.model, row.explicit) == (
        2,
        103.0,
        105.0,
        None,
        True,
    )

    # Later: the first trainable-model call fills the model in; an earlier call moves first_call_at back.
    await write(engine, [call("c3", "r1", 101.5, model="agent"), call("c4", "r9", 200.0)])
    row = await rollout_row(engine, "r1")
    assert (row.call_count, row.first_call_at, row.last_call_at, row.model) == (3, 101.5, 105.0, "agent")

    # Once set, the model is kept; last_call_at only moves forward; `explicit` is the first writer's.
    await write(engine, [call("c5", "r1", 110.25, model=None, explicit=False), call("c6", "r1", 104.0)])
    row = await rollout_row(engine, "r1")
    assert (row.call_count, row.first_call_at, row.last_call_at, row.model, row.explicit) == (
        5,
        101.5,
        110.25,
        "agent",
        True,
    )
    # Within one batch the model is coalesced too: the first non-null one.
    await write(engine, [call("c7", "r2", 1.0, model=None), call("c8", "r2", 2.0, model="b"), call("c9", "r2", 3.0)])
    assert (await rollout_row(engine, "r2")).model == "b"
    assert (await rollout_row(engine, "r9")).call_count == 1


async def test_a_call_of_another_model_never_joins_a_rollout(engine: AsyncEngine) -> None:
    """A rollout is its trainable model's: a call of another model naming it (replicas that raced past the
    gateway's 409) is kept apart under `ID@MODEL`, in a later batch or in the same one, and counted there."""
    await write(engine, [call("d1", "shared", 1.0, model="alpha")])
    await write(engine, [call("d2", "shared", 2.0, model="beta"), call("d3", "shared", 3.0, model="alpha")])
    await write(engine, [call("d4", "new", 1.0, model="beta"), call("d5", "new", 2.0, model="alpha")])
    async with engine.connect() as conn:
        owned = {
            rid: [c.call_id for c in await rollout_calls(conn, RolloutKey("", rid)) or []] for rid in ("shared", "new")
        }
        strays = {
            rid: [c.call_id for c in await rollout_calls(conn, RolloutKey("", rid)) or []]
            for rid in ("shared@beta", "new@alpha")
        }
    assert owned == {"shared": ["d1", "d3"], "new": ["d4"]}
    assert strays == {"shared@beta": ["d2"], "new@alpha": ["d5"]}
    rows = {rid: await rollout_row(engine, rid) for rid in ("shared", "shared@beta", "new", "new@alpha")}
    assert {rid: (row.model, row.call_count) for rid, row in rows.items()} == {
        "shared": ("alpha", 2),
        "shared@beta": ("beta", 1),
        "new": ("beta", 1),
        "new@alpha": ("alpha", 1),
    }


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)  # SQLite's query plan
async def test_a_write_batch_finds_its_rollouts_by_key_not_by_a_scan(engine: AsyncEngine) -> None:
    """The recorder's batch reads its rollouts' rows (a rollout is its model's) through the primary key: a row-value
    IN made SQLite scan the whole rollouts table for every batch, a cost that grew with the store. Every query
    the batch (and the rollout look-up) makes is checked with SQLite's own plan."""
    reads: list[tuple[str, Any]] = []

    def seen(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            reads.append((statement, parameters))

    sa.event.listen(engine.sync_engine, "before_cursor_execute", seen)
    try:
        await write(engine, [call("s0", "earlier", 1.0)])
        of_key = msgspec.structs.replace(call("s2", "task", 3.0), key_id="key_a")
        await write(engine, [call("s1", "earlier", 2.0), of_key, call("s3", "fresh", 4.0)])
        async with engine.connect() as conn:
            found = await rollout_owners(conn, [RolloutKey("", "earlier"), RolloutKey("key_a", "task")])
    finally:
        sa.event.remove(engine.sync_engine, "before_cursor_execute", seen)
    assert set(found) == {RolloutKey("", "earlier"), RolloutKey("key_a", "task")}
    on_rollouts = [(sql, args) for sql, args in reads if "FROM rollouts" in sql]
    assert len(on_rollouts) == 3  # each batch's and the look-up's
    async with engine.connect() as conn:
        for sql, args in on_rollouts:
            plan = (await conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, args)).all()
            assert not [step for step in plan if step[-1].startswith("SCAN rollouts")], (sql, plan)


async def test_each_owner_has_rollout_ids_of_its_own(engine: AsyncEngine) -> None:
    """Rollout ids are a namespace per owner (#40): the calls of two keys of the same model, and the admin's (no
    key), naming rollout `task` are three rollouts, each with its own calls, model and pin; a key's id is not
    another's (`rollout_owner` of another owner's id: unknown)."""

    def of(key_id: str | None, call_id: str, at: float, step: int = 3) -> CallRecord:
        return msgspec.structs.replace(call(call_id, "task", at, step=step), key_id=key_id)

    await write(engine, [of("key_a", "k1", 1.0, step=3)])
    await write(engine, [of("key_b", "k2", 2.0, step=5), of(None, "k3", 3.0, step=7), of("key_a", "k4", 4.0)])
    async with engine.connect() as conn:
        kept = {
            owner: [c.call_id for c in await rollout_calls(conn, RolloutKey(owner, "task")) or []]
            for owner in ("key_a", "key_b", "")
        }
        asked = [RolloutKey(owner, "task") for owner in ("key_a", "key_b", "", "key_c")]
        found = await rollout_owners(conn, asked)
        owners = [found.get(key) for key in asked]
        listed = await list_rollouts(conn, grant=EVERYTHING)
    assert kept == {"key_a": ["k1", "k4"], "key_b": ["k2"], "": ["k3"]}
    assert owners == [RolloutOwner("agent", 3), RolloutOwner("agent", 5), RolloutOwner("agent", 7), None]
    assert sorted((r.owner, r.id, r.call_count) for r in listed) == [
        ("", "task", 1),
        ("key_a", "task", 2),
        ("key_b", "task", 1),
    ]


@pytest.mark.parametrize("cached", [False, True], ids=["whole", "compact"])
async def test_rollout_calls_round_trip_exactly(engine: AsyncEngine, cached: bool) -> None:
    tool_call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "search", "arguments": '{"q": "naïve \\"quoted\\"", "n": 3}'},
    }
    rich = call(
        "c-rich",
        "r-explicit",
        1_732_240_000.123456,
        request={
            "model": "agent",
            "messages": [
                {"role": "system", "content": 'Ünïcødé ✓ — 漢字 \U0001f600 \\ " \n\t'},
                {"role": "user", "content": [{"type": "text", "text": "part"}]},
            ],
            "temperature": 0.7,
            "tools": [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}],
            "extra_body": {"nested": {"z": 1, "a": [None, True, 1e-300]}},
        },
        stream=True,
        prompt_token_ids=[151_643, 0, 2**31 - 1, 42],
        choices=[
            ChoiceRecord(
                index=0,
                message={"role": "assistant", "content": None, "tool_calls": [tool_call]},
                finish_reason="tool_calls",
                token_ids=[151_645, 13, 0],
                logprobs=[-0.1234567890123456789, -1e-12, -23.456789012345678],
            ),
            ChoiceRecord(
                index=1,
                message={"role": "assistant", "content": "", "reasoning_content": "hmm"},
                finish_reason="length",
                token_ids=[],
                logprobs=[],
            ),
        ],
        usage={"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7, "prompt_tokens_details": None},
        first_token_at=1_732_240_000.2,
        ended_at=1_732_240_001.987654321,
        engine="http://127.0.0.1:8001",  # the engine that served it (one gateway, several engines)
        continued="render_failed",  # how it was served where it continued its rollout
    )
    plain = call("c-plain", "r-explicit", 1_732_240_002.5, step=0, engine="http://10.0.0.2:8000")
    failed = call(
        "c-failed",
        "r-explicit",
        1_732_240_002.5,  # same started_at as c-plain: ordered by id then
        status="upstream_error",
        http_status=502,
        error="engine said: 'boom'",
        choices=[],
        usage=None,
        first_token_at=None,
        step=None,
        model=None,
    )
    implicit = call("c-solo", "gw-solo", 5.0, explicit=False, status="cancelled", http_status=499)
    # With the recorder's cache, calls are stored against earlier ones of their rollout (store/codec.py).
    cache = CallCache() if cached else None
    await write(engine, [plain, implicit, rich], cache)
    await write(engine, [failed], cache)

    async with engine.connect() as conn:
        assert await rollout_calls(conn, RolloutKey("", "r-explicit")) == [rich, failed, plain]
        assert await rollout_calls(conn, RolloutKey("", "gw-solo")) == [implicit]
        assert await rollout_calls(conn, RolloutKey("", "unknown")) is None


async def _all_pages(
    engine: AsyncEngine,
    *,
    limit: int,
    model: str | None = None,
    since: float | None = None,
    newest_first: bool = False,
) -> list[list[str]]:
    pages: list[list[str]] = []
    after: tuple[float, str] | None = None
    where = RolloutFilter(model=model, since=since)
    async with engine.connect() as conn:
        while True:
            page = await list_rollouts(
                conn, where, grant=EVERYTHING, limit=limit, after=after, newest_first=newest_first
            )
            if not page:
                return pages
            assert len(page) <= limit
            pages.append([r.id for r in page])
            after = (page[-1].last_call_at, page[-1].id)


async def test_list_rollouts_keyset_pagination(engine: AsyncEngine) -> None:
    rng = random.Random(7)
    # 40 rollouts over 3 models; many share a last_call_at, so the id breaks ties across page boundaries.
    expected: dict[str, tuple[float, str | None]] = {}
    records = []
    for i in range(40):
        rollout_id = f"r{rng.randrange(10**6):06d}-{i:02d}"
        model = ["a", "b", None][i % 3]
        last = 1000.0 + (i % 7) * 0.5
        expected[rollout_id] = (last, model)
        records += [
            call(f"{rollout_id}-0", rollout_id, last - 3, model=model),
            call(f"{rollout_id}-1", rollout_id, last, model=model),
        ]
    rng.shuffle(records)
    for i in range(0, len(records), 9):
        await write(engine, records[i : i + 9])

    def ordered(model: str | None, since: float | None) -> list[str]:
        keep = [
            (last, rid)
            for rid, (last, m) in expected.items()
            if (model is None or m == model) and (since is None or last >= since)
        ]
        return [rid for _, rid in sorted(keep)]

    for model, since in [(None, None), ("a", None), (None, 1001.5), ("b", 1001.0), ("nobody", None), (None, 9e9)]:
        want = ordered(model, since)
        for limit in (1, 4, 7, 100):
            pages = await _all_pages(engine, limit=limit, model=model, since=since)
            got = [rid for page in pages for rid in page]
            assert got == want, (model, since, limit)  # every rollout once, in (last_call_at, id) order
            assert all(len(page) == limit for page in pages[:-1])
            newest = await _all_pages(engine, limit=limit, model=model, since=since, newest_first=True)
            assert [rid for page in newest for rid in page] == want[::-1], (model, since, limit)  # the UI's order

    async with engine.connect() as conn:
        first = (await list_rollouts(conn, grant=EVERYTHING, limit=1))[0]
    assert (first.last_call_at, first.call_count, first.first_call_at) == (1000.0, 2, 997.0)


async def test_list_rollouts_by_call_status_api_and_group(engine: AsyncEngine) -> None:
    """`status` and `api`: rollouts with a call that ended so, or of that API; `group_id`: that group's members."""
    await write(
        engine,
        [
            call("ok-chat", "r-ok", 10.0),
            call("failed-chat", "r-mixed", 11.0, status="upstream_error", http_status=502),
            call("ok-messages", "r-mixed", 12.0, api="messages"),
            call("cancelled", "r-cancelled", 13.0, status="cancelled", http_status=499, api="responses"),
        ],
    )
    async with engine.begin() as conn:
        await conn.execute(
            sa.insert(groups).values(
                id="g", model="agent", state="ready", request_hash="h", created_at=1.0, updated_at=1.0
            )
        )
        await conn.execute(
            sa.insert(group_members),
            [
                {"group_id": "g", "position": 0, "rollout_ref": "r-ok", "rollout_id": "r-ok", "reward": 1.0},
                {
                    "group_id": "g",
                    "position": 1,
                    "rollout_ref": "r-cancelled",
                    "rollout_id": "r-cancelled",
                    "reward": 0.0,
                },
            ],
        )
    reader = RolloutReader(engine)

    async def ids(**filters: Any) -> list[str]:
        page = await reader.page(RolloutFilter(**filters), grant=EVERYTHING, limit=100, cursor=None)
        return [r.id for r in page.data]

    assert await ids() == ["r-ok", "r-mixed", "r-cancelled"]
    assert await ids(status="ok") == ["r-ok", "r-mixed"]
    assert await ids(status="upstream_error") == ["r-mixed"]
    assert await ids(status="client_error") == []
    assert await ids(api="messages") == ["r-mixed"]
    assert await ids(api="responses", status="cancelled") == ["r-cancelled"]
    assert await ids(api="responses", status="ok") == []  # one call must match both
    assert await ids(group_id="g") == ["r-ok", "r-cancelled"]
    assert await ids(group_id="g", status="ok") == ["r-ok"]
    assert await ids(group_id="nope") == []
    with pytest.raises(Invalid, match="'status' must be one of ok, cancelled"):
        await ids(status="fine")
    with pytest.raises(Invalid, match="'api' must be one of chat, completions"):
        await ids(api="grpc")


async def test_every_read_of_recorded_data_sees_only_what_its_grant_covers(engine: AsyncEngine) -> None:
    """Deny by default (store/access.py): rollouts, their pages and exports, groups and stored responses of a
    model the grant does not cover read as if they did not exist; without a grant (`NOTHING`) nothing of any
    model is there, base-model calls included."""
    await write(
        engine, [call("a1", "r-a", 1.0), call("b1", "r-b", 2.0, model="other"), call("c1", "r-c", 3.0, model=None)]
    )
    async with engine.begin() as conn:
        await conn.execute(
            sa.insert(groups),
            [
                {"id": g, "model": m, "state": "ready", "request_hash": "h", "created_at": at, "updated_at": at}
                for g, m, at in (("g-a", "agent", 1.0), ("g-b", "other", 2.0))
            ],
        )
    responses = ResponseStore(engine)
    for rid, model in (("resp-a", "agent@3"), ("resp-b", "other")):
        await responses.save(StoredResponse(rid, "r-a", model, {"id": rid}, [], [], 1.0, None))
    reader = RolloutReader(engine)

    async def seen(grant: Grant) -> dict[str, list[str]]:
        async with engine.connect() as conn:
            listed = [r.id for r in await list_rollouts(conn, grant=grant)]
            keys = await list_group_ids(conn, model=None, state=None, limit=10, after=None, grant=grant)
            loaded = [g.id for g in await load_groups(conn, ["g-a", "g-b"], grant=grant)]
        found = [r for r in ("r-a", "r-b", "r-c") if await reader.find(r, owner="", grant=grant) is not None]
        paged = [r.id for r in (await reader.page(RolloutFilter(), grant=grant, limit=10, cursor=None)).data]
        exported = [t.rollout_id async for t in reader.export(RolloutFilter(), grant=grant)]
        stored = []
        for rid in ("resp-a", "resp-b"):
            try:
                stored.append((await responses.get(rid, grant=grant, api="responses")).id)
            except NotFound:
                pass
        return {
            "rollouts": listed,
            "found": found,
            "paged": paged,
            "exported": exported,
            "groups": [gid for _, gid in keys],
            "loaded": loaded,
            "responses": stored,
        }

    nothing = await seen(NOTHING)
    assert list(nothing) == ["rollouts", "found", "paged", "exported", "groups", "loaded", "responses"]
    assert all(seen_ == [] for seen_ in nothing.values())
    assert await seen(Grant(frozenset({"agent"}))) == {
        "rollouts": ["r-a"],
        "found": ["r-a"],
        "paged": ["r-a"],
        "exported": ["r-a"],
        "groups": ["g-a"],
        "loaded": ["g-a"],
        "responses": ["resp-a"],  # a pinned step's response (`agent@3`) is the model's
    }
    everything = await seen(EVERYTHING)
    assert everything["found"] == ["r-a", "r-b", "r-c"] and everything["responses"] == ["resp-a", "resp-b"]
    assert everything["groups"] == ["g-a", "g-b"] and sorted(everything["exported"]) == ["r-a", "r-b", "r-c"]
    with pytest.raises(NotFound):
        await reader.get("r-b", owner="", grant=Grant(frozenset({"agent"})))


async def test_list_group_ids_pages_both_ways(engine: AsyncEngine) -> None:
    """Keyset pages of groups, oldest first and newest first (the UI's list): every group once, ties in time
    broken by id, the filters kept from page to page."""
    rows = [("g-a", "agent", 1.0), ("g-b", "agent", 2.0), ("g-c", "agent", 2.0), ("g-d", "other", 3.0)]
    rows += [("g-e", "agent", 4.0), ("g-f", "agent", 5.0)]
    async with engine.begin() as conn:
        await conn.execute(
            sa.insert(groups),
            [
                {"id": i, "model": m, "state": "ready", "request_hash": "h", "created_at": at, "updated_at": at}
                for i, m, at in rows
            ],
        )

    async def pages(size: int, grant: Grant = EVERYTHING, **filters: Any) -> list[list[str]]:
        found, after = [], None
        while True:
            async with engine.connect() as conn:
                keys = await list_group_ids(conn, state=None, limit=size, after=after, grant=grant, **filters)
            if not keys:
                return found
            found.append([group_id for _, group_id in keys])
            after = keys[-1]

    assert await pages(2, model="agent") == [["g-a", "g-b"], ["g-c", "g-e"], ["g-f"]]
    assert await pages(2, model="agent", newest_first=True) == [["g-f", "g-e"], ["g-c", "g-b"], ["g-a"]]
    assert await pages(4, model=None, newest_first=True) == [["g-f", "g-e", "g-d", "g-c"], ["g-b", "g-a"]]
    assert await pages(1, model=None, grant=Grant(frozenset({"other"})), newest_first=True) == [["g-d"]]


async def test_a_lease_holds_until_it_expires_on_the_claimers_clock(engine: AsyncEngine) -> None:
    """Leases read the `now` each trainer gives the store (its clock): a claim holds until `now + lease`, a
    renewal moves that on, and past it another trainer takes the group over and the first one's renewal fails."""
    row = {"model": "agent", "state": "ready", "request_hash": "h", "created_at": 1.0, "updated_at": 1.0}
    async with engine.begin() as conn:
        await conn.execute(sa.insert(groups), [{"id": "g-1", **row}, {"id": "g-2", **row}])

    async def claim(owner: str, now: float) -> list[str]:
        async with engine.begin() as conn:
            return await claim_groups(conn, model="agent", owner=owner, lease_seconds=10, limit=1, now=now)

    async def renew(owner: str, now: float) -> int:
        async with engine.begin() as conn:
            return await renew_lease(conn, ["g-1"], owner, 10, now=now)

    assert await claim("one", now=100.0) == ["g-1"]  # oldest first, one at a time
    assert await claim("two", now=109.0) == ["g-2"]  # g-1 is held until 110
    assert await claim("three", now=109.9) == []
    assert await renew("one", now=109.0) == 1  # held until 119 now
    assert await claim("three", now=118.9) == []
    assert await claim("three", now=119.5) == ["g-1"]  # its lease ran out: taken over
    assert await renew("one", now=119.6) == 0  # the first trainer lost it
    assert await renew("three", now=119.6) == 1


async def test_two_owners_groups_of_one_id_are_claimed_and_trained_apart(engine: AsyncEngine) -> None:
    """Group ids are per owner (#40): two keys' `g1` and the admin's are three groups that the trainer claims,
    reads and commits by their store keys, each with its own members; a key's grant reads only its own."""
    keys = [group_key(owner, "g1") for owner in ("key_a", "key_b", "")]
    async with engine.begin() as conn:
        for at, (key, owner) in enumerate(zip(keys, ("key_a", "key_b", ""), strict=True)):
            member = NewMember(0, "r1", "r1", None, float(at), float(at), None)
            await insert_group(conn, NewGroup(key, "agent", "ready", "h", None, None, False, [member], owner))
    async with engine.begin() as conn:
        claimed = await claim_groups(conn, model="agent", owner="trainer", lease_seconds=60, limit=10, now=1e12)
        rows = await load_groups(conn, claimed, grant=EVERYTHING)  # the trainer reads every owner's
        await commit_step(
            conn, model="agent", step=1, path="/a/1", metrics=None, group_ids=claimed, lease_owner="trainer"
        )
    assert sorted(claimed) == sorted(["key_a/g1", "key_b/g1", "g1"])
    assert sorted((g.owner, g.name, g.members[0].reward) for g in rows) == [
        ("", "g1", 2.0),
        ("key_a", "g1", 0.0),
        ("key_b", "g1", 1.0),
    ]
    async with engine.connect() as conn:
        trained = await load_groups(conn, keys, grant=EVERYTHING)
        own = await load_groups(conn, keys, grant=Grant(None, owner="key_b"))
    assert [(g.state, g.trained_step) for g in trained] == [("trained", 1)] * 3
    assert [g.id for g in own] == ["key_b/g1"]


async def test_adapter_history_records_loads_unloads_and_refusals(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        for step in (1, 2):
            await commit_step(conn, model="m", step=step, path=f"/a/{step}", metrics=None, group_ids=[], lease_owner="")
        await record_failure(conn, model="m", step=3, path="/a/3", metrics=None, error="engine said no")
        await set_status(conn, "m", [1], "unloaded", "older than the newest 1")
        await set_status(conn, "m", [1], "loaded", "loaded again to be promoted")
        history = await adapter_event_history(conn, "m")
        other = await adapter_event_history(conn, "nobody")
    assert [(e.event, e.step, e.detail) for e in history] == [
        ("loaded", 1, "loaded again to be promoted"),
        ("unloaded", 1, "older than the newest 1"),
        ("load_failed", 3, "engine said no"),
        ("loaded", 2, "step 2, 0 groups"),
        ("loaded", 1, "step 1, 0 groups"),
    ]
    assert all(e.model == "m" for e in history) and other == []
    assert history[0].at >= history[-1].at


# --- concurrency -------------------------------------------------------------------------------------


async def test_concurrent_writers_exact_counts(engine: AsyncEngine) -> None:
    """8 writers on their own connections, every batch touching the same rollouts in a different order.

    Also two writers at a time write the same calls (a replayed spill racing the live recorder), in
    different orders. Lost updates, double counts or deadlocks would show as wrong counts or errors.
    """
    writers, batches, per_batch = 8, 12, 10
    rollout_ids = [f"shared-{k}" for k in range(6)]
    start = asyncio.Barrier(writers)

    def batch(writer: int, b: int) -> list[CallRecord]:
        owner = writer // 2  # writers 2k and 2k+1 write the same calls
        rng = random.Random(writer * 1000 + b)
        records = [
            call(
                f"w{owner}-b{b}-{j}",
                rollout_ids[(owner + b + j) % len(rollout_ids)],
                1000.0 + owner * 100 + b + j / 100,
                model=None if j == 0 else "m",  # one model: the rollouts are shared, not taken
            )
            for j in range(per_batch)
        ]
        rng.shuffle(records)
        return records

    async def writer(w: int) -> int:
        await start.wait()
        new = 0
        for b in range(batches):
            async with engine.begin() as conn:
                new += await write_calls(conn, batch(w, b))
            await asyncio.sleep(0)
        return new

    new_counts = await asyncio.wait_for(asyncio.gather(*(writer(w) for w in range(writers))), 120)

    written = {r.call_id: r for w in range(0, writers, 2) for b in range(batches) for r in batch(w, b)}
    assert sum(new_counts) == len(written) == writers // 2 * batches * per_batch
    assert await call_ids(engine) == sorted(written)
    for rollout_id in rollout_ids:
        mine = [r for r in written.values() if r.rollout_id == rollout_id]
        row = await rollout_row(engine, rollout_id)
        assert row.call_count == len(mine), rollout_id
        assert row.first_call_at == min(r.started_at for r in mine)
        assert row.last_call_at == max(r.started_at for r in mine)
        assert row.model is not None
