"""Every error path of the endpoints beyond chat: `/v1/completions`, `/v1/responses` (and its stored objects),
`/v1/messages` (errors in Anthropic's shape), `/v1/models/{id}`, and the paths the gateway does not serve.

Exact status, exact body, and on an inference call the `X-ART-Rollout-Id` header, errors included. The gateways
stand in front of the stand-in engine (tests/stub_engine.py), one per way it is made to behave (module-scoped:
a gateway start is the slow part). The main one's engine is the stub plus one rule of vLLM's the stub lacks,
a 400 for `max_tokens` past the context: the Messages route refuses a negative temperature itself, so the
engine's own 400 can only reach it through another option.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import (
    ROOT,
    GatewayProcess,
    free_port,
    metric,
    start_gateway,
    start_stub,
    stop_group,
    wait_http,
)

ROLLOUT = "X-ART-Rollout-Id"
MAX_BODY_BYTES = 4096  # the main gateway's body limit: the requests here are far under it, bar the oversize ones
CONTEXT = 4096  # the main engine's context: `max_tokens` above it is vLLM's 400

# The stand-in engine, plus vLLM's 400 for `max_tokens` past the context. Run with `python -c ENGINE PORT`.
ENGINE = f"""
import json, sys
import uvicorn
from tests.stub_engine import _error, make_app

stub = make_app(0.0, 200, False)

async def app(scope, receive, send):
    if scope["type"] != "http" or scope["method"] != "POST":
        return await stub(scope, receive, send)
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    max_tokens = json.loads(body or b"{{}}").get("max_tokens")
    if isinstance(max_tokens, int) and max_tokens > {CONTEXT}:
        error = _error(
            f"'max_tokens' is too large: {{max_tokens}}. This model's maximum context length is {CONTEXT} tokens.",
            400,
            "max_tokens",
        )
        headers = [(b"content-type", b"application/json")]
        await send({{"type": "http.response.start", "status": 400, "headers": headers}})
        await send({{"type": "http.response.body", "body": error}})
        return
    replayed = False

    async def replay():
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {{"type": "http.request", "body": body, "more_body": False}}

    await stub(scope, replay, send)

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def start_engine() -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, str(port)], cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", 30, proc)
    except Exception:
        stop_group(proc)
        raise
    return url, proc


def gateway_on(engine: tuple[str, subprocess.Popen[bytes]], tmp: Path, **env: str) -> Iterator[GatewayProcess]:
    url, proc = engine
    try:
        gateway = start_gateway(tmp, "--upstream", url, env=env)
        yield gateway
        gateway.stop()
    finally:
        stop_group(proc)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """In front of an engine that answers (the stub's one chat completion) or refuses (vLLM's 400s)."""
    yield from gateway_on(
        start_engine(), tmp_path_factory.mktemp("api-errors"), ARTGW_MAX_BODY_BYTES=str(MAX_BODY_BYTES)
    )


@pytest.fixture(scope="module")
def failing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """In front of an engine that answers every call with a 500."""
    yield from gateway_on(start_stub("--status", "500"), tmp_path_factory.mktemp("api-errors-500"))


@pytest.fixture(scope="module")
def cut_short(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """In front of an engine whose every stream stops after one token, without its [DONE]."""
    yield from gateway_on(start_stub("--end-stream-early"), tmp_path_factory.mktemp("api-errors-early"))


def new_rollout() -> str:
    return f"err-{uuid.uuid4().hex[:12]}"


def post(gateway: GatewayProcess, path: str, body: Any, rollout: str | None) -> httpx.Response:
    """POST `body` (bytes as they are, anything else as JSON) to /v1/`path`, with `rollout` as the header."""
    headers = {"content-type": "application/json"}
    if rollout is not None:
        headers[ROLLOUT] = rollout
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{gateway.base_url}{path}", content=content, headers=headers, timeout=30)


def answered(response: httpx.Response, status: int, rollout: str) -> Any:
    """The body of an inference call's answer, after checking its status and that it names the rollout."""
    assert response.status_code == status, response.text
    assert response.headers.get(ROLLOUT) == rollout
    return response.json()


def openai_error(message: str, param: str | None = None, code: str | None = None, **kind: str) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": kind.get("type", "invalid_request_error"), "param": param, "code": code}
    }


