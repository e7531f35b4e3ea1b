"""The recorder against a real SQLite store that misbehaves: slow, failing, gone at shutdown.

A call the client got an answer for must reach the store, whatever the store did meanwhile: a stalled store
costs journal, not memory; a record the store refuses is set aside and holds nothing up."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from pathlib import Path

import msgspec
import sqlalchemy as sa

from recording.recorder import Recorder, refused
from store import create_engine, migrate
from store.db import create_sync_sqlite_engine
from store.records import CallRecord
from store.tables import calls
from tests.conftest import apoll, make_call


def record(rollout: str) -> CallRecord:
    return make_call(uuid.uuid4().hex, time.time(), rollout_id=rollout)


def count(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM calls").fetchone()[0]


async def make(db: Path, **kwargs) -> tuple[Recorder, object]:
    url = f"sqlite+aiosqlite:///{db}"
    engine = create_engine(url)
    await migrate(engine)
    recorder = Recorder(engine, data_dir=db.parent, sync_engine=create_sync_sqlite_engine(url), **kwargs)
    await recorder.start()
    return recorder, engine


async def test_slow_store_is_absorbed_by_the_queue(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite"
    recorder, engine = await make(db)
    holder = sqlite3.connect(db, timeout=30, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")  # the store stalls: every write waits on this lock

    async def submit_all() -> None:
        for i in range(500):
            await recorder.submit(record(f"slow-{i % 7}"))

    # Never on the client's path: every submit returns while the store is still locked (one that waited for the
    # store would wait for ever: the lock is released only after them).
    await asyncio.wait_for(submit_all(), 120)
    assert count(db) == 0  # WAL: readers pass the writer's lock
    holder.rollback()
    await recorder.close()
    holder.close()
    assert count(db) == 500
    await engine.dispose()


async def test_failing_store_is_retried_until_it_recovers(tmp_path: Path) -> None:
    db = tmp_path / "f.sqlite"
    recorder, engine = await make(db, max_backoff=0.2)
    async with engine.begin() as conn:
        await conn.execute(sa.text("ALTER TABLE calls RENAME TO calls_away"))  # every insert now fails
    for i in range(50):
        await recorder.submit(record(f"fail-{i}"))
    await apoll(lambda: recorder.retries >= 2, 60, "two retries of the failing store")
    assert recorder.written == 0
    async with engine.begin() as conn:
        await conn.execute(sa.text("ALTER TABLE calls_away RENAME TO calls"))  # the store is back
    await recorder.close()
    assert count(db) == 50 and recorder.rejected == 0
    await engine.dispose()


async def test_store_gone_at_shutdown_keeps_the_journal_and_the_next_start_replays(tmp_path: Path) -> None:
    db = tmp_path / "g.sqlite"
    recorder, engine = await make(db, shutdown_timeout=0.5, max_backoff=0.1)
    async with engine.begin() as conn:
        await conn.execute(sa.text("ALTER TABLE calls RENAME TO calls_away"))
    submitted = [record("spill") for _ in range(20)]
    for r in submitted:
        await recorder.submit(r)
    await recorder.close()  # the store never came back: the records stay in the journal
    assert recorder.rejected == 0  # the store was away: nothing is set aside for that
    assert list((tmp_path / "journal").glob("seg-*.log"))
    async with engine.begin() as conn:
        await conn.execute(sa.text("ALTER TABLE calls_away RENAME TO calls"))
    await engine.dispose()

    again, engine = await make(db)  # a new start replays the journal, then deletes it
    await again.close()
    with sqlite3.connect(db) as conn:
        ids = {row[0] for row in conn.execute(sa.select(calls.c.id).compile().string)}
    assert ids == {r.call_id for r in submitted}
    assert not list((tmp_path / "journal").glob("seg-*.log"))
    await engine.dispose()


async def test_spill_files_of_older_versions_are_replayed_once(tmp_path: Path) -> None:
    db = tmp_path / "u.sqlite"
    spilled = [record("old-spill") for _ in range(7)]
    (tmp_path / "spill").mkdir()
    (tmp_path / "spill" / "unrecorded-1.jsonl").write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in spilled))
    recorder, engine = await make(db)
    await recorder.close()
    assert count(db) == 7
    assert not list((tmp_path / "spill").glob("unrecorded-*.jsonl"))
    await engine.dispose()


async def test_a_record_the_store_refuses_is_set_aside_and_blocks_nothing(tmp_path: Path) -> None:
    db = tmp_path / "p.sqlite"
    recorder, engine = await make(db, max_backoff=0.05, max_attempts=3, linger=0.2)
    async with engine.begin() as conn:  # the store refuses one rollout's calls (a constraint error)
        await conn.execute(
            sa.text(
                "CREATE TRIGGER refuse BEFORE INSERT ON calls WHEN NEW.rollout_id = 'poison' "
                "BEGIN SELECT RAISE(ABORT, 'refused by the store'); END"
            )
        )
    good = [record(f"good-{i}") for i in range(30)]
    poison = record("poison")
    for r in [*good[:15], poison, *good[15:]]:  # in one batch with the others (linger)
        recorder.begin(r.rollout_key)
        await recorder.submit(r)
    assert await recorder.settled([r.rollout_key for r in good], within=10)
    await recorder.close()
    assert count(db) == 30 and recorder.rejected == 1
    (aside,) = list((tmp_path / "rejected").glob("*.jsonl"))
    line = msgspec.json.decode(aside.read_bytes().splitlines()[0])
    assert line["record"]["call_id"] == poison.call_id and "refused by the store" in line["error"]
    assert not list((tmp_path / "journal").glob("seg-*.log"))
    await engine.dispose()


async def test_memory_is_bounded_in_bytes_while_the_store_stalls(tmp_path: Path) -> None:
    db = tmp_path / "b.sqlite"
    recorder, engine = await make(db, queue_bytes=200_000, batch_bytes=100_000)
    holder = sqlite3.connect(db, timeout=30, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    big = [msgspec.structs.replace(record(f"big-{i % 3}"), request={"pad": "x" * 20_000}) for i in range(200)]
    most = 0
    for r in big:
        await recorder.submit(r)
        most = max(most, recorder.memory_bytes())
    assert most <= 200_000  # ~4 MB submitted: the rest waits in the journal only
    assert recorder.journal.bytes > 4_000_000
    holder.rollback()
    holder.close()
    await recorder.close()
    assert count(db) == 200 and recorder.memory_bytes() == 0
    await engine.dispose()


def test_what_counts_as_a_refusal_and_what_as_an_outage() -> None:
    orig = Exception("driver error")
    assert refused(sa.exc.IntegrityError("INSERT", {}, orig))
    assert refused(sa.exc.DataError("INSERT", {}, orig))
    assert refused(RecursionError())  # our own encoding of a record nested too deep
    for outage in (
        sa.exc.OperationalError("INSERT", {}, orig),  # locked, no such table, server gone
        sa.exc.InterfaceError("INSERT", {}, orig),
        sa.exc.TimeoutError(),  # the pool
        ConnectionRefusedError(),
        TimeoutError(),
    ):
        assert not refused(outage), outage
