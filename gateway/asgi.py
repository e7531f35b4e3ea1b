"""The inference endpoints' answers as bare ASGI apps: the hot path skips the framework's response machinery.

Litestar's own `Stream` costs ~0.5 ms before the first event reaches the client (response building, an
anyio task group per stream); these write the status line and the bytes and nothing else, which is what
keeps the gateway's added time to first token under a millisecond (bench/stream_ttft.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from typing import Any

Headers = list[tuple[bytes, bytes]]


def _headers(content_type: bytes, extra: dict[str, str]) -> Headers:
    return [(b"content-type", content_type), *((k.lower().encode(), v.encode()) for k, v in extra.items())]


class JSONBody:
    """A complete JSON answer."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, body: bytes, headers: dict[str, str], status: int = 200) -> None:
        self.body = body
        self.status = status
        self.headers = _headers(b"application/json", headers)
        self.headers.append((b"content-length", str(len(body)).encode()))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


# The scope key under which the gateway's server (gateway/server.py) puts each request's HangUp.
HANG_UP = "artgw.hang_up"


class HangUp:
    """Tells a call that is not streamed that its client hung up: the server's protocol fires it when the
    connection is lost, and cancels the task parked in `task` (the call waiting for the engine).

    No task or receive() per call: while the gateway waits for the engine nothing is sent, and uvicorn only
    learns of the hang-up in `connection_lost`. The cancellation lands at the await the task is parked on
    (asyncio delivers it there), so the caller knows exactly where a hang-up can cut in; clearing `task`
    before the last await that matters makes the rest of the call uninterruptible by the client.
    """

    __slots__ = ("gone", "task")

    def __init__(self) -> None:
        self.gone = False
        self.task: asyncio.Task[Any] | None = None

    def fire(self) -> None:
        self.gone = True
        if self.task is not None:
            self.task.cancel()
            self.task = None


def hang_up_of(scope: Mapping[str, object]) -> HangUp | None:
    """The request's HangUp, which the gateway's server puts in each HTTP request's scope (None under another
    server, as in Litestar's test client)."""
    found = scope.get(HANG_UP)
    return found if isinstance(found, HangUp) else None


class EventStream:
    """Server-sent events relayed as they come, until the events end or the client goes away.

    A client that goes away cancels the relay wherever it waits (on the engine, or on a send), and the
    relay is closed either way, so its `finally` (close the engine's stream, record the call) always runs.
    """

    __slots__ = ("events", "first", "headers")

    def __init__(self, first: bytes, events: AsyncGenerator[bytes, None], headers: dict[str, str]) -> None:
        self.first = first  # already taken from `events`: what the engine answered before the response began
        self.events = events
        self.headers = _headers(b"text/event-stream; charset=utf-8", {**headers, "Cache-Control": "no-cache"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # The events are relayed from this very task (a task switch per stream costs ~0.2 ms of time to first
        # token); a watcher task cancels it when the client goes away.
        relaying = asyncio.current_task()
        assert relaying is not None
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            relaying.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone.is_set():
                raise  # not the client: the server is stopping this task
            relaying.uncancel()
        finally:
            watcher.cancel()
            await self.events.aclose()