def anthropic_error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def calls_counted(gateway: GatewayProcess, status: str | None = None) -> float:
    """The calls the gateway accepted and counted (`artgw_requests_total`), of one outcome or all."""
    labels = {"model": "my-agent"} if status is None else {"model": "my-agent", "status": status}
    return metric(gateway.url, "artgw_requests_total", **labels)


def sse(response: httpx.Response) -> list[tuple[str | None, Any]]:
    """The (event name, decoded data) of each server-sent event; `[DONE]` as the string."""
    events: list[tuple[str | None, Any]] = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        data = fields["data"]
        events.append((fields.get("event"), data if data == "[DONE]" else json.loads(data)))
    return events


NOT_JSON = b"{not json"
NOT_JSON_MESSAGE = "Request body is not valid JSON: JSON is malformed: object keys must be strings (byte 1)"
MODEL_NOT_FOUND = "The model `nope` does not exist or you do not have access to it."
ENGINE_500 = "Upstream engine error: engine exploded"

# ---------------------------------------------------------------------------------------------- completions

COMPLETION = {"model": "my-agent", "prompt": "Once upon a time"}
BAD_PROMPT = openai_error(
    "Invalid 'prompt': expected a string, a list of strings, a non-empty list of token ids (non-negative "
    "integers), or a list of such lists.",
    "prompt",
    "invalid_type",
)


@pytest.mark.parametrize(
    ("body", "status", "expected"),
    [
        pytest.param(NOT_JSON, 400, openai_error(NOT_JSON_MESSAGE, code="invalid_json"), id="invalid-json"),
        pytest.param(
            {"model": "my-agent"},
            400,
            openai_error("Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter"),
            id="missing-prompt",
        ),
        pytest.param({**COMPLETION, "prompt": []}, 400, BAD_PROMPT, id="prompt-empty-list"),
        pytest.param({**COMPLETION, "prompt": [[]]}, 400, BAD_PROMPT, id="prompt-empty-ids"),
        pytest.param({**COMPLETION, "prompt": [1, "a"]}, 400, BAD_PROMPT, id="prompt-mixed"),
        pytest.param({**COMPLETION, "prompt": [-1]}, 400, BAD_PROMPT, id="prompt-negative-id"),
        pytest.param(
            {**COMPLETION, "prompt": 5},
            400,
            openai_error("Invalid request: Expected `str | array`, got `int` (at 'prompt').", "prompt", "invalid_type"),
            id="prompt-int",
        ),
        pytest.param(
            {**COMPLETION, "n": 0},
            400,
            openai_error("Invalid request: Expected `int` >= 1 (at 'n').", "n", "invalid_value"),
            id="n-0",
        ),
        pytest.param(
            {**COMPLETION, "n": 129},
            400,
            openai_error("Invalid request: Expected `int` <= 128 (at 'n').", "n", "invalid_value"),
            id="n-129",
        ),
        pytest.param(
            {**COMPLETION, "prompt": ["a", "b"], "n": 65},
            400,
            openai_error("Too many generations in one call: 130 (prompts × n); at most 128.", "n", "invalid_value"),
            id="prompts-times-n",
        ),
        pytest.param(
            {**COMPLETION, "prompt": [[1, 2]] * 129},
            400,
            openai_error("Too many generations in one call: 129 (prompts × n); at most 128.", "n", "invalid_value"),
            id="129-id-prompts",
        ),
        pytest.param(
            {**COMPLETION, "logprobs": 21},
            400,
            openai_error("Invalid request: Expected `int` <= 20 (at 'logprobs').", "logprobs", "invalid_value"),
            id="logprobs-21",
        ),
        pytest.param(
            {**COMPLETION, "model": "nope"},
            404,
            openai_error(MODEL_NOT_FOUND, "model", "model_not_found"),
            id="unknown-model",
        ),
    ],
)
def test_completions_refusals(gateway, body: Any, status: int, expected: dict[str, Any]) -> None:
    rollout = new_rollout()
    before = calls_counted(gateway)
    assert answered(post(gateway, "/completions", body, rollout), status, rollout) == expected
    assert calls_counted(gateway) == before  # refused before the engine: no call


def test_completions_at_the_generation_limit_is_served(gateway) -> None:
    """The bound is prompts × n <= 128, not below it."""
    rollout = new_rollout()
    r = post(gateway, "/completions", {**COMPLETION, "prompt": ["a", "b"], "n": 64}, rollout)
    assert answered(r, 200, rollout)["model"] == "my-agent"


