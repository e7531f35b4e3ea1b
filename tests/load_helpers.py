"""Calls under load against a gateway that is killed and restarted on its data dir (test_crash, test_full_disk)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
from pathlib import Path
from typing import Any

import httpx

from recording.journal import Journal, Position
from tests.conftest import ARTGW, free_port, poll, start_serve, stop_group, wait_http


class Gateway:
    """`artgw serve --upstream` on a fixed data dir: killed and restarted on it."""

    def __init__(self, data_dir: Path, upstream: str, *extra: str, log_path: Path | None = None) -> None:
        self.data_dir = data_dir
        self.log_path = log_path or data_dir / "gateway.log"
        self.upstream = upstream
        self.extra = extra
        self.proc: Any = None  # a process (Popen's interface): tests/conftest.py start_serve
        self.url = ""
        data_dir.mkdir(parents=True, exist_ok=True)

    @property
    def db(self) -> Path:
        return self.data_dir / "artgw.sqlite"

    @property
    def admin(self) -> dict[str, str]:
        """Headers of an admin request (the key `serve` made in its data dir)."""
        return {"Authorization": f"Bearer {(self.data_dir / 'admin_key').read_text().strip()}"}

    def start(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        with self.log_path.open("ab") as log:
            self.proc = start_serve(
                [
                    *(ARTGW, "serve", "--port", str(port), "--data-dir", str(self.data_dir)),
                    *("--upstream", self.upstream, "--model-name", "my-agent", "--log-level", "warning"),
                    *self.extra,
                ],
                log,
            )
        try:
            wait_http(f"{self.url}/readyz", 60, self.proc)
        except Exception:
            print(self.log_path.read_text(errors="replace")[-5000:])
            raise

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)


def recorded(db: Path) -> dict[str, int]:
    """Calls in the store per rollout id."""
    with sqlite3.connect(db, timeout=30) as conn:
        return dict(conn.execute("SELECT rollout_id, count(*) FROM calls GROUP BY rollout_id").fetchall())


def wait_recorded(db: Path, rollouts: set[str], timeout: float) -> None:
    """Until these rollouts are all in the store, or `timeout` (the assertions that follow say what is missing)."""
    with contextlib.suppress(AssertionError):
        poll(lambda: rollouts <= set(recorded(db)), timeout, "the answered calls to be recorded")


async def one_call(client: httpx.AsyncClient, url: str, rollout: str, stream: bool, content: str = "hi") -> bool:
    """True when the client got a complete answer."""
    body = {"model": "my-agent", "messages": [{"role": "user", "content": content}], "stream": stream}
    try:
        if not stream:
            answer = await client.post(f"{url}/v1/chat/completions", json=body, headers={"X-ART-Rollout-Id": rollout})
            return answer.status_code == 200 and bool(answer.json()["choices"])
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers={"X-ART-Rollout-Id": rollout}
        ) as answer:
            data = b"".join([part async for part in answer.aiter_bytes()])
            return answer.status_code == 200 and data.endswith(b"data: [DONE]\n\n")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError):
        return False


async def load(
    url: str,
    prefix: str,
    stop: asyncio.Event,
    complete: set[str],
    started: list[str],
    concurrency: int,
    content: str = "hi",
) -> None:
    """`concurrency` clients calling until `stop` (or the gateway is gone), half of them streamed."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def worker(w: int) -> None:
            n = 0
            while not stop.is_set():
                rollout = f"{prefix}-{w}-{n}"
                n += 1
                started.append(rollout)
                if await one_call(client, url, rollout, stream=(w + n) % 2 == 0, content=content):
                    complete.add(rollout)
                else:  # the gateway is gone: don't spin on refused connections
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.05)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))


def flip_a_journal_byte(journal_dir: Path) -> tuple[Path, set[str], set[str]]:
    """Flip one bit of the one journal segment, 10% into it (as a bad disk would): the segment, and the rollouts
    whose entries it damaged and those it left whole (read before the flip)."""
    (segment,) = journal_dir.glob("seg-*.log")
    journal = Journal(journal_dir)
    entries, _ = journal.read(Position(0, 0), Position(journal.segments[-1] + 1, 0), 1_000_000, 1 << 40)
    flipped = segment.stat().st_size // 10
    data = bytearray(segment.read_bytes())
    data[flipped] ^= 0x01
    segment.write_bytes(bytes(data))
    damaged = {r.rollout_id for r, end, size in entries if r is not None and end.offset - size <= flipped < end.offset}
    return segment, damaged, {r.rollout_id for r, _, _ in entries if r is not None} - damaged
