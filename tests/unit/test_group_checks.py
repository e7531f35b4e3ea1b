"""Rule checks beside the judge (gateway/groups/checks.py): the graders on a rollout's final answer, and what
a failed check does to the judge's score."""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import msgspec
import pytest

from gateway.groups.checks import WEBHOOK_FAILED, GroupCheck, checked_reward, final_answer, run_checks
from store.groups import CheckOutcome

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ASK = {"role": "user", "content": "Where to? Answer as JSON."}


def checks(*specs: dict[str, Any]) -> list[GroupCheck]:
    return msgspec.convert(list(specs), list[GroupCheck])


def anywhere(_url: str) -> bool:
    return True


def outcome(passed: bool, on_fail: str = "zero", weight: float = 0.0) -> CheckOutcome:
    return CheckOutcome("exact", passed, on_fail, weight)  # type: ignore[arg-type]  # both Literal values


def test_a_failed_hard_check_zeroes_and_a_soft_one_subtracts() -> None:
    assert checked_reward(0.9, [outcome(True), outcome(True, "subtract", 0.3)]) == 0.9
    assert checked_reward(0.9, [outcome(False), outcome(True, "subtract", 0.3)]) == 0.0
    assert checked_reward(0.9, [outcome(False, "subtract", 0.25), outcome(False, "subtract", 0.5)]) == pytest.approx(
        0.15
    )
    assert checked_reward(0.2, [outcome(False, "subtract", 0.5)]) == 0.0  # never below 0
    assert checked_reward(0.7, []) == 0.7


async def test_each_grader_reads_the_last_assistant_message() -> None:
    group_checks = checks(
        {"grader": {"type": "json_schema", "schema": SCHEMA}},
        {"grader": {"type": "regex", "pattern": "(?i)paris"}, "on_fail": "subtract", "weight": 0.2},
        {"grader": {"type": "exact", "value": '{"city": "Paris"}'}},
        {"grader": {"type": "tool_call", "name": "book"}, "on_fail": "subtract", "weight": 0.1},
    )
    good = [ASK, {"role": "assistant", "content": "thinking"}, {"role": "assistant", "content": '{"city": "Paris"}'}]
    bad = [ASK, {"role": "assistant", "content": '{"city": "Paris"}'}, {"role": "assistant", "content": "Rome?"}]
    async with httpx.AsyncClient() as http:
        passed = await run_checks(group_checks, good, None, http, anywhere, index=0)
        failed = await run_checks(group_checks, bad, None, http, anywhere, index=1)
    assert [(o.check, o.passed) for o in passed] == [
        ("json_schema", True),
        ("regex", True),
        ("exact", True),
        ("tool_call", False),
    ]
    assert [o.passed for o in failed] == [False, False, False, False]
    assert checked_reward(0.8, passed) == pytest.approx(0.7)  # only the soft tool-call check failed
    assert checked_reward(0.8, failed) == 0.0


async def test_a_check_that_cannot_run_fails_and_says_only_that(caplog: pytest.LogCaptureFixture) -> None:
    """Any `read` key sees a check's error: it says the webhook failed, never where or how (a refused connection
    told from a 401 maps the network behind the gateway, #40); the log keeps the why."""
    with socket.socket() as held:  # a port nothing answers on: bound, never listening
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}/reward"
        group_checks = checks({"grader": {"type": "webhook", "url": url, "retries": 0, "timeout_seconds": 2}})
        async with httpx.AsyncClient() as http:
            answered = [ASK, {"role": "assistant", "content": "x"}]
            with caplog.at_level(logging.WARNING, logger="artgw.groups"):
                (result,) = await run_checks(group_checks, answered, None, http, anywhere, index=0)
    assert (result.check, result.passed, result.on_fail) == ("webhook", False, "zero")
    assert result.error == WEBHOOK_FAILED
    assert "ConnectError" in caplog.text and url in caplog.text


async def test_a_webhook_the_operator_does_not_allow_is_never_posted() -> None:
    """A group stored before its webhook's endpoint was allowed (or after it no longer is) is checked without
    the POST: the check fails, and the listener on 127.0.0.1 gets nothing."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(self.path)
            self.send_response(200)
            self.send_header("content-length", "13")
            self.end_headers()
            self.wfile.write(b'{"reward": 1}')

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/reward"
        group_checks = checks({"grader": {"type": "webhook", "url": url, "retries": 0}})
        answered = [ASK, {"role": "assistant", "content": "x"}]
        async with httpx.AsyncClient() as http:
            (allowed,) = await run_checks(group_checks, answered, None, http, anywhere, index=0)
            (refused,) = await run_checks(group_checks, answered, None, http, lambda _: False, index=0)
    finally:
        server.shutdown()
        server.server_close()
    assert allowed.passed and seen == ["/reward"]  # the same listener, reached when allowed
    assert (refused.passed, refused.error) == (False, WEBHOOK_FAILED)


def test_final_answer_of_a_rollout_without_one() -> None:
    assert final_answer([ASK]).content is None and final_answer([ASK]).tool_calls == []
    called = final_answer([ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "book", "arguments": "{}"}}]}])  # fmt: skip
    assert [c.name for c in called.tool_calls] == ["book"]


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"grader": {"type": "exact", "value": "x"}, "on_fail": "subtract"}, "needs a `weight` above 0"),
        ({"grader": {"type": "exact", "value": "x"}, "weight": 0.5}, "`weight` is for `subtract` checks"),
        ({"grader": {"type": "ruler"}}, "Invalid value 'ruler'"),
        ({"grader": {"type": "regex", "pattern": "("}}, "not a valid regular expression"),
    ],
)
def test_bad_checks_are_refused(spec: dict[str, Any], problem: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=problem):
        checks(spec)