def test_completions_error_names_the_rollout_the_gateway_made_up(gateway) -> None:
    r = post(gateway, "/completions", NOT_JSON, None)
    assert r.status_code == 400
    assert re.fullmatch(r"r-[0-9a-f]{32}", r.headers[ROLLOUT])
    assert r.json() == openai_error(NOT_JSON_MESSAGE, code="invalid_json")


@pytest.mark.parametrize("api", ["/completions", "/responses", "/messages"])
def test_error_names_the_rollout_of_the_path_over_the_header(gateway, api: str) -> None:
    r = httpx.post(
        f"{gateway.url}/rollouts/from-path/v1{api}",
        content=NOT_JSON,
        headers={"content-type": "application/json", ROLLOUT: "from-header"},
    )
    assert r.status_code == 400
    assert r.headers[ROLLOUT] == "from-path"


def test_completions_engine_400_passes_through_and_counts_as_client_error(gateway) -> None:
    rollout = new_rollout()
    before = calls_counted(gateway, "client_error")
    r = post(gateway, "/completions", {**COMPLETION, "temperature": -1}, rollout)
    assert answered(r, 400, rollout) == openai_error("temperature must be non-negative, got -1.", "temperature")
    assert calls_counted(gateway, "client_error") == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_completions_engine_5xx_is_502(failing, stream: bool) -> None:
    rollout = new_rollout()
    before = calls_counted(failing, "upstream_error")
    r = post(failing, "/completions", {**COMPLETION, "stream": stream}, rollout)
    assert answered(r, 502, rollout) == openai_error(ENGINE_500, code="upstream_error", type="server_error")
    assert calls_counted(failing, "upstream_error") == before + 1


def test_completions_stream_cut_short_ends_with_an_error_event(cut_short) -> None:
    rollout = new_rollout()
    r = post(cut_short, "/completions", {**COMPLETION, "stream": True}, rollout)
    assert r.status_code == 200 and r.headers[ROLLOUT] == rollout
    events = sse(r)
    assert len(events) == 2  # the engine's one token, the error, and no [DONE]
    assert events[0][1]["choices"][0]["delta"] == {"content": "o"}
    assert events[1] == (
        None,
        openai_error("The engine ended the stream early.", code="upstream_error", type="server_error"),
    )


# ---------------------------------------------------------------------------------------------- responses

RESPONSE = {"model": "my-agent", "input": "Hello"}
FUNCTION = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    ("body", "status", "expected"),
    [
        pytest.param(NOT_JSON, 400, openai_error(NOT_JSON_MESSAGE, code="invalid_json"), id="invalid-json"),
        pytest.param(
            {"model": "my-agent"},
            400,
            openai_error("Missing required parameter: 'input'.", "input", "missing_required_parameter"),
            id="missing-input",
        ),
        pytest.param(
            {**RESPONSE, "tools": [FUNCTION, {"type": "web_search"}]},
            400,
            openai_error(
                "Unsupported tool type: 'web_search'. This gateway supports only 'function' tools.",
                "tools[1].type",
                "unsupported_value",
            ),
            id="web-search-tool",
        ),
        pytest.param(
            {**RESPONSE, "tools": [{**FUNCTION, "parameters": {"type": "nope"}}]},
            400,
            openai_error(
                "Invalid schema for function 'lookup': 'nope' is not valid under any of the given schemas (at 'type').",
                "tools[0].parameters",
                "invalid_function_parameters",
            ),
            id="invalid-parameters-schema",
        ),
        pytest.param(
            {**RESPONSE, "input": [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "msg_1"}]},
            400,
            openai_error(
                "Input items of type 'item_reference' are not supported: send the items themselves, or use "
                "'previous_response_id'.",
                "input[1].type",
                "unsupported_value",
            ),
            id="item-reference",
        ),
        pytest.param(
            {**RESPONSE, "input": [{"id": "msg_1"}]},  # OpenAI lets an item reference leave out its type
            400,
            openai_error(
                "Input items of type 'item_reference' are not supported: send the items themselves, or use "
                "'previous_response_id'.",
                "input[0].type",
                "unsupported_value",
            ),
            id="untyped-item-reference",
        ),
        pytest.param(  # before: refused as an unsupported `tool_choice.type`
            {**RESPONSE, "tools": [FUNCTION], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
            400,
            openai_error(
                "'tool_choice.tools' must name at least one of the request's tools.",
                "tool_choice.tools",
                "invalid_value",
            ),
            id="allowed-tools-empty",
        ),
        pytest.param(
            {
                **RESPONSE,
                "tools": [FUNCTION],
                "tool_choice": {
                    "type": "allowed_tools",
                    "mode": "auto",
                    "tools": [{"type": "mcp", "server_label": "x"}],
                },
            },
            400,
            openai_error(
                "Unsupported tool type: 'mcp'. This gateway supports only 'function' tools.",
                "tool_choice.tools[0].type",
                "unsupported_value",
            ),
            id="allowed-tools-mcp",
        ),
        pytest.param(
            {**RESPONSE, "previous_response_id": "resp_nope"},
            404,
            openai_error(
                "Previous response with id 'resp_nope' not found.",
                "previous_response_id",
                "previous_response_not_found",
                type="not_found_error",
            ),
            id="unknown-previous-response",
        ),
        pytest.param(
            {**RESPONSE, "model": "nope"},
            404,
            openai_error(MODEL_NOT_FOUND, "model", "model_not_found"),
            id="unknown-model",
        ),
    ],
)
def test_responses_refusals(gateway, body: Any, status: int, expected: dict[str, Any]) -> None:
    rollout = new_rollout()
    before = calls_counted(gateway)
    assert answered(post(gateway, "/responses", body, rollout), status, rollout) == expected
    assert calls_counted(gateway) == before


