"""The recorder against a real SQLite store that misbehaves: slow, failing, gone at shutdown.

A call the client got an answer for must reach the store, whatever the store did meanwhile."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from gateway.recorder import Recorder
from store import create_engine, migrate
from store.db import create_sync_sqlite_engine
from store.records import CallRecord
from store.tables import calls
from tests.conftest import make_call


def record(rollout: str) -> CallRecord:
    return make_call(uuid.uuid4().hex, time.time(), rollout_id=rollout)


def count(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM calls").fetchone()[0]


async def make(db: Path, **kwargs) -> tuple[Recorder, object]:
    url = f"sqlite+aiosqlite:///{db}"
    engine = create_engine(url)
    await migrate(engine)
    recorder = Recorder(engine, spill_dir=db.parent / "spill", sync_engine=create_sync_sqlite_engine(url), **kwargs)
    await recorder.start()
    return recorder, engine


async def test_slow_store_is_absorbed_by_the_queue(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite"
    recorder, engine = await make(db)
    holder = sqlite3.connect(db, timeout=30, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")  # the store stalls: every write waits on this lock

    async def submit_all() -> float:
        started = time.monotonic()
        for i in range(500):
            await recorder.submit(record(f"slow-{i % 7}"))
        return time.monotonic() - started

    release = threading.Timer(2.0, holder.rollback)
    release.start()
    submit_seconds = await submit_all()
    assert submit_seconds < 1.0  # never on the client's path: submits did not wait for the stalled store
    await recorder.close()
    release.join()
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
    await asyncio.sleep(1.0)
    assert recorder.retries >= 2 and recorder.written == 0
    async with engine.begin() as conn:
        await conn.execute(sa.text("ALTER TABLE calls_away RENAME TO calls"))  # the store is back
    await recorder.close()
    assert count(db) == 50 and recorder.spilled == 0
    await engine.dispose()


async def test_store_gone_at_shutdown_spills_and_the_next_start_replays(tmp_path: Path) -> None:
    db = tmp_path / "g.sqlite"
    recorder, engine = await make(db, shutdown_timeout=0.5, max_backoff=0.1)
    async with engine.begin() as conn:
        await conn.execute(sa.text("ALTER TABLE calls RENAME TO calls_away"))
    submitted = [record("spill") for _ in range(20)]
    for r in submitted:
        await recorder.submit(r)
    await recorder.close()  # the store never came back: the records go to a spill file
    assert recorder.spilled == 20
    assert list((tmp_path / "spill").glob("unrecorded-*.jsonl"))
    async with engine.begin() as conn:
        await conn.execute(sa.text("ALTER TABLE calls_away RENAME TO calls"))
    await engine.dispose()

    again, engine = await make(db)  # a new start replays the spill file, then deletes it
    await again.close()
    with sqlite3.connect(db) as conn:
        ids = {row[0] for row in conn.execute(sa.select(calls.c.id).compile().string)}
    assert ids == {r.call_id for r in submitted}
    assert not list((tmp_path / "spill").glob("unrecorded-*.jsonl"))
    await engine.dispose()
