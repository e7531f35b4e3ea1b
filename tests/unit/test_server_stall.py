"""A stalled event loop does not cut off a request the client already sent (gateway/server.py).

uvloop (libuv) runs due timers before it polls sockets, and runs a protocol's `data_received` inline while it
handles one poll's events. A loop that stalls there (CPU starvation, a long callback, a write the kernel
holds) after a poll found a new connection with nothing to read used to see that connection's idle timeout
as expired on the next turn and close it, its request unread in the kernel: "Server disconnected without
sending a response" (a CI run's flake, on a /metrics scrape). Here the stall is made on cue: a second
connection's bytes make the server hold its loop until the first connection has sent its request and the
idle timeout is past. The server is uvicorn on uvloop in this process, as `artgw serve` runs it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from gateway.server import timed_protocol
from tests.conftest import free_port, poll

IDLE = 1.0  # seconds: the timeout for a new connection's first request; the stall outlasts it
STALL = b"STALL"  # what the second connection sends to stall the loop


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class _Server:
    def __init__(self, idle: float = IDLE, header: float = IDLE) -> None:
        self.accepted = threading.Event()  # the server has accepted a connection
        self.stalling = threading.Event()  # the loop is held
        self.sent = threading.Event()  # the client has sent its request
        accepted, stalling, sent = self.accepted, self.stalling, self.sent

        # `header` also bounds a new connection's wait for its first request (the stall tests use it).
        class Stalled(timed_protocol(idle=idle, header=header, body=10)):  # type: ignore[misc]
            def connection_made(self, transport: Any) -> None:
                super().connection_made(transport)
                accepted.set()

            def data_received(self, data: bytes) -> None:
                if data != STALL:
                    super().data_received(data)
                    return
                # The stall, inside a poll's event handling: held until the other request is in the kernel,
                # then for as long as the idle timeout (a spin on the clock, as a starved loop spends it).
                stalling.set()
                sent.wait(30)
                until = time.monotonic() + IDLE
                while time.monotonic() < until:
                    pass

        self.port = free_port()
        config = uvicorn.Config(hello, host="127.0.0.1", port=self.port, http=Stalled, loop="uvloop", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[_Server]:
    server = _Server(**getattr(request, "param", {}))
    server.thread.start()
    poll(lambda: server.server.started, 30, "uvicorn started")
    yield server
    server.sent.set()
    server.server.should_exit = True
    server.thread.join(30)


def test_a_request_sent_during_a_stall_is_answered(server: _Server) -> None:
    with server.connect() as victim:
        assert server.accepted.wait(30), "the server never accepted"
        with server.connect() as staller:
            staller.sendall(STALL)
            assert server.stalling.wait(30), "the loop never stalled"
            victim.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            server.sent.set()
            answer = b""
            while b"ok" not in answer:
                chunk = victim.recv(65536)
                assert chunk, f"closed without an answer: {answer!r}"
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 200")


def test_a_connection_that_sends_nothing_is_still_closed(server: _Server) -> None:
    with server.connect() as idle:
        assert server.accepted.wait(30), "the server never accepted"
        assert idle.recv(65536) == b""


@pytest.mark.parametrize("server", [{"idle": 30.0, "header": IDLE}], indirect=True)
def test_a_kept_alive_connection_outlives_the_header_timeout(server: _Server) -> None:
    """Between requests the keep-alive timeout applies, not the (short) one for a connection's first request:
    a client reusing its connection a few seconds later finds it open (the server closing first races the
    client's next request: 'Connection error' in the OpenAI SDK)."""
    with server.connect() as client:
        for _ in range(2):
            client.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b"ok"):
                chunk = client.recv(65536)
                assert chunk, f"closed without an answer: {answer!r}"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200")
            time.sleep(3 * IDLE)  # past the header timeout, well within the keep-alive one


def test_the_default_keep_alive_outlasts_common_clients_expiry() -> None:
    """The client must end an idle connection before the server does. httpx (under the OpenAI SDK) expires its
    idle connections after 5 s, aiohttp after 15 s: read from the installed libraries, not restated."""
    import aiohttp
    import httpx

    from gateway.settings import Settings

    async def aiohttp_default() -> float:
        connector = aiohttp.TCPConnector()
        try:
            return float(connector._keepalive_timeout)  # its default is a sentinel in the signature
        finally:
            await connector.close()

    httpx_expiry = httpx.Limits().keepalive_expiry
    aiohttp_expiry = asyncio.run(aiohttp_default())
    assert httpx_expiry is not None and aiohttp_expiry > 0
    (keep_alive,) = [f.default for f in dataclasses.fields(Settings) if f.name == "keep_alive_timeout"]
    assert isinstance(keep_alive, float) and keep_alive > max(httpx_expiry, aiohttp_expiry)