def test_responses_with_nothing_to_answer_is_400(gateway) -> None:
    rollout = new_rollout()
    err = answered(post(gateway, "/responses", {**RESPONSE, "input": []}, rollout), 400, rollout)["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", "input")


def test_responses_engine_400_passes_through(gateway) -> None:
    rollout = new_rollout()
    before = calls_counted(gateway, "client_error")
    r = post(gateway, "/responses", {**RESPONSE, "temperature": -1}, rollout)
    assert answered(r, 400, rollout) == openai_error("temperature must be non-negative, got -1.0.", "temperature")
    assert calls_counted(gateway, "client_error") == before + 1


@pytest.mark.parametrize("path", ["/responses/resp_nope", "/responses/resp_nope/input_items"])
def test_get_of_an_unknown_response_is_404(gateway, path: str) -> None:
    r = httpx.get(f"{gateway.base_url}{path}", headers=gateway.admin)
    assert r.status_code == 404
    assert r.json() == openai_error(
        "Response with id 'resp_nope' not found.", "response_id", "response_not_found", type="not_found_error"
    )


def test_delete_of_an_unknown_response_is_404(gateway) -> None:
    r = httpx.delete(f"{gateway.base_url}/responses/resp_nope", headers=gateway.admin)
    assert r.status_code == 404
    assert r.json() == openai_error(
        "Response with id 'resp_nope' not found.", "response_id", "response_not_found", type="not_found_error"
    )


@pytest.fixture(scope="module")
def stored(gateway) -> dict[str, Any]:
    """A response the gateway keeps (store defaults to true), its input two items."""
    body = {**RESPONSE, "input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    rollout = new_rollout()
    return answered(post(gateway, "/responses", body, rollout), 200, rollout)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        pytest.param(
            {"order": "sideways"},
            openai_error("'order' must be 'asc' or 'desc'.", "order", "invalid_value"),
            id="order-sideways",
        ),
        pytest.param(
            {"after": "msg_nope"},
            openai_error("No input item 'msg_nope' in this response.", "after", "invalid_value"),
            id="after-not-an-item",
        ),
    ],
)
def test_input_items_refusals(gateway, stored, query: dict[str, Any], expected: dict[str, Any]) -> None:
    r = httpx.get(f"{gateway.base_url}/responses/{stored['id']}/input_items", params=query, headers=gateway.admin)
    assert r.status_code == 400
    assert r.json() == expected


@pytest.mark.parametrize("limit", [0, 101])
def test_input_items_limit_out_of_range_has_a_code(gateway, stored, limit: int) -> None:
    r = httpx.get(
        f"{gateway.base_url}/responses/{stored['id']}/input_items", params={"limit": limit}, headers=gateway.admin
    )
    assert r.status_code == 400
    assert r.json() == openai_error("'limit' must be between 1 and 100.", "limit", "invalid_value")


def test_input_items_non_integer_limit_names_the_param(gateway, stored) -> None:
    r = httpx.get(
        f"{gateway.base_url}/responses/{stored['id']}/input_items", params={"limit": "ten"}, headers=gateway.admin
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "limit", "invalid_type")


