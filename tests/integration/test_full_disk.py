"""A full disk never costs an answered call (recording/recorder.py): the data dir on a 16 MB tmpfs, filled up
under load.

While the journal cannot take records every call is refused, 503 `recording_unavailable` with Retry-After (a
stream ends with that error event, no [DONE]), memory stays within the recorder's bounds, `/readyz` and
`artgw_journal_up` say so, as they say the store (SQLite, on the same disk) takes no write; freed space is noticed
by itself. Then the disk is filled again under load and the
gateway SIGKILLed: after a restart, every call whose client got a complete answer is in the store, once.

Needs root (it mounts the tmpfs), as CI runs here.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import metric, poll
from tests.load_helpers import Gateway, load, recorded, wait_recorded

SIZE_MB = 16
QUEUE_SIZE = 100  # --recorder-queue-size, as the run
QUEUE_BYTES = 4 << 20  # --recorder-queue-bytes
CONTENT = "x" * 20_000  # each call's journal entry is ~20 KB: the last MBs go in a few dozen calls
CONCURRENCY = 8


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "data"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}m,mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    assert mounted.returncode == 0, f"this test mounts a tmpfs (run it as root): {mounted.stderr.strip()}"
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path, leave: int = 1 << 20) -> Path:
    """A file that takes all but `leave` bytes of the disk."""
    stats = os.statvfs(disk)
    filler = disk / "filler"
    with filler.open("ab") as f:
        f.write(b"\0" * max(0, stats.f_bavail * stats.f_frsize - leave))
    return filler


def readiness(gateway: Gateway) -> tuple[int, dict[str, str]]:
    r = httpx.get(f"{gateway.url}/readyz", timeout=30)
    return r.status_code, r.json()


def chat(gateway: Gateway, stream: bool) -> httpx.Response:
    body = {"model": "my-agent", "messages": [{"role": "user", "content": CONTENT}], "stream": stream}
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=60)


async def test_a_full_disk_refuses_calls_and_loses_none_answered(
    tmp_path: Path, small_disk: Path, upstream: str
) -> None:
    gateway = Gateway(
        small_disk,
        upstream,
        *("--recorder-queue-size", str(QUEUE_SIZE), "--recorder-queue-bytes", str(QUEUE_BYTES)),
        log_path=tmp_path / "gateway.log",  # off the full disk
    )
    complete: set[str] = set()
    started: list[str] = []
    try:
        gateway.start()
        # -- the disk fills up under load: calls are refused, nothing piles up in memory
        filler = fill(small_disk)
        stop = asyncio.Event()
        task = asyncio.create_task(load(gateway.url, "a", stop, complete, started, CONCURRENCY, CONTENT))
        await asyncio.to_thread(
            poll, lambda: metric(gateway.url, "artgw_journal_errors_total") >= 20, 120, "the journal to refuse calls"
        )
        status, body = readiness(gateway)
        assert status == 503 and body["journal"].startswith("unavailable ("), body
        assert metric(gateway.url, "artgw_journal_up", exported=True) == 0
        assert metric(gateway.url, "artgw_recorder_memory_bytes") <= QUEUE_BYTES
        # The store (SQLite, on the same disk) still answers reads but takes no write: said too.
        poll(lambda: readiness(gateway)[1]["store"].startswith("failing writes ("), 60, "the store's writes to fail")
        assert metric(gateway.url, "artgw_store_up") == 0
        stop.set()
        await task
        refused = chat(gateway, stream=False)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
        assert refused.json()["error"]["code"] == "recording_unavailable"
        streamed = chat(gateway, stream=True)
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] != "[DONE]", events[-3:]
        assert json.loads(events[-1])["error"]["code"] == "recording_unavailable"
        answered_while_full = len(complete)

        # -- space comes back: the gateway notices by itself, and answers again
        filler.unlink()
        poll(lambda: readiness(gateway)[0] == 200, 30, "the gateway to be ready again")
        assert metric(gateway.url, "artgw_journal_up") == 1
        assert chat(gateway, stream=False).status_code == 200
        poll(lambda: readiness(gateway)[1]["store"] == "ok", 60, "the store to take writes again")
        assert metric(gateway.url, "artgw_store_up") == 1

        # -- full again under load, and SIGKILLed in the middle of it
        filler = fill(small_disk)
        errors = metric(gateway.url, "artgw_journal_errors_total")
        stop = asyncio.Event()
        task = asyncio.create_task(load(gateway.url, "b", stop, complete, started, CONCURRENCY, CONTENT))
        await asyncio.to_thread(
            poll, lambda: metric(gateway.url, "artgw_journal_errors_total") >= errors + 20, 120, "refusals again"
        )
        gateway.kill()
        stop.set()
        await task
        filler.unlink()
        gateway.start()  # on the same data dir: the journal is replayed
        await asyncio.to_thread(wait_recorded, gateway.db, complete, 120)
    finally:
        gateway.stop()
    counts = recorded(gateway.db)
    lost = sorted(complete - set(counts))
    twice = sorted(r for r, n in counts.items() if n > 1)
    print(
        f"{len(started)} calls started, {len(complete)} answered ({answered_while_full} in the first fill), "
        f"{len(counts)} recorded"
    )
    assert len(complete) > 20  # calls were answered until the disk was full
    assert not lost, f"{len(lost)} answered calls not recorded: {lost[:10]}"
    assert not twice, f"{len(twice)} calls recorded more than once: {twice[:10]}"
