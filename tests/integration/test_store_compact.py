"""The compact `calls` layout (migration 0004, store/codec.py) on SQLite and PostgreSQL: what goes in through
the writer (with the recorder's cache) comes back out of `rollout_calls` unchanged, and the migration converts
rows written in the 0003 layout and back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from recording.recorder import Recorder
from store import create_engine, downgrade, migrate
from store.calls import rollout_calls, write_calls, write_calls_sync
from store.codec import CallCache, decode_ids
from store.db import create_sync_sqlite_engine
from store.records import CallRecord, RolloutKey
from store.tables import calls
from store.trajectories import assemble
from tests.conftest import conversation


async def write(engine: AsyncEngine, records: list[CallRecord], cache: CallCache | None) -> int:
    async with engine.begin() as conn:
        new = await write_calls(conn, records, cache)
    if cache is not None:
        cache.committed()
    return new


async def read(engine: AsyncEngine, rollout_id: str) -> list[CallRecord] | None:
    async with engine.connect() as conn:
        return await rollout_calls(conn, RolloutKey("", rollout_id))


async def stored(engine: AsyncEngine, rollout_id: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        rows = await conn.execute(sa.select(calls).where(calls.c.rollout_id == rollout_id).order_by(calls.c.id))
        return [{str(k): v for k, v in row._mapping.items()} for row in rows]


def in_order(records: list[CallRecord]) -> list[CallRecord]:
    return sorted(records, key=lambda r: (r.started_at, r.call_id))


def ticks(rollouts: list[list[CallRecord]]) -> list[list[CallRecord]]:
    """Batches as the recorder makes them for agents running side by side: each batch has the next call of
    every rollout still going."""
    longest = max(len(r) for r in rollouts)
    return [[r[k] for r in rollouts if k < len(r)] for k in range(longest)]


# --- writing and reading -----------------------------------------------------------------------------


async def test_a_30_call_rollout_comes_back_exactly_and_is_stored_compactly(engine: AsyncEngine) -> None:
    plain = conversation("plain-30", 30)
    odd = conversation("irregular-30", 30, irregular=True)
    solo = conversation("gw-solo", 1, explicit=False)
    cache = CallCache()
    for batch in ticks([plain, odd, solo]):
        await write(engine, batch, cache)
    assert cache.heads("gw-solo") == []  # a made-up one-call rollout gets no next call: not cached

    for records in (plain, odd, solo):
        back = await read(engine, records[0].rollout_id)
        assert back == in_order(records)
        assert msgspec.json.encode(back) == msgspec.json.encode(in_order(records))  # the very same JSON
        assert msgspec.json.encode(assemble("r", back)) == msgspec.json.encode(assemble("r", records))

    rows = await stored(engine, "plain-30")
    assert [row["base_call_id"] for row in rows] == [None, *(row["id"] for row in rows[:-1])]
    prompt_bytes = sum(len(row["prompt_suffix"]) for row in rows)
    assert prompt_bytes <= 4 * len(plain[-1].prompt_token_ids) + len(rows)  # every prompt token stored once
    assert all(row["request"] is None for row in rows[1:])
    assert all(len(row["messages_suffix"]) <= 2 for row in rows[1:])  # the new tool result (and its call)


async def test_without_a_cache_every_call_is_stored_whole(engine: AsyncEngine) -> None:
    records = conversation("whole", 5)
    await write(engine, records, None)
    rows = await stored(engine, "whole")
    assert all(row["base_call_id"] is None for row in rows)
    assert [decode_ids(row["prompt_suffix"]) for row in rows] == [r.prompt_token_ids for r in records]
    assert await read(engine, "whole") == records


async def test_calls_of_one_batch_are_stored_against_each_other(engine: AsyncEngine) -> None:
    records = conversation("one-batch", 6)
    await write(engine, list(reversed(records[3:])) + records[:3], CallCache())  # any order in the batch
    assert await read(engine, "one-batch") == records


async def test_a_rolled_back_batch_is_never_a_base(engine: AsyncEngine) -> None:
    records = conversation("rolled-back", 4)
    cache = CallCache()
    await write(engine, records[:1], cache)
    async with engine.connect() as conn:
        transaction = await conn.begin()
        await write_calls(conn, records[1:2], cache)  # staged, then the transaction fails
        await transaction.rollback()
    await write(engine, records[2:3], cache)
    rows = {row["id"]: row for row in await stored(engine, "rolled-back")}
    assert rows[records[2].call_id]["base_call_id"] == records[0].call_id
    await write(engine, records[1:2] + records[3:], cache)  # the retry
    assert await read(engine, "rolled-back") == records


async def test_a_retried_batch_and_a_restart_keep_every_call_readable(engine: AsyncEngine) -> None:
    records = conversation("restarts", 8, irregular=True)
    cache = CallCache()
    await write(engine, records[:3], cache)
    assert await write(engine, records[:4], cache) == 1  # a retry whose first attempt had committed
    await write(engine, records[4:6], CallCache())  # a restarted gateway: a cache miss, stored whole
    rows = {row["id"]: row for row in await stored(engine, "restarts")}
    assert rows[records[4].call_id]["base_call_id"] is None
    await write(engine, records[6:], cache)  # a stale cache: bases still in the store, just not the last
    assert await read(engine, "restarts") == in_order(records)


async def test_replicas_with_caches_of_their_own_write_one_rollout(engine: AsyncEngine) -> None:
    """Two gateway replicas take turns at one rollout's calls: each stores against what it has seen."""
    records = conversation("replicas", 12)
    caches = [CallCache(), CallCache()]
    for k, record in enumerate(records):
        await write(engine, [record], caches[(k // 2) % 2])
    rows = {row["id"]: row for row in await stored(engine, "replicas")}
    ids = [r.call_id for r in records]
    assert rows[ids[3]]["base_call_id"] == ids[2] and rows[ids[5]]["base_call_id"] == ids[4]
    assert rows[ids[2]]["base_call_id"] is None and rows[ids[4]]["base_call_id"] == ids[1]
    assert await read(engine, "replicas") == records


async def test_the_recorder_writes_compactly(store_url: str, engine: AsyncEngine, tmp_path: Path) -> None:
    sync_engine = create_sync_sqlite_engine(store_url)  # SQLite: the worker-thread path; PostgreSQL: async
    recorder = Recorder(engine, spill_dir=tmp_path / "spill", sync_engine=sync_engine, linger=0)
    await recorder.start()
    rollouts = [conversation(f"rec-{i}", 10, irregular=i % 2 == 1) for i in range(4)]
    for batch in ticks(rollouts):
        for record in batch:
            recorder.begin(record.rollout_key)
            await recorder.submit(record)
        assert await recorder.settled([r.rollout_key for r in batch], within=30)
    await recorder.close()
    for records in rollouts:
        assert await read(engine, records[0].rollout_id) == in_order(records)
        rows = await stored(engine, records[0].rollout_id)
        assert sum(row["base_call_id"] is not None for row in rows) == len(rows) - 1


# --- the migration -----------------------------------------------------------------------------------

# The calls table as 0003 made it, and its writer (store/calls.py before 0004): every call whole, in JSON.
_calls_0003 = sa.table(
    "calls",
    *(sa.column(name) for name in ("id", "rollout_id", "model", "step", "upstream_model", "status")),
    sa.column("stream", sa.Boolean()),
    *(sa.column(name) for name in ("http_status", "error", "started_at", "first_token_at", "ended_at")),
    *(sa.column(name, sa.JSON()) for name in ("request", "prompt_token_ids", "choices", "usage")),
)


def _write_0003(conn: Connection, records: list[CallRecord]) -> None:
    rows = [msgspec.to_builtins(r) for r in records]
    for row in rows:
        row["id"] = row.pop("call_id")
        row.pop("rollout_explicit")
    conn.execute(sa.insert(_calls_0003), rows)
    per_rollout: dict[str, dict[str, Any]] = {}
    for r in records:
        agg = per_rollout.setdefault(r.rollout_id, {"id": r.rollout_id, "model": r.model, "count": 0, "at": []})
        agg["count"] += 1
        agg["at"].append(r.started_at)
    for agg in per_rollout.values():
        conn.execute(
            sa.text(
                "INSERT INTO rollouts (id, model, explicit, call_count, first_call_at, last_call_at)"
                " VALUES (:id, :model, :explicit, :n, :first, :last)"
            ),
            {"id": agg["id"], "model": agg["model"], "explicit": True, "n": agg["count"]}
            | {"first": min(agg["at"]), "last": max(agg["at"])},
        )


def _read_0003(conn: Connection, rollout_id: str) -> list[CallRecord]:
    rows = conn.execute(
        sa.select(_calls_0003)
        .where(_calls_0003.c.rollout_id == rollout_id)
        .order_by(_calls_0003.c.started_at, _calls_0003.c.id)
    )
    # As the 0003 reader did: the row's JSON as it is, converted.
    plain = [{str(k): v for k, v in row._mapping.items()} for row in rows]
    return [msgspec.convert({**row, "call_id": row["id"], "rollout_explicit": True}, CallRecord) for row in plain]


async def test_migration_converts_0003_rows_and_back(store_url: str) -> None:
    rollouts = {
        "mig-long": conversation("mig-long", 30, irregular=True),
        "mig-plain": conversation("mig-plain", 7),
        "mig-solo": conversation("mig-solo", 1),
    }
    rollouts |= {f"mig-many-{i:03d}": conversation(f"mig-many-{i:03d}", 2, seed=i) for i in range(230)}  # several loads
    engine = create_engine(store_url)
    try:
        await migrate(engine, "0003")
        async with engine.begin() as conn:
            for records in rollouts.values():
                await conn.run_sync(_write_0003, records)

        await migrate(engine, "head")
        for rollout_id, records in rollouts.items():
            back = await read(engine, rollout_id)
            assert back == in_order(records), rollout_id
            assert msgspec.json.encode(back) == msgspec.json.encode(in_order(records))
        rows = await stored(engine, "mig-plain")
        assert sum(row["base_call_id"] is not None for row in rows) == len(rows) - 1
        assert sum(len(row["prompt_suffix"]) for row in rows) <= 4 * len(rollouts["mig-plain"][-1].prompt_token_ids) + 7

        # Calls written after the upgrade, against converted ones, come back through the downgrade too.
        more = conversation("mig-plain", 9)[7:]
        cache = CallCache()
        await write(engine, more, cache)
        rollouts["mig-plain"] += more

        await downgrade(engine, "0003")
        async with engine.connect() as conn:
            for rollout_id, records in rollouts.items():
                back = await conn.run_sync(_read_0003, rollout_id)
                assert back == in_order(records), rollout_id
                assert msgspec.json.encode(back) == msgspec.json.encode(in_order(records))

        await migrate(engine, "head")  # and up again
        for rollout_id, records in rollouts.items():
            assert await read(engine, rollout_id) == in_order(records), rollout_id
    finally:
        await engine.dispose()


async def test_a_chain_of_many_calls_reads_back(engine: AsyncEngine) -> None:
    records = conversation("chain", 300)
    cache = CallCache(per_rollout=1)
    for i in range(0, len(records), 50):
        await write(engine, records[i : i + 50], cache)
    assert await read(engine, "chain") == records
    async with engine.connect() as conn:
        assert await conn.run_sync(lambda c: write_calls_sync(c, [])) == 0
