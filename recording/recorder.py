"""The recorder: gets every call into the store, off the client's critical path, losing none.

A call's record is first appended to the journal (recording/journal.py), before its client gets the end of
its answer: from then on it survives the gateway dying in any way. One writer task moves journaled records
to the store in batches (one transaction per batch) and trims the journal behind the last committed one.

Records also wait in memory, so that the writer need not read back what it was just handed, but only up to
`queue_size` records and `queue_bytes` bytes (their journal entries' sizes). Past that bound a record is
in the journal only, and the writer reads it back from there: a stalled store costs disk, not memory, and
nobody waits for the store (there is no back-pressure on clients). The journal is consumed strictly in
order, so "committed up to here" is one position.

When the journal cannot take a record (disk full, an I/O error), `submit` raises `RecordingUnavailable`: the
call is then refused (503 with Retry-After, gateway/proxy.py), never answered unrecorded, and nothing piles up
in memory; `/readyz` and `artgw_journal_up` say so until the disk takes writes again, which the recorder
notices by itself (`journal_writable`).

A failed write is retried with backoff. A batch that still fails after `max_attempts` is written record by
record: a record the store refuses (an integrity or data error, or a value the encoder rejects) is set
aside in `DATA/rejected/*.jsonl` with the error, counted and logged, and the others go on; errors that
mean the store itself is unavailable (connection, lock, missing table) are retried, never set aside.

On start, whatever an earlier run left in the journal is written again (the store write is idempotent per
call id, so a crash between a commit and the trim duplicates nothing), as are spill files
(`DATA/spill/unrecorded-*.jsonl`) of versions that spilled at shutdown instead of journaling.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
from collections import deque
from pathlib import Path

import msgspec
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from recording.journal import Entry, FsyncPolicy, Journal, Position
from store.calls import write_calls, write_calls_sync
from store.codec import CallCache
from store.records import CallRecord, RolloutKey

log = logging.getLogger("artgw.recorder")

# A record waiting in memory: the record, its journal entry (None: not journaled), its size.
_Item = tuple[CallRecord, Entry | None, int]


class RecordingUnavailable(Exception):
    """The journal cannot take a call's record (disk full, I/O error): the call must not be acknowledged."""


# Errors that say "this record", not "the store": the same record fails the same way on every attempt.
_REFUSALS = (sa_exc.IntegrityError, sa_exc.DataError, sa_exc.NotSupportedError)


def refused(exc: BaseException) -> bool:
    """True when the store (or the encoding before it) refuses this record itself: an integrity or data error,
    a value that can't be bound, or an error of our own encoding (store/codec.py), which fails the same way
    for the same record every time. A lost connection, a lock, a pool time-out or a missing table say the
    store is unavailable: retried, never set aside, so an outage can't empty the queue into rejected/."""
    if isinstance(exc, _REFUSALS):
        return True
    if isinstance(exc, sa_exc.StatementError) and not isinstance(exc, sa_exc.DBAPIError):
        return not isinstance(exc.orig, OSError)  # raised while binding a value, before the database saw it
    return not isinstance(exc, sa_exc.SQLAlchemyError | OSError)


