"""The record journal (recording/journal.py): append, read back, a torn tail skipped, a damaged entry skipped
alone (its segment kept aside), rotation and trim, and the recorder's replay of what a crashed run left, exactly
once."""

from __future__ import annotations

import struct
import time
import uuid
import zlib
from pathlib import Path

import msgspec
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from recording.journal import Journal, Position, fold_stale_workers, worker_journal_dir
from recording.recorder import Recorder
from store import create_engine, migrate
from store.calls import write_calls
from store.db import create_sync_sqlite_engine
from store.records import CallRecord, RolloutKey
from tests.conftest import make_call


def record(rollout: str = "j", size: int = 0) -> CallRecord:
    call = make_call(uuid.uuid4().hex, time.time(), rollout_id=rollout)
    return msgspec.structs.replace(call, request={"pad": "x" * size}) if size else call


def read_all(journal: Journal) -> list[CallRecord | None]:
    got, _ = journal.read(Position(0, 0), journal.end(), 1_000_000, 1 << 40)
    return [r for r, _, _ in got]


def test_append_then_read_back_in_order(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    records = [record() for _ in range(5)]
    entries = [journal.append(r) for r in records]
    assert [e.end for e in entries] == sorted(e.end for e in entries)
    assert read_all(journal) == records
    # From the middle: the entry after the second one's end.
    got, after = journal.read(entries[1].end, journal.end(), 2, 1 << 30)
    assert [r for r, _, _ in got] == records[2:4] and after == entries[3].end
    journal.close()


def test_torn_tail_is_skipped_after_a_crash(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    records = [record() for _ in range(3)]
    for r in records:
        journal.append(r)
    # A crash mid-write: the last entry lost its last bytes (no close: the process died).
    (segment,) = list((tmp_path / "j").glob("seg-*.log"))
    data = segment.read_bytes()
    segment.write_bytes(data[:-7])
    again = Journal(tmp_path / "j")
    assert again.seal() == 2  # the old segment is read, never appended to
    assert read_all(again) == records[:2]
    # Only a header's worth torn off.
    segment.write_bytes(data[: -len(data) + 3])
    assert read_all(Journal(tmp_path / "j")) == []


def test_a_corrupt_entry_ends_its_segment_and_the_next_segment_is_read(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", segment_bytes=1)  # every entry rotates: one entry a segment
    records = [record() for _ in range(3)]
    for r in records:
        journal.append(r)
    assert journal.segment_count() == 3
    first = sorted((tmp_path / "j").glob("seg-*.log"))[0]
    data = bytearray(first.read_bytes())
    data[-2] ^= 0xFF  # a flipped byte: the checksum fails
    first.write_bytes(bytes(data))
    assert read_all(journal) == records[1:]


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))


# Where in the fourth entry the byte flips: its length, its checksum, the payload's first byte, its middle, its last.
@pytest.mark.parametrize("where", [0, 3, 5, 8, "middle", -1])
def test_a_damaged_entry_costs_that_entry_only(tmp_path: Path, where: int | str) -> None:
    """The read skips the damaged entry and resynchronises on the next whole one (#40: the rest of the segment
    was lost); the skip is counted once, however often that stretch is read again."""
    journal = Journal(tmp_path / "j")
    records = [record(size=i * 37) for i in range(10)]
    entries = [journal.append(r) for r in records]
    start, size = entries[2].end.offset, entries[3].size
    offset = {"middle": size // 2, -1: size - 1}.get(where, where)
    assert isinstance(offset, int)
    (segment,) = (tmp_path / "j").glob("seg-*.log")
    flip(segment, start + offset)
    assert read_all(journal) == records[:3] + records[4:]
    assert (journal.damaged_stretches, journal.damaged_bytes) == (1, size)
    # Read again, two records at a time: the same entries, the damage counted once.
    got, at = [], Position(0, 0)
    while at < journal.end():
        batch, at = journal.read(at, journal.end(), 2, 1 << 30)
        got += [r for r, _, _ in batch]
    assert got == records[:3] + records[4:]
    assert journal.damaged_stretches == 1


def test_damage_at_the_start_at_the_end_and_in_a_row(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    records = [record() for _ in range(8)]
    entries = [journal.append(r) for r in records]
    (segment,) = (tmp_path / "j").glob("seg-*.log")
    for i in (0, 3, 4, 7):  # the first, two in a row (one stretch), the last
        flip(segment, entries[i].end.offset - entries[i].size // 2)
    assert read_all(journal) == [records[i] for i in (1, 2, 5, 6)]
    assert journal.damaged_stretches == 3
    assert journal.damaged_bytes == sum(entries[i].size for i in (0, 3, 4, 7))


def test_resync_on_a_hand_made_segment(tmp_path: Path) -> None:
    """Entries packed by hand with garbage between them: bytes that look like headers (a plausible length before a
    `{`, its checksum wrong), a length far past the file, and a zero-filled tail (what a file system can leave after
    a power loss). Every whole entry is read; each stretch between them is one skip."""
    records = [record() for _ in range(4)]

    def entry(r: CallRecord) -> bytes:
        payload = msgspec.json.encode(r)
        return struct.pack("<II", len(payload), zlib.crc32(payload)) + payload

    fake = struct.pack("<II", 40, 12345) + b'{"call_id": "not a real entry", "x": 1}'
    garbage = [fake + b"\xff{{{", struct.pack("<II", 1 << 31, 0) + b'{"a":', b"\x00" * 64]
    (tmp_path / "j").mkdir()
    segment = tmp_path / "j" / "seg-000000000001.log"
    segment.write_bytes(entry(records[0]) + garbage[0] + entry(records[1]) + entry(records[2]) + garbage[1])
    with segment.open("ab") as f:
        f.write(entry(records[3]) + garbage[2])
    journal = Journal(tmp_path / "j")
    journal.seal()
    assert read_all(journal) == records
    assert (journal.damaged_stretches, journal.damaged_bytes) == (3, sum(len(g) for g in garbage))


def test_a_damaged_segment_is_kept_aside_and_a_torn_one_goes(tmp_path: Path) -> None:
    """Once everything readable in it is committed, a segment with damage is moved to journal/damaged/, never
    deleted; a segment whose only fault is a torn tail (a crash mid-append) is deleted as usual."""
    crashed = Journal(tmp_path / "j", segment_bytes=1_500)
    entries = [crashed.append(record(size=300)) for _ in range(8)]
    first, second = sorted((tmp_path / "j").glob("seg-*.log"))[:2]
    flip(first, 20)
    data = second.read_bytes()
    second.write_bytes(data[:-5])  # a torn tail
    kept = first.read_bytes()
    again = Journal(tmp_path / "j")
    again.seal()
    got, after = again.read(Position(0, 0), again.end(), 1_000, 1 << 30)
    assert after == again.end() and len(got) == len(entries) - 2
    assert again.damaged_stretches == 1  # the torn tail is not damage
    again.trim(after)
    again.close(all_committed=True)
    assert not list((tmp_path / "j").glob("seg-*.log"))
    assert [p.name for p in (tmp_path / "j" / "damaged").iterdir()] == [first.name]
    assert (tmp_path / "j" / "damaged" / first.name).read_bytes() == kept
    assert (tmp_path / "j" / "damaged").stat().st_mode & 0o777 == 0o700


def test_rotation_and_trim_free_committed_segments(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", segment_bytes=2_000)
    entries = [journal.append(record(size=500)) for _ in range(12)]
    assert journal.segment_count() >= 3
    total = journal.bytes
    assert total == sum(p.stat().st_size for p in (tmp_path / "j").glob("seg-*.log"))
    journal.trim(entries[5].end)
    remaining = read_all(journal)
    assert len(remaining) >= 12 - 6  # only whole committed segments went
    assert journal.bytes < total
    assert journal.segments[0] <= entries[6].end.segment
    journal.trim(journal.end())
    assert journal.segment_count() == 1  # the one appended to stays
    journal.close(all_committed=True)
    assert not list((tmp_path / "j").glob("seg-*.log"))


async def test_replay_after_a_crash_records_each_call_exactly_once(
    store_url: str, engine: AsyncEngine, tmp_path: Path
) -> None:
    """A crashed run left a journal; some of its records had been committed before the crash (the crash came
    between the commit and the trim). The next start writes the rest and duplicates nothing (both stores:
    on PostgreSQL the writer is async, and `close` must wait for it too)."""
    crashed = Journal(tmp_path / "journal", segment_bytes=4_000)
    records = [record(f"replay-{i % 5}") for i in range(60)]
    for r in records:
        crashed.append(r)
    async with engine.begin() as conn:
        assert await write_calls(conn, records[:25]) == 25  # committed, never trimmed
    # ... and the process died (no close): a torn half-entry at the end.
    last = (tmp_path / "journal") / f"seg-{crashed.end().segment:012d}.log"
    with last.open("ab") as f:
        f.write(b"\x40\x00\x00\x00\x00\x00")
    recorder = Recorder(engine, data_dir=tmp_path, sync_engine=create_sync_sqlite_engine(store_url), linger=0)
    await recorder.start()
    fresh = record("replay-new")
    recorder.begin(fresh.rollout_key)
    await recorder.submit(fresh)
    assert await recorder.settled([fresh.rollout_key], within=30)
    tail = record("replay-tail")  # submitted right before shutdown: close() flushes it on every store
    await recorder.submit(tail)
    await recorder.close()
    async with engine.connect() as conn:
        ids = [row[0] for row in await conn.execute(sa.text("SELECT id FROM calls"))]
        calls_in_rollouts = (await conn.execute(sa.text("SELECT sum(call_count) FROM rollouts"))).scalar_one()
    assert sorted(ids) == sorted([r.call_id for r in records] + [fresh.call_id, tail.call_id])
    assert calls_in_rollouts == 62  # no call counted twice
    assert not list((tmp_path / "journal").glob("seg-*.log"))  # all committed: the journal is gone


async def test_fsync_policies_record_all(tmp_path: Path) -> None:
    """`always` syncs before `submit` returns, `interval` in the background: both record every call."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'f.sqlite'}"
    engine = create_engine(url)
    await migrate(engine)
    for policy in ("always", "interval"):
        recorder = Recorder(
            engine,
            data_dir=tmp_path / policy,
            sync_engine=create_sync_sqlite_engine(url),
            journal_fsync=policy,  # type: ignore[arg-type]
            journal_fsync_interval=0.05,
        )
        await recorder.start()
        records = [record(f"fsync-{policy}") for _ in range(20)]
        for r in records:
            recorder.begin(r.rollout_key)
            await recorder.submit(r)
        # A wait, not a timing check: under a loaded disk (the suite beside it) each fsync can take seconds.
        assert await recorder.settled([RolloutKey("", f"fsync-{policy}")], within=120)
        await recorder.close()
        assert recorder.written == 20
    await engine.dispose()


def test_a_failed_append_leaves_no_torn_bytes(tmp_path: Path) -> None:
    """A write the disk refuses midway (ENOSPC) is cut off again: the next entry starts where the failed one did,
    and reading back finds every entry that was appended."""
    import errno
    import os
    from unittest import mock

    journal = Journal(tmp_path / "journal")
    journal.append(record("a"))
    real_write = os.write

    def half_then_full(fd: int, data: memoryview) -> int:
        if len(data) > 100:
            return real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    with mock.patch("recording.journal.os.write", half_then_full):
        try:
            journal.append(record("lost", size=1000))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        else:
            raise AssertionError("the append did not fail")
    journal.append(record("b"))
    assert [r.rollout_id for r in read_all(journal) if r is not None] == ["a", "b"]


def test_the_gateways_files_are_its_own(tmp_path: Path) -> None:
    """`artgw serve` keeps its data dir 0700 and its store, WAL, journal and key files 0600: they hold every
    prompt and answer, webhook secrets and key hashes (the data dir was made 0755 here, as `mkdir` makes it)."""
    import httpx

    from tests.conftest import gateway_on_stub

    with gateway_on_stub(tmp_path) as gateway:
        r = httpx.post(
            f"{gateway.base_url}/chat/completions",
            json={"model": "my-agent", "messages": [{"role": "user", "content": "secret"}]},
            timeout=30,
        )
        assert r.status_code == 200
        httpx.get(
            f"{gateway.base_url}/art/rollouts/{r.headers['x-art-rollout-id']}", timeout=30, headers=gateway.admin
        )  # stored
        modes = {
            path.relative_to(gateway.data_dir).as_posix(): path.stat().st_mode & 0o777
            for path in [gateway.data_dir, *gateway.data_dir.rglob("*")]
            if path.name != "gateway.log"  # the test's own log of the process, not the gateway's
        }
    assert modes["."] == 0o700
    assert {"artgw.sqlite", "artgw.sqlite-wal", "admin_key", "journal"} <= set(modes), modes
    assert {p: m for p, m in modes.items() if p != "." and m & 0o077} == {}, modes


def test_a_stopped_workers_journal_is_folded_into_a_running_ones(tmp_path: Path) -> None:
    """`serve --workers 2` after a run with 4: workers 2 and 3 no longer run, so their unwritten records move to
    workers 0 and 1 (whose own are kept), and nothing of theirs is left to be forgotten."""
    root = tmp_path / "journal"
    left: dict[int, list[CallRecord]] = {}
    for worker in range(4):
        journal = Journal(worker_journal_dir(root, worker))
        left[worker] = [record(f"w{worker}") for _ in range(worker + 1)]
        for r in left[worker]:
            journal.append(r)
        journal.close()
    assert fold_stale_workers(root, 2) == 3 + 4
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["worker-1"]
    assert read_all(Journal(root)) == left[0] + left[2]
    assert read_all(Journal(worker_journal_dir(root, 1))) == left[1] + left[3]