@pytest.mark.parametrize("stream", [False, True])
def test_responses_engine_5xx_is_502(failing, stream: bool) -> None:
    """Streamed or not: the engine refused before any event, so the HTTP status still can say it."""
    rollout = new_rollout()
    r = post(failing, "/responses", {**RESPONSE, "stream": stream}, rollout)
    assert answered(r, 502, rollout) == openai_error(ENGINE_500, code="upstream_error", type="server_error")


def test_responses_stream_cut_short_ends_with_response_failed(cut_short) -> None:
    rollout = new_rollout()
    r = post(cut_short, "/responses", {**RESPONSE, "stream": True}, rollout)
    assert r.status_code == 200 and r.headers[ROLLOUT] == rollout
    events = sse(r)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.failed",
    ]
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    item_id = events[2][1]["item"]["id"]
    failed = events[-1][1]["response"]
    assert failed["id"] == events[0][1]["response"]["id"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "The engine ended the stream early."}
    assert failed["output"] == [
        {
            "type": "message",
            "id": item_id,
            "status": "incomplete",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "o", "annotations": [], "logprobs": []}],
        }
    ]
    # A failed response is not kept: nothing to continue from or read back.
    assert httpx.get(f"{cut_short.base_url}/responses/{failed['id']}", headers=cut_short.admin).status_code == 404


