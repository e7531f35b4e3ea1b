"""Every error path of /v1/chat/completions: exact status and OpenAI error body.

Validation errors need no engine; the gateway points at a stand-in engine (tests/stub_engine.py) where a real
vLLM cannot be made to misbehave on cue (hang, 5xx, die mid-stream). The upstream-400 path uses real vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import sqlite3
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from store import create_engine
from store.calls import rollout_calls
from store.records import CallRecord, RolloutKey
from tests.conftest import (
    GatewayProcess,
    free_port,
    gateway_on_stub,
    metric,
    poll,
    start_stub,
    stop_group,
    wait_http,
)


@pytest.fixture
def stub() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    url, proc = start_stub()
    yield url, proc
    stop_group(proc)


@pytest.fixture(scope="module")
def refusing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """One gateway (before a stand-in engine) for the tests of requests it refuses before the engine sees them:
    a refusal changes nothing, so they need no gateway of their own (each start is seconds of the suite)."""
    with gateway_on_stub(tmp_path_factory.mktemp("refusing")) as gateway:
        yield gateway


def recorded_calls(db_path: Path, rollout_id: str) -> list[CallRecord] | None:
    """The calls of a rollout as the store's own reader gives them back (whatever its on-disk layout)."""

    async def read() -> list[CallRecord] | None:
        engine = create_engine(f"sqlite+aiosqlite:///{db_path}")
        try:
            async with engine.connect() as conn:
                return await rollout_calls(conn, RolloutKey("", rollout_id))
        finally:
            await engine.dispose()

    return asyncio.run(read())


def error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


ROLLOUT = "X-ART-Rollout-Id"
RESENT = ("ServerDisconnectedError", "ClientOSError")  # gateway/proxy.py RESENDABLE, by name
CHAT = {"model": "my-agent", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_json"),
        (b'{"model": "my-agent", "messages": [{"role": "user", "content": "\xff"}]}', None, "invalid_json"),
        pytest.param(  # its own id: the body as an id is 200 kB, and pytest puts the id in PYTEST_CURRENT_TEST, an
            # environment variable every child process is then refused (E2BIG: "Argument list too long")
            b'{"model": "my-agent", "messages": [{"role": "user", "content": '
            + b"[" * 100_000
            + b"]" * 100_000
            + b"}]}",
            None,
            "invalid_json",
            id="nested-100000-deep",
        ),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "model", "missing_required_parameter"),
        (b'{"model": 7, "messages": [{"role": "user", "content": "hi"}]}', "model", "invalid_type"),
        (b'{"model": "my-agent"}', "messages", "missing_required_parameter"),
        (b'{"model": "my-agent", "messages": []}', "messages", "invalid_type"),
        (b'{"model": "my-agent", "messages": ["hi"]}', "messages[0]", "invalid_type"),
        (b'{"model": "my-agent", "messages": [{"role": "user"}], "stream": "yes"}', "stream", "invalid_type"),
        (b'{"model": "my-agent", "messages": [{"role": "user"}], "n": 0}', "n", "invalid_value"),
    ],
)
def test_invalid_requests_are_400_with_param(
    refusing: GatewayProcess, body: bytes, param: str | None, code: str
) -> None:
    gateway = refusing
    r = httpx.post(f"{gateway.base_url}/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = error(r)
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)


def test_unknown_model_and_unknown_pinned_step_are_404(refusing: GatewayProcess) -> None:
    gateway = refusing
    for model in ("nope", "my-agent@7"):
        r = httpx.post(f"{gateway.base_url}/chat/completions", json={**CHAT, "model": model})
        assert r.status_code == 404
        err = error(r)
        assert (err["param"], err["code"]) == ("model", "model_not_found")
        assert model in err["message"]


def test_oversize_body_is_413(stub, gateway_factory) -> None:
    gateway = gateway_factory("--upstream", stub[0], env={"ARTGW_MAX_BODY_BYTES": "1000"})
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(f"{gateway.base_url}/chat/completions", json=big)
    assert r.status_code == 413
    assert error(r)["code"] == "request_too_large"


def test_invalid_rollout_id_is_400(refusing: GatewayProcess) -> None:
    gateway = refusing
    r = httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT, headers={"X-ART-Rollout-Id": "bad id!"})
    assert r.status_code == 400
    assert error(r)["code"] == "invalid_rollout_id"


