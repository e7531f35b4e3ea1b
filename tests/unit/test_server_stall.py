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

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from gateway.server import timed_protocol
from tests.conftest import free_port, poll

IDLE = 1.0  # seconds: the idle timeout; the stall outlasts it
STALL = b"STALL"  # what the second connection sends to stall the loop


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class _Server:
    def __init__(self) -> None:
        self.accepted = threading.Event()  # the server has accepted a connection
        self.stalling = threading.Event()  # the loop is held
        self.sent = threading.Event()  # the client has sent its request
        accepted, stalling, sent = self.accepted, self.stalling, self.sent

        class Stalled(timed_protocol(idle=IDLE, header=10, body=10)):  # type: ignore[misc]
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
def server() -> Iterator[_Server]:
    server = _Server()
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
