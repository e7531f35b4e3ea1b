"""uvicorn's HTTP/1.1 protocol with the read timeouts and the head size bound it lacks: a connection can't be
held forever, nor its headers fill memory (a head over `max_head_bytes` gets a 431 and the connection closes).
The head bound holds however the head arrives: counted from the raw bytes while a head is incomplete (a header
that never ends), and from the parsed request line and headers as the parser hands them over (a whole head in
one read, which the app would otherwise be started for).

uvicorn closes a keep-alive connection that sits idle after a response (`timeout_keep_alive`), but it has no
timeout for a connection that never sends a request, for a request head that trickles in (slowloris), or
for a body that does. This subclass of its httptools protocol (the one `uvicorn[standard]` runs) adds them,
below the ASGI app, so the app and the data path are untouched:

- idle: from the end of a response until the first byte of the next request (uvicorn's keep-alive timer covers
  it only until any byte arrives, even one that starts nothing). Longer than the keep-alive expiry of common
  clients (httpx, which the OpenAI SDK runs on: 5 s; Node's undici: 4 s; aiohttp: 15 s) so the client, not the
  server, ends an idle connection: a server that closes first races the client's next request on it, which
  then fails with no response ('Connection error' in the OpenAI SDK; a CI flake at 5 s against httpx's 5 s);
- header: from connect, or from the first byte of a later request, until its head is complete;
- body: from the end of the head until the last byte of the body: a total, not a gap between reads, so a
  client trickling a byte now and then can't hold the connection either.

A deadline found past is confirmed once more after the loop's next poll of its sockets: a stalled loop must
not cut off a client whose bytes arrived in time but were not read yet. Past one of them the connection is
closed; a request cut off in its head or body (and not yet answered) gets
a 408 in OpenAI's error shape first. Cost on the data path: each request moves a deadline (a float); a timer
is only re-armed when none is pending or the new deadline is earlier than the pending one, so a busy
keep-alive connection arms about one timer per timeout period, not one per request.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, ClassVar

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.asgi import HANG_UP, HangUp

log = logging.getLogger("artgw.gateway")

# What the connection is waiting for; `_NOTHING` while the app handles a request (a response may stream for
# as long as the engine takes: that is --request-timeout's business, not a read timeout's).
_NOTHING, _IDLE, _HEAD, _BODY = range(4)
# A timer this far ahead runs on the loop's next turn, after its poll (libuv runs the timers due when a turn
# starts; a zero delay could run in the same pass).
_AFTER_POLL = 0.001


def _error_response(status: bytes, message: str, code: str) -> bytes:
    """A whole response in OpenAI's error shape, sent below the app, before closing the connection."""
    body = msgspec.json.encode(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    )
    head = (
        b"HTTP/1.1 " + status + b"\r\n"
        b"content-type: application/json\r\n"
        b"connection: close\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    return head + body


def _timeout_response(message: str) -> bytes:
    return _error_response(b"408 Request Timeout", message, "request_timeout")


class TimedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol plus idle, header and body timeouts (class attributes: see `timed_protocol`)."""

    idle_timeout: ClassVar[float] = 75.0
    header_timeout: ClassVar[float] = 10.0
    body_timeout: ClassVar[float] = 60.0
    max_head_bytes: ClassVar[int] = 64 << 10

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's own keep-alive timer (after a response) then uses the same idle timeout as ours.
        self.timeout_keep_alive = self.idle_timeout  # type: ignore[assignment]
        self._phase = _NOTHING
        self._deadline = math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._head_bytes = 0  # raw bytes of the request head being received, while it is incomplete
        self._head_parsed = 0  # bytes of its URL and headers the parser has handed over
        self._head_refused = False  # a 431 was sent: the parser's callbacks for the rest of the read do nothing

    # ------------------------------------------------------------ deadlines

    def _expect(self, phase: int, seconds: float) -> None:
        self._phase = phase
        deadline = self.loop.time() + seconds
        self._deadline = deadline
        # A pending timer that fires no later than the new deadline re-checks then (see _expired).
        if deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(deadline, self._expired)
            self._timer_at = deadline

    def _expired(self, after_poll: bool = False) -> None:
        self._timer, self._timer_at = None, math.inf
        if self._phase == _NOTHING or self.transport.is_closing():
            return
        if self.loop.time() < self._deadline:  # the deadline moved on since this timer was armed
            self._timer = self.loop.call_at(self._deadline, self._expired)
            self._timer_at = self._deadline
            return
        if not after_poll:
            # uvloop runs due timers before it polls sockets: after a stall (a starved or busy loop), bytes the
            # client sent in time may still sit unread in the kernel. Decide after the next poll has read them.
            self._timer = self.loop.call_later(_AFTER_POLL, self._expired, True)
            self._timer_at = self.loop.time() + _AFTER_POLL
            return
        phase, self._phase = self._phase, _NOTHING
        # No response of ours in the middle of one the app is sending (a pipelined request's head).
        answering = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        if phase == _HEAD and not answering:
            self.transport.write(_timeout_response(f"Request head not received within {self.header_timeout:g} s."))
        elif phase == _BODY and self.cycle is not None and not self.cycle.response_started:
            self.transport.write(_timeout_response(f"Request body not received within {self.body_timeout:g} s."))
        log.debug("closing %s: %s timeout", self.client, ("", "idle", "header", "body")[phase])
        # The app, if one is waiting for the body, gets http.disconnect (uvicorn's connection_lost).
        self.transport.close()

    # ------------------------------------------------------------ uvicorn's hooks

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # A connection that has sent nothing yet is a first request head that has not arrived: the header
        # timeout, not the keep-alive one (closed without a 408: there is no request to answer).
        self._expect(_IDLE, self.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            hang_up = self.cycle.scope.get(HANG_UP)
            if isinstance(hang_up, HangUp):
                hang_up.fire()
        self._phase = _NOTHING
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        self._phase = _NOTHING  # the WebSocket protocol owns the connection from here
        super().handle_websocket_upgrade()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # A head still incomplete after these bytes: bounded, as its headers pile up in memory until it ends.
        if self._phase == _HEAD:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse_head()

    def _refuse_head(self) -> None:
        """A 431 and the connection closes (no response of ours in the middle of one the app is sending)."""
        if self._head_refused or self.transport.is_closing():
            return
        self._head_refused = True
        self._phase = _NOTHING
        if self.cycle is None or not self.cycle.response_started or self.cycle.response_complete:
            message = f"Request head over {self.max_head_bytes} bytes (request line and headers)."
            self.transport.write(_error_response(b"431 Request Header Fields Too Large", message, "header_too_large"))
        self.transport.close()

    def on_message_begin(self) -> None:
        self._head_bytes = self._head_parsed = 0
        super().on_message_begin()
        self.scope[HANG_UP] = HangUp()  # type: ignore[literal-required]  # read by gateway/proxy.py
        self._expect(_HEAD, self.header_timeout)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._head_parsed += len(url)
        if self._head_parsed > self.max_head_bytes:
            self._refuse_head()

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._head_parsed += len(name) + len(value) + 4  # ": " and CRLF
        if self._head_parsed > self.max_head_bytes:
            self._refuse_head()

    def on_headers_complete(self) -> None:
        if self._head_refused:  # the app is never started for a refused head
            return
        super().on_headers_complete()
        self._expect(_BODY, self.body_timeout)

    def on_body(self, body: bytes) -> None:
        if not self._head_refused:  # uvicorn's would read a request cycle the refused head never had
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._head_refused:
            return
        self._phase = _NOTHING  # before super(): it returns early when the app already answered
        super().on_message_complete()

    def on_response_complete(self) -> None:
        idle = not self.pipeline  # else super() starts the next request, already received
        super().on_response_complete()
        # uvicorn arms its keep-alive timer here too, but cancels it on any byte received, and bytes that
        # start no request (blank lines) would then hold the connection with no timer at all.
        if idle and self._phase == _NOTHING and not self.transport.is_closing():
            self._expect(_IDLE, self.idle_timeout)


def timed_protocol(*, idle: float, header: float, body: float, head_bytes: int = 64 << 10) -> type[TimedHttpProtocol]:
    """The protocol class to give uvicorn (`http=`), with these timeouts in seconds and this bound on a request's
    head (request line and headers; past it a 431)."""
    return type(
        "TimedHttpProtocol",
        (TimedHttpProtocol,),
        {"idle_timeout": idle, "header_timeout": header, "body_timeout": body, "max_head_bytes": head_bytes},
    )