def _malloc_trim() -> None:
    """Hand freed heap back to the OS after a burst (glibc keeps it otherwise); a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Recorder:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        data_dir: Path | None = None,
        spill_dir: Path | None = None,
        queue_size: int = 10_000,
        queue_bytes: int = 64 << 20,
        batch_size: int = 256,
        batch_bytes: int = 16 << 20,
        max_backoff: float = 5.0,
        max_attempts: int = 5,
        shutdown_timeout: float = 30.0,
        linger: float = 0.02,
        sync_engine: Engine | None = None,
        cache_bytes: int = 64 << 20,
        journal_segment_bytes: int = 64 << 20,
        journal_fsync: FsyncPolicy = "never",
        journal_fsync_interval: float = 1.0,
        journal_dir: Path | None = None,  # default DATA_DIR/journal
    ) -> None:
        if data_dir is None:
            if spill_dir is None:
                raise ValueError("Recorder needs a data_dir")
            data_dir = spill_dir.parent
        self.engine = engine
        self.sync_engine = sync_engine  # SQLite: batches written from a worker thread, one hop each
        self.linger = linger  # wait this long for more records before a write: fewer, larger transactions
        self.data_dir = data_dir
        self.spill_dir = spill_dir or data_dir / "spill"  # only read: spills of earlier versions
        self.rejected_dir = data_dir / "rejected"
        self.journal = Journal(
            journal_dir or data_dir / "journal", segment_bytes=journal_segment_bytes, fsync=journal_fsync
        )
        self.fsync_interval = journal_fsync_interval
        self.queue_size = queue_size
        self.queue_bytes = queue_bytes
        self.batch_size = batch_size
        self.batch_bytes = batch_bytes
        self.max_backoff = max_backoff
        self.max_attempts = max_attempts
        self.shutdown_timeout = shutdown_timeout
        self.written = 0  # records committed to the store (or found there already)
        self.retries = 0  # failed batch writes that were retried
        self.rejected = 0  # records the store refused, set aside in rejected/
        self.journal_errors = 0  # appends the journal failed (disk full?): those calls were refused, not recorded
        self.journal_failure: str | None = None  # why the last append failed, until one succeeds again
        self.store_failure: str | None = None  # why the last store write failed, until one commits again
        self.spilled = 0  # kept for the metric: nothing spills any more, the journal holds what is unwritten
        self._mem: deque[_Item] = deque()
        self._mem_bytes = 0
        self._peak_bytes = 0  # the most bytes in memory since memory was last handed back
        # Where the records that are in the journal only begin (None: every unwritten record is in memory).
        self._disk_from: Position | None = None
        self._disk_count = 0  # of them, those this run appended (the replayed ones are not counted ahead)
        self._committed_at: Position | None = None  # the journal is committed up to here
        self._live_from = 0  # first journal segment of this run: older entries are replayed ones
        self._pending: list[_Item] = []  # the batch being written
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._fsync_task: asyncio.Task[None] | None = None
        self._in_flight: dict[RolloutKey, int] = {}  # rollout -> calls accepted but not yet in the store
        self._committed = asyncio.Condition()
        # The last recorded calls of active rollouts: the next call of a rollout is stored as what it adds to
        # them (store/codec.py). Only the writer touches it, one batch at a time.
        self.cache = CallCache(max_bytes=cache_bytes)

    def begin(self, rollout: RolloutKey) -> None:
        """A call of this rollout was accepted; it counts as in flight until its record is committed."""
        self._in_flight[rollout] = self._in_flight.get(rollout, 0) + 1

    async def withdraw(self, rollout: RolloutKey) -> None:
        """A call `begin` counted will have no record after all (refused once the store answered)."""
        await self._forget(rollout)

    def in_flight(self, rollout: RolloutKey) -> int:
        return self._in_flight.get(rollout, 0)

    async def settled(self, rollouts: list[RolloutKey], within: float) -> bool:
        """Wait until no call of these rollouts is in flight (read-your-writes); False on time-out."""

        def done() -> bool:
            return not any(self._in_flight.get(r) for r in rollouts)

        async with self._committed:
            try:
                await asyncio.wait_for(self._committed.wait_for(done), within)
            except TimeoutError:
                return False
        return True

    async def submit(self, record: CallRecord) -> None:
        """Journal a record (durable against a crash once this returns) and hand it to the writer.

        The append is a plain write to the page cache (microseconds for a usual call), done right here on
        the event loop so that it is complete before the caller acknowledges the call; it never waits for
        the store."""
        try:
            entry = self.journal.append(record)
        except OSError as exc:
            # The disk refuses it (full, an I/O error): the call is not recorded, and its caller must not answer
            # it as if it were (a crash would lose it). Nothing waits in memory instead: memory stays bounded.
            self.journal_errors += 1
            if self.journal_failure is None:
                log.error("the journal cannot take records (%s): calls are refused with 503 until it can", exc)
            self.journal_failure = f"{type(exc).__name__}: {exc}"
            await self._forget(record.rollout_key)
            raise RecordingUnavailable(self.journal_failure) from exc
        if self.journal_failure is not None:
            log.warning("the journal takes records again (after: %s)", self.journal_failure)
            self.journal_failure = None
        if (
            self._disk_from is None
            and len(self._mem) < self.queue_size
            and self._mem_bytes + entry.size <= self.queue_bytes
        ):
            self._mem.append((record, entry, entry.size))
            self._mem_bytes += entry.size
            self._peak_bytes = max(self._peak_bytes, self._mem_bytes)
        else:
            # Past the bound, and until the writer has caught up with the journal, records are on disk only:
            # the writer reads them back in order.
            if self._disk_from is None:
                self._disk_from = Position(entry.end.segment, entry.end.offset - entry.size)
            self._disk_count += 1
        self._wake.set()
        if self.journal.fsync_policy == "always":
            await asyncio.to_thread(self.journal.sync, force=True)

    def depth(self) -> int:
        """Records waiting for the store (replayed ones are counted as they are read)."""
        return len(self._mem) + self._disk_count + len(self._pending)

    def memory_bytes(self) -> int:
        return self._mem_bytes

    async def start(self) -> None:
        self._replay_spills()
        self._live_from = self.journal.seal()
        if self.journal.segments:
            log.info(
                "journal: %d segment(s), %d bytes from an earlier run; replaying them into the store",
                len(self.journal.segments),
                self.journal.bytes,
            )
            self._disk_from = Position(self.journal.segments[0], 0)
        self._task = asyncio.create_task(self._run(), name="recorder")
        if self.journal.fsync_policy == "interval":
            self._fsync_task = asyncio.create_task(self._fsync_every(), name="journal-fsync")

    async def _fsync_every(self) -> None:
        while True:
            await asyncio.sleep(self.fsync_interval)
            await asyncio.to_thread(self.journal.sync)

    def drained(self) -> bool:
        return not self._mem and self._disk_from is None and not self._pending

    async def _run(self) -> None:
        while True:
            try:
                if not self._pending:
                    self._pending = await self._next_batch()
                    if not self._pending:  # all it read was set aside: still, trim and tell the waiters
                        await self._done([])
                        continue
                await self._commit()
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug or an unreadable journal must not end the writer: what it missed stays in the journal.
                log.exception("recorder writer failed; going on in 1 s")
                await asyncio.sleep(1.0)
                continue
            self._pending = []
            if self.drained() and self._peak_bytes > 8 << 20:
                self._peak_bytes = 0
                await asyncio.to_thread(_malloc_trim)

    async def _next_batch(self) -> list[_Item]:
        """The oldest unwritten records, in journal order: from memory first (all older than the disk-only
        ones), then from the journal."""
        while not self._mem and self._disk_from is None:
            self._wake.clear()
            await self._wake.wait()
        if self.linger and self._disk_from is None and len(self._mem) < self.batch_size:
            await asyncio.sleep(self.linger)
        batch: list[_Item] = []
        taken = 0
        while self._mem and len(batch) < self.batch_size and (not batch or taken + self._mem[0][2] <= self.batch_bytes):
            item = self._mem.popleft()
            self._mem_bytes -= item[2]
            taken += item[2]
            batch.append(item)
        if self._mem or self._disk_from is None or len(batch) >= self.batch_size or taken >= self.batch_bytes:
            return batch
        start, stop = self._disk_from, self.journal.end()
        try:
            read, after = await asyncio.to_thread(
                self.journal.read, start, stop, self.batch_size - len(batch), self.batch_bytes - taken
            )
        except OSError as exc:  # the batch taken so far goes on; the journal is read again next time
            log.error("journal read failed (%s); retrying", exc)
            await asyncio.sleep(1.0)
            return batch
        self._disk_from = after
        self._disk_count = max(0, self._disk_count - len(read))
        # Caught up with the journal (no append since `stop` was taken, nothing awaited since the check):
        # new records may wait in memory again.
        if after >= self.journal.end():
            self._disk_from = None
            self._disk_count = 0
        for record, end, size in read:
            if record is None:  # passed its checksum but does not decode: a bug or another version's record
                raw = self.journal.raw(end.segment, end.offset - size, size)
                self._reject_raw(raw, "journal entry does not decode as a CallRecord")
                self._committed_at = end
                continue
            batch.append((record, Entry(end, size), size))
        return batch

    async def _commit(self) -> None:
        """Write the pending batch; retry; after `max_attempts`, record by record, setting refusals aside."""
        backoff = 0.05
        attempts = 0
        while self._pending:
            try:
                await self._write([item[0] for item in self._pending])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                attempts += 1
                self.retries += 1
                if not refused(exc):  # the store, not a record: reads may work while no write does (a full disk)
                    self.store_failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                log.warning("store write of %d records failed (%s); retrying", len(self._pending), exc)
                if attempts >= self.max_attempts and (len(self._pending) > 1 or refused(exc)):
                    await self._one_by_one()
                    if not self._pending:
                        return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)
                continue
            self.written += len(self._pending)
            self.store_failure = None
            batch, self._pending = self._pending, []  # cleared before the waiters are told: close() checks it
            await self._done(batch)

    async def _one_by_one(self) -> None:
        """Write the pending records one at a time, in order; stop at one that fails for a store reason."""
        while self._pending:
            item = self._pending[0]
            try:
                await self._write([item[0]])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not refused(exc):
                    return  # the store itself is unavailable: the rest waits for it, in order
                self._reject(item[0], exc)
            else:
                self.written += 1
            self._pending = self._pending[1:]
            await self._done([item])

    def _leave(self, rollout: RolloutKey) -> None:
        """One call of this rollout is no longer in flight (committed, or never to be)."""
        left = self._in_flight.get(rollout, 0) - 1
        if left > 0:
            self._in_flight[rollout] = left
        else:
            self._in_flight.pop(rollout, None)

    async def _forget(self, rollout: RolloutKey) -> None:
        """A call of this rollout will never be committed: it is no longer in flight."""
        self._leave(rollout)
        async with self._committed:
            self._committed.notify_all()

    def journal_writable(self) -> bool:
        """Whether the journal takes records. While appends fail, a probe (a small file written, synced and
        removed in its directory) says when the disk takes writes again, so that a gateway that readiness took out
        of its load balancer (and so gets no calls to try) comes back by itself."""
        if self.journal_failure is None:
            return True
        probe = self.journal.directory / ".probe"
        try:
            with probe.open("wb") as f:
                f.write(b"\0" * 65536)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            self.journal_failure = f"{type(exc).__name__}: {exc}"
            return False
        finally:
            probe.unlink(missing_ok=True)
        log.warning("the journal's disk takes writes again (after: %s)", self.journal_failure)
        self.journal_failure = None
        return True

    async def _done(self, items: list[_Item]) -> None:
        """These records are in the store (or set aside): no longer in flight; trim the journal behind them."""
        for record, entry, _ in items:
            if entry is not None:
                self._committed_at = entry.end
                if entry.end.segment < self._live_from:
                    continue  # replayed from an earlier run: no call of this run is waiting for it
            self._leave(record.rollout_key)
        if (
            self._committed_at is not None
            and self.journal.segments
            and self.journal.segments[0] <= self._committed_at.segment
        ):
            self.journal.trim(self._committed_at)
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

    # -- records the store refuses

    def _reject(self, record: CallRecord, exc: BaseException) -> None:
        self._set_aside(msgspec.json.encode(record), f"{type(exc).__name__}: {exc}")
        log.error("the store refused call %s (%s): set aside in %s", record.call_id, exc, self.rejected_dir)

    def _reject_raw(self, payload: bytes, reason: str) -> None:
        self._set_aside(payload, reason)
        log.error("%s: set aside in %s", reason, self.rejected_dir)

    def _set_aside(self, payload: bytes, reason: str) -> None:
        """One JSON line `{"error": ..., "record": ...}`, synced: the journal entry goes once this returns."""
        self.rejected += 1
        self.rejected_dir.mkdir(parents=True, exist_ok=True)
        line = b'{"error":' + msgspec.json.encode(reason) + b',"record":' + payload + b"}\n"
        with (self.rejected_dir / f"rejected-{os.getpid()}.jsonl").open("ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    # -- shutdown and upgrades

    async def close(self) -> None:
        """Flush (on every store): wait for the writer to drain, up to `shutdown_timeout`. What is still
        unwritten then stays in the journal and is replayed on the next start."""
        if self._task is not None and not self._task.done():
            async with self._committed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._committed.wait_for(self.drained), self.shutdown_timeout)
        for task in (self._task, self._fsync_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.sync_engine is not None:
            self.sync_engine.dispose()
        drained = self.drained()
        if not drained:
            log.error(
                "store unavailable at shutdown: %d+ records stay in the journal (%s), replayed on the next start",
                self.depth(),
                self.journal.directory,
            )
        self.journal.close(all_committed=drained)

    def _replay_spills(self) -> None:
        """Move spill files of earlier versions into the journal (then the file goes: a crash in between
        leaves a record twice in the journal, and the store keeps it once)."""
        decoder = msgspec.json.Decoder(CallRecord)
        for path in sorted(self.spill_dir.glob("unrecorded-*.jsonl")):
            lines = [line for line in path.read_bytes().splitlines() if line.strip()]
            for line in lines:
                self.journal.append(decoder.decode(line))
            self.journal.sync()
            path.unlink()
            log.info("moved %d spilled records from %s into the journal", len(lines), path)