def test_unknown_route_and_wrong_method(refusing: GatewayProcess) -> None:
    gateway = refusing
    r = httpx.post(f"{gateway.base_url}/nope", json={})
    assert r.status_code == 404
    assert error(r) == {
        "message": "The gateway does not serve POST /v1/nope. It serves: POST /v1/chat/completions, "
        "POST /v1/completions, POST /v1/responses, GET /v1/responses/{id}, DELETE /v1/responses/{id}, "
        "GET /v1/responses/{id}/input_items, POST /v1/messages, POST /v1/messages/count_tokens, GET /v1/models, "
        "GET /v1/models/{id}, "
        "/v1/art/... (rollouts, groups, models); the inference endpoints also under /rollouts/{rollout_id}/v1/....",
        "type": "not_found_error",
        "param": None,
        "code": "unknown_endpoint",
    }
    r = httpx.get(f"{gateway.base_url}/chat/completions")
    assert r.status_code == 405
    assert error(r)["code"] == "method_not_allowed"


def test_engine_timeout_is_504_and_gateway_keeps_serving(gateway_factory) -> None:
    # The engine does answer, 200, but only after 5 s: a 504 shows the gateway's own 1 s timeout cut in first.
    url, proc = start_stub("--delay", "5")
    try:
        gateway = gateway_factory("--upstream", url, "--request-timeout", "1")
        headers = {"X-ART-Rollout-Id": "timeout-1"}
        r = httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT, headers=headers, timeout=30)
        assert r.status_code == 504
        assert error(r)["code"] == "upstream_timeout"
        assert httpx.get(f"{gateway.url}/healthz").status_code == 200
        (call,) = httpx.get(f"{gateway.base_url}/art/rollouts/timeout-1", headers=gateway.admin).json()["calls"]
        assert call["status"] == "upstream_error" and call["finish_reasons"] == []
        assert call["error"] == "The engine did not answer in time. (SocketTimeoutError)"  # read, not connect
    finally:
        stop_group(proc)


def test_engine_5xx_is_502(gateway_factory) -> None:
    url, proc = start_stub("--status", "500")
    try:
        gateway = gateway_factory("--upstream", url)
        r = httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT)
        assert r.status_code == 502
        err = error(r)
        assert err["code"] == "upstream_error"
        assert "engine exploded" in err["message"]
    finally:
        stop_group(proc)


def test_engine_down_is_502_then_readyz_503_and_gateway_lives(gateway_factory) -> None:
    url, proc = start_stub()
    gateway = gateway_factory("--upstream", url)
    assert httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT).status_code == 200
    stop_group(proc)
    r = httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT)
    assert r.status_code == 502
    assert error(r)["code"] == "upstream_unreachable"
    assert httpx.get(f"{gateway.url}/readyz").status_code == 503
    assert httpx.get(f"{gateway.url}/healthz").status_code == 200


class CuttingRelay:
    """A TCP relay in front of the stand-in engine that resets the connection of the next `cuts` chat requests as
    soon as their bytes arrive, before any answer: what a kept-alive connection the engine closes under a send, or
    a burst's reset, looks like to the gateway (seen in CI as 502s at the start of a 300-call burst)."""

    def __init__(self, target: str, cuts: int) -> None:
        self.target_port = int(target.rsplit(":", 1)[1])
        self.cuts, self.cut = cuts, 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _listen(self) -> None:
        # Port 0, held from the start: a port chosen free and bound later could be taken meanwhile (or chosen
        # by another test's engine in between: seen in CI, where a gateway's engine port met this relay).
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        engine_reader, engine_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cutting: bool) -> None:
            try:
                while data := await reader.read(65536):
                    if cutting and b"POST /v1/chat/completions HTTP" in data and self.cut < self.cuts:
                        self.cut += 1
                        sock = client_writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # an RST
                        client_writer.transport.abort()
                        engine_writer.transport.abort()
                        return
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

        with contextlib.suppress(asyncio.CancelledError):  # the relay closing
            await asyncio.gather(pipe(client_reader, engine_writer, True), pipe(engine_reader, client_writer, False))

    async def _close(self) -> None:
        self.server.close()
        relays = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in relays:
            task.cancel()
        await asyncio.gather(*relays, return_exceptions=True)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_connection_cut_before_the_answer_is_sent_again_and_recorded_once(gateway_factory, stub, stream) -> None:
    relay = CuttingRelay(stub[0], cuts=2)  # two cuts in a row: the third send answers
    try:
        gateway = gateway_factory("--upstream", relay.url)
        headers = {ROLLOUT: f"cut-{stream}"}
        with httpx.stream(
            "POST", f"{gateway.base_url}/chat/completions", json={**CHAT, "stream": stream}, headers=headers
        ) as r:
            assert r.status_code == 200, r.read()
            text = r.read().decode()
        assert relay.cut == 2
        assert ('"content":"t"' in text and text.rstrip().endswith("[DONE]")) if stream else json.loads(text)["id"], (
            text
        )
        resends = {error: metric(gateway.url, "artgw_engine_resends_total", error=error) for error in RESENT}
        assert sum(resends.values()) == 2, resends
        gateway.stop()  # flushes the recorder
        (call,) = recorded_calls(gateway.db_path, f"cut-{stream}")
        assert call.status == "ok"
    finally:
        relay.close()


