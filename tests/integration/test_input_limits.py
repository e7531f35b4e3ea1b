"""Bad input is a 400 in OpenAI's shape, and whatever is accepted reads back (#11).

Chat requests go through a stand-in engine (tests/stub_engine.py): what is tested is the gateway's own
validation and what it records, not generation. One nesting limit (gateway/errors.py MAX_JSON_DEPTH) holds for
accepting and for storing: a body at the limit is recorded and reads back over HTTP, through `artgw export`
and from the store's reader on both stores; one level more is refused.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.errors import MAX_JSON_DEPTH
from store.access import EVERYTHING
from store.calls import write_calls
from store.rollouts import RolloutReader
from tests.conftest import ARTGW, make_call, start_gateway, start_stub, stop_group

CHAT: dict[str, Any] = {"model": "my-agent", "messages": [{"role": "user", "content": "hi"}]}
TOO_DEEP = {
    "message": f"Request body is nested too deeply: at most {MAX_JSON_DEPTH} levels of arrays and objects.",
    "type": "invalid_request_error",
    "param": None,
    "code": "invalid_json",
}


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    url, proc = start_stub()
    yield url
    stop_group(proc)


@pytest.fixture(scope="module")
def gateway(stub_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    gateway = start_gateway(tmp_path_factory.mktemp("limits"), "--upstream", stub_url)
    yield gateway
    gateway.stop()


def nested(levels: int) -> Any:
    """A JSON value whose arrays and objects nest exactly `levels` deep (objects and arrays alternating)."""
    value: Any = "leaf"
    for level in range(levels):
        value = {"k": value} if level % 2 == 0 else [value]
    return value


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


def chat_at_depth(levels: int) -> dict[str, Any]:
    """A chat request nesting `levels` deep overall, both in a message (stored apart from the rest of the
    request) and in an extra top-level field (stored with it)."""
    body = {
        "model": "my-agent",
        "messages": [{"role": "user", "content": "hi", "extra": nested(levels - 3)}],
        "extra": nested(levels - 1),
    }
    assert depth(body) == levels
    return body


def post(gateway: Any, path: str, body: Any, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{gateway.base_url}{path}",
        content=content,
        # The admin key too: admin routes need it, and the others take it (it has every scope).
        headers={"content-type": "application/json", **gateway.admin, **headers},
        timeout=30,
    )


def bad(param: str | None, code: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def allowed(mode: str, *tools: dict[str, Any]) -> dict[str, Any]:
    """Chat's `allowed_tools` tool choice."""
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": list(tools)}}