def test_response_round_trip(gateway) -> None:
    rollout = new_rollout()
    body = {**RESPONSE, "input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    created = answered(post(gateway, "/responses", body, rollout), 200, rollout)
    assert (created["object"], created["status"], created["store"]) == ("response", "completed", True)
    assert created["output"][0]["content"][0]["text"] == "ok"  # the stub's answer, translated
    url = f"{gateway.base_url}/responses/{created['id']}"

    r = httpx.get(url, headers=gateway.admin)
    assert r.status_code == 200 and r.json() == created

    items = httpx.get(f"{url}/input_items", headers=gateway.admin, params={"order": "asc"}).json()
    assert [(i["type"], i["role"], i["content"]) for i in items["data"]] == [
        ("message", "user", [{"type": "input_text", "text": "a"}]),
        ("message", "assistant", [{"type": "output_text", "text": "b", "annotations": [], "logprobs": []}]),
    ]
    first, last = (i["id"] for i in items["data"])
    assert (items["object"], items["first_id"], items["last_id"], items["has_more"]) == ("list", first, last, False)
    newest_first = httpx.get(f"{url}/input_items", headers=gateway.admin).json()
    assert [i["id"] for i in newest_first["data"]] == [last, first]
    page = httpx.get(f"{url}/input_items", headers=gateway.admin, params={"order": "asc", "limit": 1}).json()
    assert ([i["id"] for i in page["data"]], page["has_more"]) == ([first], True)
    page = httpx.get(f"{url}/input_items", headers=gateway.admin, params={"order": "asc", "after": first}).json()
    assert ([i["id"] for i in page["data"]], page["has_more"]) == ([last], False)

    follow_up = {**RESPONSE, "previous_response_id": created["id"]}
    assert (
        answered(post(gateway, "/responses", follow_up, rollout), 200, rollout)["previous_response_id"]
        == (created["id"])
    )

    r = httpx.delete(url, headers=gateway.admin)
    assert r.status_code == 200
    assert r.json() == {"id": created["id"], "object": "response.deleted", "deleted": True}
    gone = openai_error(
        f"Response with id '{created['id']}' not found.", "response_id", "response_not_found", type="not_found_error"
    )
    admin = gateway.admin  # a stored Response is read and deleted with a key (#40), the admin's reads any
    for again in (
        httpx.get(url, headers=admin),
        httpx.get(f"{url}/input_items", headers=admin),
        httpx.delete(url, headers=admin),
    ):
        assert again.status_code == 404 and again.json() == gone
    r = post(gateway, "/responses", follow_up, rollout)
    assert answered(r, 404, rollout) == openai_error(
        f"Previous response with id '{created['id']}' not found.",
        "previous_response_id",
        "previous_response_not_found",
        type="not_found_error",
    )


def test_unstored_response_is_not_kept(gateway) -> None:
    rollout = new_rollout()
    created = answered(post(gateway, "/responses", {**RESPONSE, "store": False}, rollout), 200, rollout)
    assert (created["status"], created["store"]) == ("completed", False)
    r = httpx.get(f"{gateway.base_url}/responses/{created['id']}", headers=gateway.admin)
    assert r.status_code == 404
    assert r.json() == openai_error(
        f"Response with id '{created['id']}' not found.", "response_id", "response_not_found", type="not_found_error"
    )


# ---------------------------------------------------------------------------------------------- messages

MESSAGE = {"model": "my-agent", "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]}


@pytest.mark.parametrize(
    ("body", "status", "expected"),
    [
        pytest.param(NOT_JSON, 400, anthropic_error(NOT_JSON_MESSAGE), id="invalid-json"),
        pytest.param(
            {"model": "my-agent", "messages": MESSAGE["messages"]},
            400,
            anthropic_error("max_tokens: Field required"),
            id="missing-max-tokens",
        ),
        pytest.param(
            {**MESSAGE, "messages": []},
            400,
            anthropic_error("messages: Expected `array` of length >= 1"),
            id="empty-messages",
        ),
        pytest.param(
            {**MESSAGE, "messages": [{"role": "bot", "content": "hi"}]},
            400,
            anthropic_error("messages.0.role: Input should be 'user' or 'assistant'"),
            id="bad-role",
        ),
        pytest.param(
            {**MESSAGE, "messages": [{"role": "system", "content": "hi"}]},
            400,
            anthropic_error(
                'messages.0.role: Unexpected role "system". The Messages API accepts a top-level `system` '
                'parameter, not "system" as an input message role.'
            ),
            id="system-role",
        ),
        pytest.param(
            {**MESSAGE, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            400,
            anthropic_error(
                "messages.0.content.0: Input tag 'video' found using 'type' does not match any of the expected "
                "tags: 'text', 'image', 'tool_use', 'tool_result', 'thinking', 'redacted_thinking'"
            ),
            id="unknown-block-type",
        ),
        pytest.param(
            {**MESSAGE, "temperature": -1},  # refused by the gateway itself, before the engine
            400,
            anthropic_error("temperature: Expected `float` >= 0.0"),
            id="negative-temperature",
        ),
        pytest.param(
            {**MESSAGE, "model": "nope"},
            404,
            anthropic_error(MODEL_NOT_FOUND, "not_found_error"),
            id="unknown-model",
        ),
    ],
)
def test_messages_refusals(gateway, body: Any, status: int, expected: dict[str, Any]) -> None:
    rollout = new_rollout()
    before = calls_counted(gateway)
    assert answered(post(gateway, "/messages", body, rollout), status, rollout) == expected
    assert calls_counted(gateway) == before


def test_messages_engine_400_passes_through_in_anthropic_shape(gateway) -> None:
    rollout = new_rollout()
    before = calls_counted(gateway, "client_error")
    r = post(gateway, "/messages", {**MESSAGE, "max_tokens": 100_000}, rollout)
    assert answered(r, 400, rollout) == anthropic_error(
        "max_tokens: 'max_tokens' is too large: 100000. This model's maximum context length is 4096 tokens."
    )
    assert calls_counted(gateway, "client_error") == before + 1


def test_messages_invalid_rollout_id_is_400_in_anthropic_shape(gateway) -> None:
    r = post(gateway, "/messages", MESSAGE, "bad id!")
    assert r.status_code == 400
    assert ROLLOUT not in r.headers  # the one error that cannot name its rollout
    assert r.json() == anthropic_error(
        "X-ART-Rollout-Id: Invalid rollout id: use 1 to 128 characters from letters, digits and `._:-`, "
        "starting with a letter or digit."
    )


@pytest.mark.parametrize("stream", [False, True])
def test_messages_engine_5xx_is_502_api_error(failing, stream: bool) -> None:
    rollout = new_rollout()
    r = post(failing, "/messages", {**MESSAGE, "stream": stream}, rollout)
    assert answered(r, 502, rollout) == anthropic_error(ENGINE_500, "api_error")


def message_stream_events(response: httpx.Response, rollout: str) -> list[tuple[str | None, Any]]:
    assert response.status_code == 200 and response.headers[ROLLOUT] == rollout
    events = sse(response)
    assert [name for name, _ in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert all(name == data["type"] for name, data in events)
    assert events[2][1]["delta"] == {"type": "text_delta", "text": "o"}
    return events


def test_messages_stream_cut_short_ends_with_an_error_event(cut_short) -> None:
    rollout = new_rollout()
    events = message_stream_events(post(cut_short, "/messages", {**MESSAGE, "stream": True}, rollout), rollout)
    assert events[-1][1] == anthropic_error("The engine ended the stream early.", "api_error")


def test_messages_stream_of_an_engine_dying_ends_with_an_error_event(gateway_factory) -> None:
    url, proc = start_stub("--die-mid-stream")
    try:
        gateway = gateway_factory("--upstream", url)
        rollout = new_rollout()
        events = message_stream_events(post(gateway, "/messages", {**MESSAGE, "stream": True}, rollout), rollout)
        assert events[-1][1] == anthropic_error("The engine connection was lost mid-stream.", "api_error")
    finally:
        stop_group(proc)


# ---------------------------------------------------------------------------------------------- body too large

TOO_LARGE = "x" * (MAX_BODY_BYTES + 1000)
OVERSIZE = {
    "/completions": {**COMPLETION, "prompt": TOO_LARGE},
    "/responses": {**RESPONSE, "input": TOO_LARGE},
    "/messages": {**MESSAGE, "messages": [{"role": "user", "content": TOO_LARGE}]},
}


@pytest.mark.parametrize("api", ["/completions", "/responses"])
def test_oversize_body_is_413(gateway, api: str) -> None:
    r = post(gateway, api, OVERSIZE[api], new_rollout())
    assert r.status_code == 413
    assert r.json() == openai_error("Request body is too large.", code="request_too_large")


@pytest.mark.parametrize("api", ["/completions", "/responses", "/messages"])
def test_oversize_body_names_the_rollout(gateway, api: str) -> None:
    rollout = new_rollout()
    assert post(gateway, api, OVERSIZE[api], rollout).headers.get(ROLLOUT) == rollout


def test_oversize_messages_body_is_413_in_anthropic_shape(gateway) -> None:
    r = post(gateway, "/messages", OVERSIZE["/messages"], new_rollout())
    assert r.status_code == 413
    assert r.json() == anthropic_error("Request body is too large.", "request_too_large")


# ---------------------------------------------------------------------------------------------- models, routes


@pytest.mark.parametrize("prefix", ["/v1", "/rollouts/r1/v1"])
def test_model_card(gateway, prefix: str) -> None:
    r = httpx.get(f"{gateway.url}{prefix}/models/my-agent")
    assert r.status_code == 200
    assert r.json() == {"id": "my-agent", "object": "model", "created": 0, "owned_by": "artgw", "root": "stub"}
    r = httpx.get(f"{gateway.url}{prefix}/models/nope")
    assert r.status_code == 404
    assert r.json() == openai_error(MODEL_NOT_FOUND, "model", "model_not_found")


def test_unknown_endpoint_is_404_naming_the_served_ones(gateway) -> None:
    r = httpx.get(f"{gateway.base_url}/embeddings")
    assert r.status_code == 404
    assert r.json() == openai_error(
        "The gateway does not serve GET /v1/embeddings. It serves: POST /v1/chat/completions, "
        "POST /v1/completions, POST /v1/responses, GET /v1/responses/{id}, DELETE /v1/responses/{id}, "
        "GET /v1/responses/{id}/input_items, POST /v1/messages, POST /v1/messages/count_tokens, GET /v1/models, "
        "GET /v1/models/{id}, "
        "/v1/art/... (rollouts, groups, models); the inference endpoints also under /rollouts/{rollout_id}/v1/....",
        code="unknown_endpoint",
        type="not_found_error",
    )


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/completions"), ("PUT", "/responses"), ("POST", "/responses/resp_1")],
)
def test_wrong_method_is_405(gateway, method: str, path: str) -> None:
    r = httpx.request(method, f"{gateway.base_url}{path}")
    assert r.status_code == 405
    assert r.json() == openai_error("Method Not Allowed", code="method_not_allowed")


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/messages", 405),
        ("GET", "/v1/messages/count_tokens", 405),
        ("POST", "/v1/messages/batches", 404),
        ("POST", "/rollouts/r1/v1/messages/batches", 404),
    ],
)
def test_every_path_under_messages_errs_in_anthropics_shape(gateway, method: str, path: str, status: int) -> None:
    """Anthropic's SDK reads only its own error shape (#27: these were OpenAI's)."""
    r = httpx.request(method, f"{gateway.url}{path}")
    kind = {404: "not_found_error", 405: "invalid_request_error"}[status]
    assert (r.status_code, r.json()["type"], r.json()["error"]["type"]) == (status, "error", kind), r.text