def test_a_connection_cut_every_time_is_502_recorded_once(gateway_factory, stub) -> None:
    relay = CuttingRelay(stub[0], cuts=1_000)
    try:
        gateway = gateway_factory("--upstream", relay.url)
        r = httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT, headers={ROLLOUT: "cut-always"})
        assert r.status_code == 502
        assert error(r)["code"] == "upstream_unreachable"
        assert relay.cut == 3  # sent three times, then given up
        gateway.stop()
        (call,) = recorded_calls(gateway.db_path, "cut-always")
        assert call.status == "upstream_error"
    finally:
        relay.close()


def test_engine_not_yet_up_is_503(gateway_factory) -> None:
    port = free_port()  # nothing listens here yet
    gateway = gateway_factory("--upstream", f"http://127.0.0.1:{port}", wait=False)
    wait_http(f"{gateway.url}/healthz", 30, gateway.proc)
    r = httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT)
    assert r.status_code == 503
    assert error(r)["code"] == "engine_unavailable"
    assert httpx.get(f"{gateway.url}/readyz").status_code == 503


@pytest.mark.parametrize("how", ["--die-mid-stream", "--end-stream-early"])
def test_engine_dying_mid_stream_ends_the_stream_with_an_error_event(gateway_factory, how: str) -> None:
    url, proc = start_stub(how)
    try:
        gateway = gateway_factory("--upstream", url)
        with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"content":"o"' in events[0]
        assert '"code":"upstream_error"' in events[-1] and len(events) == 2  # and no [DONE]
        assert httpx.get(f"{gateway.url}/healthz").status_code == 200
        gateway.stop()  # flushes the recorder
        with sqlite3.connect(gateway.db_path) as db:
            assert db.execute("SELECT status, http_status FROM calls").fetchall() == [("upstream_error", 200)]
    finally:
        stop_group(proc)


# What the gateway says of each garbled answer (engine/answers.py): where the answer is not what vLLM sends.
GARBLED = {
    "bad-line": "JSON is malformed: object keys must be strings (byte 1)",
    "no-logprob": "Object missing required field `logprob` - at `$.choices[0].logprobs.content[0]`",
    # Not an error before the answers were read typed: the text was recorded as the sampled token ids.
    "text-ids": "Expected `int`, got `str` - at `$.choices[0].token_ids[0]`",
}


@pytest.mark.parametrize("garbled", GARBLED)
def test_an_engine_answer_the_gateway_cannot_read_is_an_upstream_error(gateway_factory, garbled: str) -> None:
    """A line that is not JSON, a logprobs entry without `logprob`, token ids that are not ints: streamed, the
    stream ends there with an error event saying what was wrong (no [DONE], nothing after it relayed); not
    streamed, a 502 saying it. Both recorded `upstream_error`, with the same reason."""
    url, proc = start_stub("--garbled", garbled)
    why = GARBLED[garbled]
    try:
        gateway = gateway_factory("--upstream", url)
        headers = {"X-ART-Rollout-Id": f"garbled-{garbled}"}
        body = {**CHAT, "stream": True}
        with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert len(events) == 2 and '"content":"o"' in events[0]
        assert json.loads(events[1][6:]) == {
            "error": {
                "message": f"The engine sent an event the gateway cannot read: {why}",
                "type": "server_error",
                "param": None,
                "code": "upstream_error",
            }
        }
        r = httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT, headers={"X-ART-Rollout-Id": "plain"})
        assert r.status_code == 502
        assert error(r) == {
            "message": f"The engine sent an unreadable answer: {why}",
            "type": "server_error",
            "param": None,
            "code": "upstream_error",
        }
        assert httpx.get(f"{gateway.url}/healthz").status_code == 200
        gateway.stop()  # flushes the recorder
        for rollout_id, http_status, what in ((f"garbled-{garbled}", 200, "event"), ("plain", 502, "answer")):
            (call,) = recorded_calls(gateway.db_path, rollout_id) or []
            assert (call.status, call.http_status) == ("upstream_error", http_status)
            assert call.error == f"unreadable engine {what}: {why}"
    finally:
        stop_group(proc)


