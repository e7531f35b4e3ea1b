"""The webhook grader against a real HTTP server: an aiohttp app on a free loopback port, in this process,
answering each request from a script (a reply, a 5xx, a 4xx, or a wait longer than the grader's timeout).
Nothing of httpx is mocked: the grader's own client posts to the server over TCP.

Retries are checked by counting the requests the server received, never by timing.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
from aiohttp import web

from gateway.promotion.graders import (
    Answer,
    EvalScenario,
    GraderFailed,
    ToolCall,
    WebhookGrader,
    grade,
    masked_url,
)

HANG = "hang"  # a script step: answer only when the test ends, long after any grader's timeout

MESSAGES = [
    {"role": "system", "content": "Report whether the motion passed."},
    {"role": "user", "content": 'Did the motion "museum" pass?'},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "report",
            "parameters": {"type": "object", "properties": {"passed": {"enum": ["yes", "no"]}}},
        },
    }
]
ANSWER = Answer(
    content="Checking.",
    tool_calls=[ToolCall(name="report", arguments='{"passed": "no"}')],
    finish_reason="tool_calls",
)


class RewardServer:
    """The user's reward function: records every request, answers the n-th from `script[n]` (the last step
    repeats). A step is `(status, body)` or `HANG`."""

    def __init__(self) -> None:
        self.script: list[tuple[int, bytes] | str] = [(200, b'{"reward": 1.0}')]
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.released = asyncio.Event()
        self.url = ""

    def answers(self, *steps: tuple[int, Any] | str) -> None:
        self.script = [s if isinstance(s, str) else (s[0], _body(s[1])) for s in steps]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(msgspec.json.decode(await request.read()))
        self.headers.append(dict(request.headers))
        step = self.script[min(len(self.requests), len(self.script)) - 1]
        if step == HANG:
            await self.released.wait()
            return web.json_response({"reward": 1.0})
        status, body = step
        return web.Response(status=status, body=body, content_type="application/json")


def _body(value: Any) -> bytes:
    return value if isinstance(value, bytes) else msgspec.json.encode(value)


@pytest.fixture
async def server() -> AsyncIterator[RewardServer]:
    hook = RewardServer()
    app = web.Application()
    app.router.add_post("/reward", hook.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    hook.url = f"http://127.0.0.1:{sock.getsockname()[1]}/reward"
    try:
        yield hook
    finally:
        hook.released.set()  # lets hanging handlers finish, so cleanup does not wait on them
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False) as client:  # no proxy from the environment for loopback
        yield client


async def grade_with(
    spec: WebhookGrader, http: httpx.AsyncClient, *, metadata: dict[str, Any] | None = None, index: int = 0
) -> float:
    scenario = EvalScenario(messages=MESSAGES, tools=TOOLS, grader=spec, metadata=metadata)
    return await grade(spec, scenario, ANSWER, http, index=index)


async def test_reward_is_read_back_and_the_transcript_posted(server: RewardServer, http: httpx.AsyncClient) -> None:
    server.answers((200, {"reward": 0.75, "explanation": "right verdict"}))  # other fields are ignored
    spec = WebhookGrader(url=server.url, headers={"Authorization": "Bearer s3cret-key"})
    assert await grade_with(spec, http, metadata={"motion": "museum", "correct": "no"}, index=7) == 0.75

    assert server.requests == [
        {
            "scenario": 7,
            "messages": MESSAGES,
            "tools": TOOLS,
            "answer": {
                "content": "Checking.",
                "tool_calls": [{"name": "report", "arguments": '{"passed": "no"}'}],
                "finish_reason": "tool_calls",
            },
            "metadata": {"motion": "museum", "correct": "no"},
        }
    ]
    assert server.headers[0]["Authorization"] == "Bearer s3cret-key"
    assert server.headers[0]["Content-Type"] == "application/json"


async def test_tools_and_metadata_absent_are_null(server: RewardServer, http: httpx.AsyncClient) -> None:
    spec = WebhookGrader(url=server.url)
    scenario = EvalScenario(messages=MESSAGES, grader=spec)
    assert await grade(spec, scenario, Answer(content=None), http, index=0) == 1.0
    request = server.requests[0]
    assert request["tools"] is None and request["metadata"] is None
    assert request["answer"] == {"content": None, "tool_calls": [], "finish_reason": None}


@pytest.mark.parametrize(("reply", "expected"), [(1, 1.0), (0, 0.0), (-2.5, -2.5), (3.5, 3.5)])
async def test_reward_is_given_as_is_not_clamped(
    server: RewardServer, http: httpx.AsyncClient, reply: float, expected: float
) -> None:
    server.answers((200, {"reward": reply}))
    assert await grade_with(WebhookGrader(url=server.url), http) == expected


async def test_500_twice_then_200_is_retried(server: RewardServer, http: httpx.AsyncClient) -> None:
    server.answers((500, b"boom"), (503, b"busy"), (200, {"reward": 0.5}))
    assert await grade_with(WebhookGrader(url=server.url, retries=2), http) == 0.5
    assert len(server.requests) == 3
    assert server.requests[0] == server.requests[2]  # the same body each time


async def test_always_500_fails_after_retries_plus_one(server: RewardServer, http: httpx.AsyncClient) -> None:
    server.answers((500, b"boom"))
    spec = WebhookGrader(url=server.url + "?token=hidden", retries=2)
    with pytest.raises(GraderFailed) as caught:
        await grade_with(spec, http)
    assert len(server.requests) == 3
    message = str(caught.value)
    assert message == f"webhook {server.url} failed after 3 attempts: HTTP 500"
    assert "hidden" not in message  # the query (it may hold a secret) is not shown


async def test_no_retries_means_one_attempt(server: RewardServer, http: httpx.AsyncClient) -> None:
    server.answers((502, b""))
    with pytest.raises(GraderFailed, match="failed after 1 attempt: HTTP 502"):
        await grade_with(WebhookGrader(url=server.url, retries=0), http)
    assert len(server.requests) == 1


async def test_a_hanging_server_times_out_on_each_attempt(server: RewardServer, http: httpx.AsyncClient) -> None:
    server.answers(HANG)
    spec = WebhookGrader(url=server.url, timeout_seconds=0.5, retries=1)
    with pytest.raises(GraderFailed) as caught:
        await grade_with(spec, http)
    assert str(caught.value) == f"webhook {server.url} failed after 2 attempts: timed out after 0.5 s"
    assert len(server.requests) == 2  # each attempt gave up at its timeout and the next one was made


async def test_a_timeout_then_an_answer_succeeds(server: RewardServer, http: httpx.AsyncClient) -> None:
    server.answers(HANG, (200, {"reward": 0.25}))
    spec = WebhookGrader(url=server.url, timeout_seconds=0.5, retries=1)
    assert await grade_with(spec, http) == 0.25
    assert len(server.requests) == 2


async def test_a_4xx_is_not_retried(
    server: RewardServer, http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    server.answers((400, {"error": "unknown scenario"}), (200, {"reward": 1.0}))
    with pytest.raises(GraderFailed) as caught:
        await grade_with(WebhookGrader(url=server.url, retries=3), http)
    assert len(server.requests) == 1
    message = str(caught.value)
    assert message.startswith(f"webhook {server.url} failed after 1 attempt: HTTP 400 (not retried")
    # The reply's text is the admin's to read, in the log: the error is shown to every `read` key of the model.
    assert "unknown scenario" not in message
    assert "unknown scenario" in caplog.text


def test_a_webhook_url_is_shown_without_its_secrets() -> None:
    assert masked_url("https://svc:hunter2@grader.example:8443/reward?token=abc#x") == (
        "https://***@grader.example:8443/reward?***#***"
    )
    assert masked_url("http://127.0.0.1:9000/reward") == "http://127.0.0.1:9000/reward"


async def test_a_redirect_is_not_followed(server: RewardServer, http: httpx.AsyncClient) -> None:
    server.answers((307, b""))
    with pytest.raises(GraderFailed, match=r"HTTP 307 \(redirects are not followed;"):
        await grade_with(WebhookGrader(url=server.url), http)
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"reward": "high"}, "Expected `float`, got `str` - at `$.reward`"),
        ({"reward": True}, "Expected `float`, got `bool` - at `$.reward`"),
        ({"reward": None}, "Expected `float`, got `null` - at `$.reward`"),
        ({"score": 1.0}, "missing required field `reward`"),
        ([1.0], "Expected `object`, got `array`"),
        (b'{"reward": 1e999}', "Number out of range - at `$.reward`"),  # not finite
        (b"reward=1", "JSON is malformed"),
        (b"", "truncated"),
    ],
)
async def test_a_reply_without_a_finite_number_reward_fails_without_retry(
    server: RewardServer, http: httpx.AsyncClient, body: Any, problem: str
) -> None:
    server.answers((200, body), (200, {"reward": 1.0}))
    with pytest.raises(GraderFailed) as caught:
        await grade_with(WebhookGrader(url=server.url, retries=2), http)
    assert len(server.requests) == 1
    message = str(caught.value)
    assert message.startswith(f"webhook {server.url} failed after 1 attempt: bad reply: ")
    assert problem in message and '(expected {"reward": <number>})' in message
    assert "\n" not in message


async def test_an_oversized_reply_fails(server: RewardServer, http: httpx.AsyncClient) -> None:
    server.answers((200, b'{"reward": 1.0, "pad": "' + b"x" * (2 << 20) + b'"}'))
    with pytest.raises(GraderFailed, match="the reply is over 1048576 bytes"):
        await grade_with(WebhookGrader(url=server.url), http)


async def test_connection_refused_is_retried_then_fails(http: httpx.AsyncClient) -> None:
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/reward"
    with pytest.raises(GraderFailed) as caught:
        await grade_with(WebhookGrader(url=url, retries=1), http)
    assert str(caught.value).startswith(f"webhook {url} failed after 2 attempts: ConnectError: ")
