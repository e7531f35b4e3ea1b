"""The record journal: a local append-only log in the data dir, so an acknowledged call survives a crash.

Every call's record is appended here before its client gets the end of its answer (gateway/proxy.py); the
recorder then moves journaled records to the store in batches and trims the journal behind them
(recording/recorder.py). On the next start whatever is still here is replayed: the store write is idempotent
per call id, so a crash between a store commit and the trim that follows it duplicates nothing.

Layout: `DATA/journal/seg-<seq>.log` segment files, the newest one appended to and rotated at a size.
An entry is `<u32 length><u32 crc32>` followed by `length` bytes of the msgspec-JSON `CallRecord` (JSON,
not msgpack: a request holds whatever JSON the client sent, integers beyond 64 bits included). One
`os.write` per entry.

An entry that is short or fails its checksum is skipped, and only it: the reader resynchronises on the next
offset where a whole entry passes its checksum (a payload is a JSON object, so only a header followed by `{`
is tried: scanning costs about a `find` over the damaged stretch). An entry cut short at the end, with no
whole entry after it, is the torn tail a crash mid-write leaves (its call was never acknowledged): skipped
quietly. Anything else skipped is damage (a flipped byte, a bad sector): logged with its byte range, counted
(`damaged_stretches`, `damaged_bytes`: the `artgw_journal_damaged*` metrics), and its segment is never
deleted: once replayed it is moved to `journal/damaged/`, where the skipped bytes can still be looked at.

An append the disk refuses (full, I/O error) raises OSError and leaves no part of its entry behind; the
recorder then refuses the call (recording/recorder.py).

Durability: a returned `append` has handed the bytes to the kernel, so the record survives the gateway
process dying in any way (crash, SIGKILL, OOM kill). Surviving power loss or a kernel crash needs them on
the disk: `fsync="always"` syncs before `append`'s caller acknowledges, `"interval"` at most
`fsync_interval` seconds later (a power loss can take the last interval), `"never"` leaves it to the OS.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Literal

import msgspec

from store.records import CallRecord

log = logging.getLogger("artgw.journal")

FsyncPolicy = Literal["always", "interval", "never"]

_HEADER = struct.Struct("<II")  # payload length, crc32 of the payload
_PREFIX, _SUFFIX = "seg-", ".log"
DAMAGED_DIR = "damaged"  # under the journal's directory: segments with damage, kept once replayed
_WORKER = "worker-"  # under the journal's directory: the journal of each `serve --workers` process but the first
_encode = msgspec.json.Encoder().encode
_decoder = msgspec.json.Decoder(CallRecord)


class Position(msgspec.Struct, frozen=True, order=True):
    """A point in the journal: a segment and a byte offset in it. Ordered as the journal is."""

    segment: int
    offset: int


class Entry(msgspec.Struct, frozen=True):
    """A record's place in the journal: where the next entry starts, and its size on disk."""

    end: Position
    size: int


class _Gap(msgspec.Struct, frozen=True):
    """Bytes of a segment a reader skipped (damage or a torn tail): the read goes on at `end`."""

    end: int


