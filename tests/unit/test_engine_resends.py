"""Which sends to the engine go out again (gateway/proxy.py EngineCalls._send): one the engine cut before any
answer (RESENDABLE), up to ENGINE_SENDS sends in all, each resend counted by its error; a refused connect (the
engine is down), any other error and a cancellation go to the caller at once. The engine here is a script of what
each send meets; tests/integration/test_errors.py cuts real connections."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from gateway.proxy import ENGINE_SENDS, EngineCalls

Step = Callable[[], BaseException] | str


def cut() -> BaseException:
    return aiohttp.ServerDisconnectedError()


def reset() -> BaseException:
    return aiohttp.ClientOSError(104, "Connection reset by peer")


def refused() -> BaseException:
    key = SimpleNamespace(ssl=None, host="127.0.0.1", port=1)
    return aiohttp.ClientConnectorError(key, OSError(111, "Connection refused"))


def cancelled() -> BaseException:
    return asyncio.CancelledError()


def broken() -> BaseException:
    return ValueError("not a send error")


async def send_through(script: list[Step]) -> tuple[str, int, list[str]]:
    """(the answer or the error's name, how many sends went out, the resends counted)."""
    sends: list[int] = []
    resent: list[str] = []

    async def post(url: str, **kwargs: Any) -> str:
        sends.append(1)
        step = script[len(sends) - 1]
        if isinstance(step, str):
            return step
        raise step()

    engine = object.__new__(EngineCalls)
    engine.session = SimpleNamespace(post=post)
    engine.timeout = aiohttp.ClientTimeout()
    engine.metrics = SimpleNamespace(engine_resent=lambda model, error: resent.append(error))
    call = SimpleNamespace(engine_headers={}, label="m", engine=SimpleNamespace(url="http://engine"))
    try:
        outcome = str(await engine._send(call, "/v1/chat/completions", b"{}"))
    except BaseException as exc:
        outcome = type(exc).__name__
    return outcome, len(sends), resent


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (["answer"], ("answer", 1, [])),
        ([cut, "answer"], ("answer", 2, ["ServerDisconnectedError"])),
        ([reset, cut, "answer"], ("answer", 3, ["ClientOSError", "ServerDisconnectedError"])),
        ([cut, cut, cut, "answer"], ("ServerDisconnectedError", 3, ["ServerDisconnectedError"] * 2)),
        ([cut, reset, reset], ("ClientOSError", 3, ["ServerDisconnectedError", "ClientOSError"])),
        ([refused, "answer"], ("ClientConnectorError", 1, [])),
        ([cut, refused, "answer"], ("ClientConnectorError", 2, ["ServerDisconnectedError"])),
        ([cut, broken, "answer"], ("ValueError", 2, ["ServerDisconnectedError"])),
        ([cancelled, "answer"], ("CancelledError", 1, [])),
        ([cut, cancelled, "answer"], ("CancelledError", 2, ["ServerDisconnectedError"])),
    ],
)
async def test_what_is_sent_again(script: list[Step], expected: tuple[str, int, list[str]]) -> None:
    assert ENGINE_SENDS == 3  # the table counts three sends
    assert await send_through(script) == expected