def test_client_hangup_mid_stream_closes_the_engine_stream_and_is_recorded_cancelled(gateway_factory) -> None:
    url, proc = start_stub("--endless-stream")
    try:
        gateway = gateway_factory("--upstream", url)
        headers = {"X-ART-Rollout-Id": "hangup-1"}
        body = {**CHAT, "stream": True}
        with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=body, headers=headers) as r:
            lines = r.iter_lines()
            assert sum(1 for line in itertools.islice(lines, 6) if line.startswith("data: ")) == 3
        # The engine's stream is endless: only the gateway's hang-up ends it, so it ends within any bound or never.
        poll(
            lambda: httpx.get(f"{url}/stats").json()["streams_aborted"], 60, "the engine's stream to close", every=0.05
        )
        assert httpx.get(f"{url}/stats").json() == {"streams_started": 1, "streams_aborted": 1, "requests_aborted": 0}
        rollout = httpx.get(f"{gateway.base_url}/art/rollouts/hangup-1", headers=gateway.admin).json()
        (call,) = rollout["calls"]
        assert call["status"] == "cancelled" and call["stream"]
        assert rollout["sequences"] == []  # a cancelled call is kept but never trained
        # What the engine had sent before the hang-up is recorded (a token every 20 ms: a few, not hundreds).
        (record,) = recorded_calls(gateway.db_path, "hangup-1")
        assert (record.status, record.http_status) == ("cancelled", 499)
        assert 3 <= len(record.choices[0].token_ids) < 100
    finally:
        stop_group(proc)


def test_client_hangup_before_a_plain_answer_aborts_the_engine_request_and_is_recorded_cancelled(
    gateway_factory,
) -> None:
    """A non-streamed call: nothing is sent while the engine works, so only the connection tells that the client
    left. The gateway must close the engine's request then (vLLM aborts it) and record the call `cancelled`,
    not `ok` once the engine answers."""
    url, proc = start_stub("--delay", "30")
    try:
        gateway = gateway_factory("--upstream", url)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT, headers={ROLLOUT: "hangup-plain"}, timeout=1)
        poll(
            lambda: httpx.get(f"{url}/stats").json()["requests_aborted"], 5, "the engine's request to close", every=0.05
        )
        rollout = poll(
            lambda: (
                (r := httpx.get(f"{gateway.base_url}/art/rollouts/hangup-plain", headers=gateway.admin)).status_code
                == 200
                and r.json()
            ),
            10,
            "the cancelled call to be recorded",
        )
        (call,) = rollout["calls"]
        assert (call["status"], call["stream"]) == ("cancelled", False)
        assert rollout["sequences"] == []  # kept, never trained
        gateway.stop()
        (record,) = recorded_calls(gateway.db_path, "hangup-plain") or []
        assert (record.status, record.http_status, record.choices) == ("cancelled", 499, [])
    finally:
        stop_group(proc)


def test_a_plain_answer_is_recorded_ok_when_the_client_stays(stub, gateway_factory) -> None:
    """The hang-up watch must not cut in on a call whose client stays: answered and recorded `ok`, once."""
    url, _ = stub
    gateway = gateway_factory("--upstream", url)
    for i in range(20):
        r = httpx.post(f"{gateway.base_url}/chat/completions", json=CHAT, headers={ROLLOUT: f"stay-{i}"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    gateway.stop()
    for i in range(20):
        (record,) = recorded_calls(gateway.db_path, f"stay-{i}") or []
        assert (record.status, record.http_status, record.choices[0].token_ids) == ("ok", 200, [7])


@pytest.mark.engine
def test_engine_400_passes_through_in_openai_shape(engine_gateway) -> None:
    r = httpx.post(f"{engine_gateway.base_url}/chat/completions", json={**CHAT, "max_tokens": -1})
    assert r.status_code == 400
    err = error(r)
    assert (err["type"], err["param"]) == ("invalid_request_error", "max_tokens")