ROLES = "Supported values are: 'system', 'assistant', 'user', 'function', 'tool', and 'developer'."


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "boo"}]},
            bad("messages[1].role", "invalid_value", f"Invalid value: 'wizard'. {ROLES}"),
        ),
        (
            {"tools": [TOOL, {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
            bad(
                "tools[1].function.parameters",
                "invalid_function_parameters",
                "Invalid schema for function 'f': 'objekt' is not valid under any of the given schemas (at 'type').",
            ),
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": "city"}}}]},
            bad(
                "tools[0].function.parameters",
                "invalid_function_parameters",
                "Invalid schema for function 'f': 'city' is not of type 'array' (at 'required').",
            ),
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            bad(
                "tools[0].function.parameters",
                "invalid_function_parameters",
                "Invalid schema for function 'f': parameters must be a JSON Schema object.",
            ),
        ),
        (
            {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
            bad(
                "tools[0].type",
                "invalid_value",
                "Invalid request: Invalid enum value 'retrieval' (at 'tools[0].type').",
            ),
        ),
        (
            {"tools": [{"type": "function"}]},
            bad("tools[0].function", "missing_required_parameter", "Missing required parameter: 'tools[0].function'."),
        ),
        ({"n": 129}, bad("n", "invalid_value", "Invalid request: Expected `int` <= 128 (at 'n').")),
        ({"n": 10_000}, bad("n", "invalid_value", "Invalid request: Expected `int` <= 128 (at 'n').")),
        (
            {"max_tokens": 0},
            bad("max_tokens", "invalid_value", "Invalid request: Expected `int` >= 1 (at 'max_tokens')."),
        ),
        (
            {"max_completion_tokens": -5},
            bad(
                "max_completion_tokens",
                "invalid_value",
                "Invalid request: Expected `int` >= 1 (at 'max_completion_tokens').",
            ),
        ),
        (
            {"top_logprobs": 21},
            bad("top_logprobs", "invalid_value", "Invalid request: Expected `int` <= 20 (at 'top_logprobs')."),
        ),
        (  # before: passed on as sent (vLLM 0.32 refuses the form, naming `tool_choice.function`)
            {"tools": [TOOL], "tool_choice": allowed("required", {"type": "function", "function": {"name": "nope"}})},
            bad(
                "tool_choice.allowed_tools.tools[0].function.name",
                "invalid_value",
                "Allowed tool 'nope' not found in 'tools' parameter.",
            ),
        ),
        (
            {"tools": [TOOL], "tool_choice": allowed("any", {"type": "function", "function": {"name": "get_weather"}})},
            bad(
                "tool_choice.allowed_tools.mode",
                "invalid_value",
                "Invalid value: 'any'. Supported values are: 'auto' and 'required'.",
            ),
        ),
    ],
    ids=[
        "unknown-role",
        "invalid-schema-type",
        "invalid-schema-required",
        "schema-not-object",
        "tool-type",
        "tool-without-function",
        "n-over-cap",
        "n-10000",
        "max-tokens-0",
        "max-completion-tokens-negative",
        "top-logprobs-over-cap",
        "allowed-tool-not-offered",
        "allowed-tools-mode",
    ],
)
def test_chat_input_out_of_bounds_is_400_naming_the_param(gateway, extra: dict[str, Any], expected: dict) -> None:
    r = post(gateway, "/chat/completions", {**CHAT, **extra})
    assert (r.status_code, r.json()) == (400, expected)


def test_valid_tools_roles_and_n_at_the_cap_are_accepted(gateway) -> None:
    messages = [{"role": role, "content": "x"} for role in ("developer", "system", "user", "assistant", "user")]
    r = post(gateway, "/chat/completions", {**CHAT, "messages": messages, "tools": [TOOL], "n": 128, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_invalid_utf8_and_too_deep_are_400_on_every_json_endpoint(gateway) -> None:
    # (The admin adapter body is typed all through: nothing in it can nest, so only UTF-8 applies there.)
    bad_utf8 = b'{"model": "my-agent", "rollouts": [{"rollout_id": "\xff"}]}'
    deep = {"model": "my-agent", "rollouts": [{"rollout_id": "x"}], "metadata": {"k": nested(MAX_JSON_DEPTH - 1)}}
    very_deep = b'{"model": "my-agent", "metadata": ' + b'{"k": ' * 10_000 + b"{}" + b"}" * 10_000 + b"}"
    for path, body in [
        ("/art/groups", bad_utf8),
        ("/art/models/my-agent/adapters", b'{"step": 1, "path": "\xff"}'),
        ("/chat/completions", b'{"model": "my-agent", "messages": [{"role": "user", "content": "\xff"}]}'),
    ]:
        r = post(gateway, path, body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_json" and r.json()["error"]["param"] is None
    for path, body in [
        ("/art/groups", deep),
        ("/art/groups", very_deep),
        ("/chat/completions", chat_at_depth(MAX_JSON_DEPTH + 1)),
    ]:
        r = post(gateway, path, body)
        assert (r.status_code, r.json()) == (400, {"error": TOO_DEEP}), path


MESSAGES = b'{"model": "my-agent", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]'
RESPONSES = b'{"model": "my-agent", "input": "hi"'


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # #40: count_tokens answered 500 to these two (a traceback in the log) ...
        ("/messages/count_tokens", MESSAGES + b', "system": "\xff"}'),
        ("/messages/count_tokens", MESSAGES + b', "zz": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"),
        # ... and the others served invalid UTF-8 in a field they do not know (200): their struct skips it unread.
        ("/messages", MESSAGES + b', "zz": "\xc3("}'),
        ("/messages/count_tokens", MESSAGES + b', "zz": {"k": "\xff"}}'),
        ("/responses", RESPONSES + b', "zz": ["\xff"]}'),
        ("/completions", b'{"model": "my-agent", "prompt": "hi", "zz": "\xff"}'),
    ],
    ids=["count-utf8", "count-10000-deep", "messages-unknown", "count-unknown", "responses-unknown", "completions"],
)
def test_invalid_utf8_anywhere_and_too_deep_are_400_in_the_apis_shape(gateway, path: str, body: bytes) -> None:
    r = post(gateway, path, body)
    assert r.status_code == 400, r.text
    if path.startswith("/messages"):
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert "UTF-8" in r.text or "nested too deeply" in r.text, r.text
    else:
        assert r.json()["error"]["code"] == "invalid_json", r.text


def test_a_body_at_the_depth_limit_is_recorded_and_reads_back_over_http_and_export(gateway) -> None:
    body = chat_at_depth(MAX_JSON_DEPTH)
    r = post(gateway, "/chat/completions", body, **{"X-ART-Rollout-Id": "deep-1"})
    assert r.status_code == 200, r.text
    for _ in range(2):  # read-your-writes, then a plain read of what is in the store
        got = httpx.get(f"{gateway.base_url}/art/rollouts/deep-1", timeout=30, headers=gateway.admin)
        assert got.status_code == 200, got.text
        assert got.json()["messages"][0] == body["messages"][0]
    export = subprocess.run(
        [ARTGW, "export", "--model", "my-agent", "--data-dir", str(gateway.data_dir)],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert export.returncode == 0, export.stderr.decode()
    (line,) = [json.loads(x) for x in export.stdout.splitlines() if b'"deep-1"' in x]
    assert line["messages"][0] == body["messages"][0]


def test_admin_adapter_inputs_are_bounded_and_load_nothing(gateway, stub_url: str, tmp_path: Path) -> None:
    adapter = tmp_path / "step-1"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    cases = [
        ({"step": 2**70, "path": str(adapter)}, "step", "Invalid request: Expected `int` <= 2147483647 (at 'step')."),
        ({"step": 0, "path": str(adapter)}, "step", "'step' must be >= 1 (step 0 is the base model)."),
        ({"step": 1, "path": "/x" * 2049}, "path", "Invalid request: Expected `str` of length <= 4096 (at 'path')."),
        ({"step": 1, "path": ""}, "path", "Invalid request: Expected `str` of length >= 1 (at 'path')."),
        (
            {"step": 1, "path": str(adapter), "lease_owner": "o" * 257},
            "lease_owner",
            "Invalid request: Expected `str` of length <= 256 (at 'lease_owner').",
        ),
    ]
    for body, param, message in cases:
        r = post(gateway, "/art/models/my-agent/adapters", body)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["message"]) == (param, message)
    assert httpx.get(f"{stub_url}/loras").json() == {"loaded": [], "calls": []}


@pytest.mark.parametrize("name", [".", "..", "../outside", "a/b", "a\\b", "tab\tname", "x" * 129, "-lead", "a@3"])
def test_a_model_name_that_is_not_a_plain_name_is_refused(gateway, name: str) -> None:
    """A model name names the trainer's checkpoint directory: `.`, `..`, separators and control characters
    never get in (they once put checkpoints outside the trainer's root)."""
    r = post(gateway, "/art/models", {"name": name})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "name"
    assert (
        r.json()["error"]["message"]
        == "Invalid model name: 1 to 128 letters, digits and `._:-`, starting with a letter or digit."
    )


async def test_a_record_at_the_depth_limit_round_trips_through_the_store(engine: AsyncEngine) -> None:
    """Both stores (the `engine` fixture is SQLite and PostgreSQL): the deepest accepted request reads back."""
    body = chat_at_depth(MAX_JSON_DEPTH)
    record = make_call("c1", 1.0, body["messages"], rollout_id="deep", extra={"extra": body["extra"]})
    async with engine.begin() as conn:
        await write_calls(conn, [record])
    trajectory = await RolloutReader(engine).get("deep", owner="", grant=EVERYTHING)
    assert trajectory.messages[0] == body["messages"][0]
    assert depth(record.request) == MAX_JSON_DEPTH