class Journal:
    def __init__(
        self,
        directory: Path,
        *,
        segment_bytes: int = 64 << 20,
        fsync: FsyncPolicy = "never",
    ) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.fsync_policy = fsync
        directory.mkdir(parents=True, exist_ok=True)
        # Segments left by an earlier run: never appended to again (their tail may be torn), only replayed.
        self.segments: list[int] = sorted(self._segment_seqs())
        self._fd = -1
        self._seq = (self.segments[-1] + 1) if self.segments else 1
        self._size = 0
        self._bytes = sum(self._path(s).stat().st_size for s in self.segments)
        self._dirty = False  # written since the last fsync
        self.appended = 0
        # Damage found by reads (skipped stretches that are not a torn tail): counted once each, and their
        # segments kept aside instead of deleted. Reads run in a worker thread, trims on the event loop.
        self.damaged_stretches = 0
        self.damaged_bytes = 0
        self._damage_seen: set[tuple[int, int]] = set()  # (segment, offset): a re-read does not count it again
        self._damaged_segments: set[int] = set()

    # -- appending (the event loop's thread only)

    def append(self, record: CallRecord) -> Entry:
        """Write one record; returns once the kernel has it (see the module doc for what survives what)."""
        payload = _encode(record)
        data = _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        if self._fd < 0 or self._size >= self.segment_bytes:
            self._rotate()
        view = memoryview(data)
        try:
            while view:  # a regular file takes it all unless the disk is full (then OSError)
                view = view[os.write(self._fd, view) :]
        except OSError:
            if len(view) < len(data):  # a part went in: cut it off, the next entry starts where this one did
                os.ftruncate(self._fd, self._size)
            raise
        self._size += len(data)
        self._bytes += len(data)
        self._dirty = True
        self.appended += 1
        return Entry(Position(self._seq, self._size), len(data))

    def end(self) -> Position:
        """Where the next entry will start (on the segment the next append writes, unless it rotates)."""
        return Position(self._seq, self._size)

    def sync(self, *, force: bool = False) -> None:
        """fsync the segment being appended to (safe from a worker thread). `force`: even if another sync is
        under way (it may have started before this caller's append)."""
        fd = self._fd
        if fd >= 0 and (self._dirty or force):
            self._dirty = False
            try:
                os.fsync(fd)
            except OSError as exc:  # closed by a rotation meanwhile: that one synced it
                log.debug("journal fsync skipped: %s", exc)

    def seal(self) -> int:
        """Close the segment appended to: the next append starts a new one. Returns that one's number (entries
        in lower-numbered segments were appended before this call: a run seals on start to tell its own
        records from replayed ones)."""
        if self._fd >= 0:
            if self.fsync_policy != "never":
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            self._seq += 1
            self._size = 0
        return self._seq

    def _rotate(self) -> None:
        if self._fd >= 0:
            if self.fsync_policy != "never":
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1  # a failed open below (disk full) must not leave a closed descriptor to write to
            self._seq += 1
        self._fd = os.open(self._path(self._seq), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._size = os.fstat(self._fd).st_size
        self.segments.append(self._seq)
        if self.fsync_policy != "never":  # the new file's name must survive power loss too
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    # -- reading (any thread: reads only bytes appends have already completed)

    def read(
        self, start: Position, stop: Position, max_records: int, max_bytes: int
    ) -> tuple[list[tuple[CallRecord | None, Position, int]], Position]:
        """Entries from `start` up to `stop` (at most `max_records`, and `max_bytes` unless that leaves none),
        as (record, its end, size) with None for an entry that passed its checksum but does not decode; and
        where the next read starts. A damaged entry is skipped and the read goes on at the next whole one."""
        out: list[tuple[CallRecord | None, Position, int]] = []
        taken = 0
        seq, offset = start.segment, start.offset
        segments = [s for s in list(self.segments) if start.segment <= s <= stop.segment]
        for seq in segments:
            if seq > start.segment:
                offset = 0
            limit = stop.offset if seq == stop.segment else None
            for item in self._entries(seq, offset, limit):
                if isinstance(item, _Gap):
                    offset = item.end
                    continue
                record, end, size = item
                if out and (len(out) >= max_records or taken + size > max_bytes):
                    return out, Position(seq, offset)
                out.append((record, Position(seq, end), size))
                taken += size
                offset = end
            if seq == stop.segment:
                return out, Position(seq, offset)
        return out, stop

    def _entries(self, seq: int, offset: int, limit: int | None) -> Iterator[tuple[CallRecord | None, int, int] | _Gap]:
        path = self._path(seq)
        try:
            f = path.open("rb")
        except FileNotFoundError:
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            end = size if limit is None else min(limit, size)  # past `limit`: appends still under way
            f.seek(offset)
            while offset < end:
                header = f.read(_HEADER.size) if end - offset >= _HEADER.size else b""
                length, crc = _HEADER.unpack(header) if header else (0, 0)
                payload = f.read(length) if 0 < length <= end - offset - _HEADER.size else b""
                if not payload or zlib.crc32(payload) != crc:
                    resume = self._next_entry(f, offset + 1, end)
                    torn = resume is None and (not header or offset + _HEADER.size + length > end)
                    self._skipped(seq, offset, end if resume is None else resume, torn=torn)
                    if resume is None:
                        yield _Gap(end)
                        return
                    offset = resume
                    f.seek(offset)
                    yield _Gap(offset)
                    continue
                try:
                    record: CallRecord | None = _decoder.decode(payload)
                except msgspec.DecodeError as exc:
                    log.error("journal %s: entry at byte %d does not decode (%s)", path.name, offset, exc)
                    record = None
                offset += _HEADER.size + length
                yield record, offset, _HEADER.size + length

    @staticmethod
    def _next_entry(f: BinaryIO, start: int, end: int) -> int | None:
        """The first offset in [start, end) where a whole entry passes its checksum, or None. Only offsets
        followed, a header later, by the `{` a payload starts with are tried; in JSON text a header's length
        read from text bytes is over 512 MiB, so nearly every false one is refused without a checksum."""
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            at = start
            while True:
                brace = view.find(b"{", at + _HEADER.size, end)
                if brace < 0:
                    return None
                at = brace - _HEADER.size
                length, crc = _HEADER.unpack_from(view, at)
                if 0 < length <= end - brace and zlib.crc32(view[brace : brace + length]) == crc:
                    return at
                at += 1

    def _skipped(self, seq: int, start: int, stop: int, *, torn: bool) -> None:
        """Say what a read skipped, once however often it is read again."""
        if (seq, start) in self._damage_seen:
            return
        self._damage_seen.add((seq, start))
        name = self._path(seq).name
        if torn:  # a crash cut the last write short: its call was never acknowledged
            log.warning("journal %s: torn entry at byte %d (%d bytes) skipped", name, start, stop - start)
            return
        self._damaged_segments.add(seq)
        self.damaged_stretches += 1
        self.damaged_bytes += stop - start
        log.error(
            "journal %s: damaged entry at bytes %d-%d skipped (%d bytes that fail their checksum); %s. The segment "
            "is kept in %s once replayed",
            name,
            start,
            stop,
            stop - start,
            "nothing whole after it" if stop >= self._file_size(seq) else f"read on from byte {stop}",
            self.directory / DAMAGED_DIR,
        )

    def raw(self, seq: int, offset: int, size: int) -> bytes:
        """The payload of one entry (for setting aside one that does not decode)."""
        with self._path(seq).open("rb") as f:
            f.seek(offset + _HEADER.size)
            return f.read(size - _HEADER.size)

    # -- trimming (the event loop's thread only)

    def trim(self, committed: Position) -> None:
        """Delete the segments every record of which is committed: those before `committed`'s segment, and
        that one too once it is finished (not the one appended to)."""
        keep = []
        for seq in self.segments:
            done = seq < committed.segment or (
                seq == committed.segment and seq != self._seq and committed.offset >= self._file_size(seq)
            )
            if done:
                self._retire(seq)
            else:
                keep.append(seq)
        self.segments = keep

    def close(self, *, all_committed: bool = False) -> None:
        """Stop appending; with `all_committed` (a clean shutdown that drained everything) the journal goes."""
        if self._fd >= 0:
            if self.fsync_policy != "never":
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        if all_committed or self._size == 0:  # an empty segment is noise for the next start
            self._retire(self._seq)
            self.segments = [s for s in self.segments if s != self._seq]
            self._size = 0
        if all_committed:
            self.trim(Position(self._seq + 1, 0))
        self._seq += 1

    def _retire(self, seq: int) -> None:
        """A segment all of whose records are committed goes; one with damage is moved aside, never deleted."""
        path = self._path(seq)
        self._bytes -= self._file_size(seq)
        if seq not in self._damaged_segments or not path.exists():
            path.unlink(missing_ok=True)
            return
        aside = self.directory / DAMAGED_DIR
        aside.mkdir(mode=0o700, exist_ok=True)
        target, n = aside / path.name, 0
        while target.exists():  # numbers restart once a journal has emptied: never overwrite one kept earlier
            n += 1
            target = aside / f"{path.stem}.{n}{_SUFFIX}"
        path.rename(target)
        self._damaged_segments.discard(seq)
        log.warning("journal %s: replayed but for its damage; kept as %s", path.name, target)

    # -- sizes (metrics)

    @property
    def bytes(self) -> int:
        return self._bytes

    def segment_count(self) -> int:
        return len(self.segments)

    def _file_size(self, seq: int) -> int:
        if seq == self._seq and self._fd >= 0:
            return self._size
        try:
            return self._path(seq).stat().st_size
        except FileNotFoundError:
            return 0

    def _path(self, seq: int) -> Path:
        return self.directory / f"{_PREFIX}{seq:012d}{_SUFFIX}"

    def _segment_seqs(self) -> Iterator[int]:
        for path in self.directory.glob(f"{_PREFIX}*{_SUFFIX}"):
            stem = path.name[len(_PREFIX) : -len(_SUFFIX)]
            if stem.isdigit():
                yield int(stem)


def worker_journal_dir(journal_dir: Path, worker: int) -> Path:
    """The journal of `serve --workers`' process `worker`: the first's is the one a single process has."""
    return journal_dir if worker == 0 else journal_dir / f"{_WORKER}{worker}"


def fold_stale_workers(journal_dir: Path, workers: int) -> int:
    """Before `workers` processes start: the journals of workers that no longer run (an earlier start with more)
    appended to a running one's, then removed, so none is left unreplayed. Returns the records moved (a crash
    in between leaves some twice: the store keeps each call once)."""
    moved = 0
    for stale in sorted(journal_dir.glob(f"{_WORKER}*")):
        number = stale.name[len(_WORKER) :]
        if not number.isdigit() or int(number) < workers:
            continue
        source = Journal(stale)
        if source.segments:
            target = Journal(worker_journal_dir(journal_dir, int(number) % workers))
            entries, _ = source.read(Position(source.segments[0], 0), source.end(), 1 << 62, 1 << 62)
            for record, _end, _size in entries:
                if record is not None:  # one that passed its checksum but does not decode: kept below, as damage
                    target.append(record)
                    moved += 1
            target.sync(force=True)
            target.close()
        source.close(all_committed=True)  # a damaged segment is moved aside under it, never deleted
        if not any(stale.iterdir()):
            stale.rmdir()
    return moved
