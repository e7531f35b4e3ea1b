"""The gateway in the test's own process, on a clock the test moves.

`ManualClock` is a `store.clock.Clock` that stands still until the test calls `advance`; `serve_in_process` runs
`create_app(settings, clock)` under uvicorn on uvloop in a thread, with the protocol `artgw serve` uses, so
the rate limits, the key ring's refresh and the canary watcher read the test's clock while everything else (the
store, the HTTP stack, the stand-in engine upstream) is real.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from gateway.app import create_app
from gateway.server import timed_protocol
from gateway.settings import Settings
from tests.conftest import free_port, poll


class ManualClock:
    """Stands still until `advance`. Safe to move from the test's thread while the gateway's loop reads it."""

    def __init__(self) -> None:
        self._wall = time.time()  # near the real time: the store's own timestamps are compared with it
        self._monotonic = 1000.0
        self._lock = threading.Lock()
        self._sleepers: list[tuple[float, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def time(self) -> float:
        return self._wall

    def monotonic(self) -> float:
        return self._monotonic

    def advance(self, seconds: float) -> None:
        """Move the clock on; the sleeps it ends return (on their own loops)."""
        with self._lock:
            self._wall += seconds
            self._monotonic += seconds
            due = [s for s in self._sleepers if s[0] <= self._monotonic]
            self._sleepers = [s for s in self._sleepers if s[0] > self._monotonic]
        for _, loop, woken in due:
            loop.call_soon_threadsafe(lambda f=woken: f.done() or f.set_result(None))

    async def sleep(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        with self._lock:
            until = self._monotonic + seconds
            if until <= self._monotonic:
                return
            self._sleepers.append((until, loop, woken))
        await woken


@dataclass
class InProcessGateway:
    url: str
    data_dir: Path
    admin_key: str

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}


@contextmanager
def serve_in_process(settings: Settings, clock: ManualClock) -> Iterator[InProcessGateway]:
    """`settings` (its port replaced by a free one) served until the block ends."""
    port = free_port()
    settings = dataclasses.replace(settings, port=port)
    http = timed_protocol(
        idle=settings.keep_alive_timeout,
        header=settings.header_timeout,
        body=settings.body_timeout,
        head_bytes=settings.max_header_bytes,
    )
    config = uvicorn.Config(
        create_app(settings, clock), host="127.0.0.1", port=port, http=http, loop="uvloop", log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"gateway-{port}", daemon=True)
    thread.start()
    try:
        poll(lambda: server.started or not thread.is_alive(), 60, "the in-process gateway to start")
        assert server.started, "the in-process gateway did not start (its error is in the test's output)"
        admin_key = settings.admin_key or settings.admin_key_path.read_text().strip()
        yield InProcessGateway(f"http://127.0.0.1:{port}", settings.data_dir, admin_key)
    finally:
        server.should_exit = True
        thread.join(60)
