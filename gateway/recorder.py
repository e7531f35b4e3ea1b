"""The recorder: gets every call into the store, off the client's critical path, losing none.

Calls go into a bounded in-memory queue; one writer task drains it in batches
(one transaction per batch). A slow store fills the queue; a full queue makes
`submit` wait, which slows the gateway down instead of dropping records. A
failed write is retried with backoff, the batch kept. On shutdown the queue is
flushed; whatever the store still refuses by then is written to a spill file
(JSON lines) that the next start replays, so a record is never lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from store.calls import write_calls, write_calls_sync
from store.codec import CallCache
from store.records import CallRecord

log = logging.getLogger("artgw.recorder")


class Recorder:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        spill_dir: Path,
        queue_size: int = 10_000,
        batch_size: int = 256,
        max_backoff: float = 5.0,
        shutdown_timeout: float = 30.0,
        linger: float = 0.02,
        sync_engine: Engine | None = None,
        cache_bytes: int = 64 << 20,
    ) -> None:
        self.engine = engine
        self.sync_engine = sync_engine  # SQLite: batches written from a worker thread, one hop each
        self.linger = linger  # wait this long for more records before a write: fewer, larger transactions
        self.spill_dir = spill_dir
        self.queue: asyncio.Queue[CallRecord] = asyncio.Queue(maxsize=queue_size)
        self.batch_size = batch_size
        self.max_backoff = max_backoff
        self.shutdown_timeout = shutdown_timeout
        self.written = 0  # records committed to the store
        self.retries = 0  # failed batch writes that were retried
        self.spilled = 0
        self._pending: list[CallRecord] = []  # the batch being written
        self._task: asyncio.Task[None] | None = None
        self._in_flight: dict[str, int] = {}  # rollout id -> calls accepted but not yet in the store
        self._committed = asyncio.Condition()
        # The last recorded calls of active rollouts: the next call of a rollout is stored as what it adds to
        # them (store/codec.py). Only the writer touches it, one batch at a time.
        self.cache = CallCache(max_bytes=cache_bytes)

    def begin(self, rollout_id: str) -> None:
        """A call of this rollout was accepted; it counts as in flight until its record is committed."""
        self._in_flight[rollout_id] = self._in_flight.get(rollout_id, 0) + 1

    def in_flight(self, rollout_id: str) -> int:
        return self._in_flight.get(rollout_id, 0)

    async def settled(self, rollout_ids: list[str], within: float) -> bool:
        """Wait until no call of these rollouts is in flight (read-your-writes); False on time-out."""

        def done() -> bool:
            return not any(self._in_flight.get(r) for r in rollout_ids)

        async with self._committed:
            try:
                await asyncio.wait_for(self._committed.wait_for(done), within)
            except TimeoutError:
                return False
        return True

    async def submit(self, record: CallRecord) -> None:
        """Queue a record; waits (back-pressure) only when the queue is full."""
        try:
            self.queue.put_nowait(record)
        except asyncio.QueueFull:
            await self.queue.put(record)

    def depth(self) -> int:
        return self.queue.qsize() + len(self._pending)

    async def start(self) -> None:
        await self._replay_spills()
        self._task = asyncio.create_task(self._run(), name="recorder")

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            if not self._pending:
                self._pending.append(await self.queue.get())
                if self.linger and self.queue.qsize() < self.batch_size:
                    await asyncio.sleep(self.linger)
                while len(self._pending) < self.batch_size and not self.queue.empty():
                    self._pending.append(self.queue.get_nowait())
            try:
                await self._write(self._pending)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.retries += 1
                log.warning("store write of %d records failed (%s); retrying", len(self._pending), exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)
                continue
            backoff = 0.05
            self.written += len(self._pending)
            for record in self._pending:
                left = self._in_flight.get(record.rollout_id, 0) - 1
                if left > 0:
                    self._in_flight[record.rollout_id] = left
                else:
                    self._in_flight.pop(record.rollout_id, None)
                self.queue.task_done()
            self._pending = []
            async with self._committed:
                self._committed.notify_all()

    async def _write(self, records: list[CallRecord]) -> None:
        if self.sync_engine is not None:
            await asyncio.to_thread(self._write_sync, list(records))
        else:
            async with self.engine.begin() as conn:
                await write_calls(conn, records, self.cache)
            self.cache.committed()  # only now may later calls be stored against these

    def _write_sync(self, records: list[CallRecord]) -> None:
        assert self.sync_engine is not None
        with self.sync_engine.begin() as conn:
            write_calls_sync(conn, records, self.cache)
        self.cache.committed()

    async def close(self) -> None:
        """Flush: wait for the queue to drain; spill what the store will not take in time."""
        try:
            await asyncio.wait_for(self.queue.join(), self.shutdown_timeout)
        except TimeoutError:
            pass
        if self._task is not None:
            self._task.cancel()
        if self.sync_engine is not None:
            self.sync_engine.dispose()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        leftover = self._pending + [self.queue.get_nowait() for _ in range(self.queue.qsize())]
        self._pending = []
        if leftover:
            self._spill(leftover)

    def _spill(self, records: list[CallRecord]) -> None:
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        path = self.spill_dir / f"unrecorded-{time.time_ns()}.jsonl"
        encoder = msgspec.json.Encoder()
        with path.open("wb") as f:
            for record in records:
                f.write(encoder.encode(record) + b"\n")
        self.spilled += len(records)
        log.error(
            "store unavailable at shutdown: %d records spilled to %s (replayed on next start)",
            len(records),
            path,
        )

    async def _replay_spills(self) -> None:
        """Write records a previous run spilled; the file goes only once they are committed."""
        decoder = msgspec.json.Decoder(CallRecord)
        for path in sorted(self.spill_dir.glob("unrecorded-*.jsonl")):
            records = [decoder.decode(line) for line in path.read_bytes().splitlines() if line.strip()]
            for i in range(0, len(records), self.batch_size):
                await self._write(records[i : i + self.batch_size])  # idempotent per call id
            path.unlink()
            log.info("replayed %d spilled records from %s", len(records), path)
