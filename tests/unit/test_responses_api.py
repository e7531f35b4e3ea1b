"""The Responses API translation (gateway/apis/responses/: schema.py, translate.py): requests to chat requests,
chat answers back.

Expected values are written out by hand; every response object and stream event is also validated with the
OpenAI SDK's own types, and the SDK itself (its `responses.create` and its stream helper) is run over what the
translation produces, through an httpx mock transport: what a real client would see, without an engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent

from gateway.apis.chat.schema import parse_chat_request
from gateway.apis.chat.translate import offered_tools
from gateway.apis.responses import schema
from gateway.apis.responses.schema import ResponsesRequest, parse_request
from gateway.apis.responses.translate import (
    ResponsesStream,
    input_items,
    input_messages,
    output_messages,
    to_chat,
    to_response,
)
from gateway.errors import OpenAIError

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
ITEM = pydantic.TypeAdapter(ResponseItem)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
WEATHER_CHAT = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": True,
    },
}
USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}


def request(**fields: Any) -> ResponsesRequest:
    """A request parsed from JSON, as the gateway gets it: `model` and `input` filled in unless given."""
    return parse_request(json.dumps({"model": "m", "input": "Hi", **fields}).encode())


def error_of(body: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(OpenAIError) as caught:
        parse_request(json.dumps(body).encode())
    assert caught.value.status == 400
    return caught.value.body()["error"]


def chat_answer(message: dict[str, Any], finish_reason: str = "stop") -> dict[str, Any]:
    """vLLM's chat.completion with one choice."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish_reason}],
        "usage": USAGE,
    }


def chunk(delta: dict[str, Any] | None = None, finish_reason: str | None = None) -> dict[str, Any]:
    """vLLM's chat.completion.chunk with one choice."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish_reason}],
    }


# vLLM's last chunk when `stream_options.include_usage` is set: no choices, the usage.
USAGE_CHUNK = {**chunk(), "choices": [], "usage": USAGE}


def tool_delta(index: int, arguments: str, call_id: str | None = None, name: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id is not None:
        call |= {"id": call_id, "type": "function"}
        call["function"]["name"] = name
    return {"tool_calls": [call]}


def stream_bytes(req: ResponsesRequest, chunks: list[dict[str, Any]]) -> tuple[bytes, ResponsesStream]:
    stream = ResponsesStream(req, "resp_1", 1700000000.5)
    body = stream.start() + b"".join(stream.take(c) for c in chunks) + stream.finish()
    return body, stream


def events_of(body: bytes) -> list[dict[str, Any]]:
    """The SSE events, each checked: `event:` names the data's type, sequence numbers count from 0, and the
    SDK's own event union accepts it."""
    assert body.endswith(b"\n\n")
    events = []
    for block in body.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == name.removeprefix("event: ")
        EVENT.validate_python(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def types_of(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


def without_ids(value: Any) -> Any:
    """The value with generated item ids (`msg_...`, `fc_...`, `rs_...`) replaced by their prefix."""
    if isinstance(value, dict):
        return {
            k: (re.sub(r"_[0-9a-f]{32}$", "_", v) if k in ("id", "item_id") else without_ids(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


def sdk_client(handler: Callable[[httpx.Request], httpx.Response]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://test/v1", api_key="x", http_client=httpx.Client(transport=httpx.MockTransport(handler))
    )


# -----------------------------------------------------------------------------
# input as chat messages


def test_a_string_input_is_one_user_message() -> None:
    assert input_messages(request(input="Hello")) == [{"role": "user", "content": "Hello"}]


def test_message_items_become_chat_messages() -> None:
    req = request(
        input=[
            {"role": "developer", "content": "Be brief."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []}]},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is this?"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
                ],
            },
            {"role": "system", "content": "Sys."},
        ]
    )
    assert input_messages(req) == [
        {"role": "system", "content": "Be brief."},  # developer: the templates know `system`
        {"role": "user", "content": "a\nb"},  # joined as vLLM joins text parts
        {"role": "assistant", "content": "c"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
            ],
        },
        {"role": "system", "content": "Sys."},
    ]


def test_function_calls_join_the_assistant_message_before_them() -> None:
    req = request(
        input=[
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
            {"role": "assistant", "content": "Let me look."},
            {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city":"Rome"}'},
            {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "rain"}]},
            {"type": "function_call", "call_id": "call_c", "name": "get_weather", "arguments": "{}"},
        ]
    )
    assert input_messages(req) == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
        # After a tool result, a call is a new assistant turn with no text.
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
    ]


# -----------------------------------------------------------------------------
# the chat request


def test_allowed_tools_offer_the_engine_only_those_tools() -> None:
    """OpenAI's `allowed_tools` tool choice: the chat request offers only the allowed tools, `mode` as its
    tool_choice (before: a 400 calling `allowed_tools` an unsupported `tool_choice.type`)."""
    other = {**WEATHER, "name": "get_time"}
    for mode in ("auto", "required"):
        choice = {"type": "allowed_tools", "mode": mode, "tools": [{"type": "function", "name": "get_weather"}]}
        chat = offered_tools(to_chat(request(tools=[other, WEATHER], tool_choice=choice), []))
        assert [tool["function"]["name"] for tool in chat["tools"]] == ["get_weather"]
        assert chat["tool_choice"] == mode
        parse_chat_request(json.dumps(chat).encode())  # a chat request the gateway takes as it is


def test_to_chat_puts_instructions_then_history_then_input() -> None:
    history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]
    chat = to_chat(request(instructions="Answer in French.", input="three"), history)
    assert chat == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"},
        ],
        "stream": False,
    }


def test_to_chat_maps_every_option() -> None:
    req = request(
        tools=[WEATHER, {"type": "function", "name": "noop"}],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=0.5,
        top_p=0.9,
        text={"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}},
        stream=True,
        metadata={"k": "v"},
        store=False,
        user="u1",
        reasoning={"effort": "low"},
        include=["message.output_text.logprobs"],
        service_tier="auto",
    )
    assert to_chat(req, []) == {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [WEATHER_CHAT, {"type": "function", "function": {"name": "noop"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "max_tokens": 64,
        "temperature": 0.5,
        "top_p": 0.9,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
        },
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parse_chat_request(json.dumps(to_chat(req, [])).encode())  # a request the chat route itself accepts


@pytest.mark.parametrize(
    ("fields", "key", "expected"),
    [
        ({"tool_choice": "required", "tools": [WEATHER]}, "tool_choice", "required"),
        ({"tool_choice": "none"}, "tool_choice", "none"),
        ({"text": {"format": {"type": "json_object"}}}, "response_format", {"type": "json_object"}),
        ({"text": {"format": {"type": "text"}}}, "response_format", {"type": "text"}),
        ({"stream": False}, "stream_options", None),
    ],
)
def test_to_chat_option_values(fields: dict[str, Any], key: str, expected: Any) -> None:
    assert to_chat(request(**fields), []).get(key) == expected


# -----------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    ("fields", "message", "param", "code"),
    [
        (
            {"tools": [WEATHER, {"type": "web_search"}]},
            "Unsupported tool type: 'web_search'. This gateway supports only 'function' tools.",
            "tools[1].type",
            "unsupported_value",
        ),
        (
            {"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]},
            "Unsupported tool type: 'file_search'. This gateway supports only 'function' tools.",
            "tools[0].type",
            "unsupported_value",
        ),
        (
            {"tools": [{"type": "function", "parameters": {}}]},
            "Missing required parameter: 'tools[0].name'.",
            "tools[0].name",
            "missing_required_parameter",
        ),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "objekt"}}]},
            "Invalid schema for function 'f': 'objekt' is not valid under any of the given schemas (at 'type').",
            "tools[0].parameters",
            "invalid_function_parameters",
        ),
        (
            {"input": [{"role": "user", "content": "a"}, {"type": "item_reference", "id": "msg_1"}]},
            "Input items of type 'item_reference' are not supported: send the items themselves, or use "
            "'previous_response_id'.",
            "input[1].type",
            "unsupported_value",
        ),
        (
            {"input": [{"id": "msg_1"}]},  # OpenAI's item reference may leave out its type
            "Input items of type 'item_reference' are not supported: send the items themselves, or use "
            "'previous_response_id'.",
            "input[0].type",
            "unsupported_value",
        ),
        (
            {"input": [{"type": "web_search_call", "id": "ws_1"}]},
            "Input items of type 'web_search_call' are not supported: this gateway serves function tools only.",
            "input[0].type",
            "unsupported_value",
        ),
        (
            {"input": [{"type": "banana"}]},
            "Invalid value: 'banana'. Supported values are: 'message', 'function_call', 'function_call_output', "
            "and 'reasoning'.",
            "input[0].type",
            "invalid_value",
        ),
        (
            {"input": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]},
            "Invalid value: 'tool'. Supported values are: 'assistant', 'system', 'developer', and 'user'.",
            "input[1].role",
            "invalid_value",
        ),
        (
            {"input": [{"type": "message", "content": "b"}]},
            "Missing required parameter: 'input[0].role'.",
            "input[0].role",
            "missing_required_parameter",
        ),
        (
            {"input": [{"role": "user"}]},
            "Missing required parameter: 'input[0].content'.",
            "input[0].content",
            "missing_required_parameter",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
            "Missing required parameter: 'input[0].name'.",
            "input[0].name",
            "missing_required_parameter",
        ),
        (
            {"input": [{"type": "function_call_output", "output": "x"}]},
            "Missing required parameter: 'input[0].call_id'.",
            "input[0].call_id",
            "missing_required_parameter",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "Missing required parameter: 'input[0].content[0].text'.",
            "input[0].content[0].text",
            "missing_required_parameter",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
            "Content parts of type 'input_file' are not supported.",
            "input[0].content[0].type",
            "unsupported_value",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
            "Images given by 'file_id' are not supported: send an 'image_url'.",
            "input[0].content[0].file_id",
            "unsupported_value",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "Tool choice 'nope' not found in 'tools' parameter.",
            "tool_choice",
            "invalid_value",
        ),
        (
            {"tool_choice": {"type": "web_search_preview"}},
            "Unsupported tool choice type: 'web_search_preview'. This gateway supports only 'function' and "
            "'allowed_tools'.",
            "tool_choice.type",
            "unsupported_value",
        ),
        (
            {"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
            "Missing required parameter: 'text.format.name'.",
            "text.format.name",
            "missing_required_parameter",
        ),
    ],
)
def test_what_the_gateway_cannot_serve_is_a_400_naming_the_param(
    fields: dict[str, Any], message: str, param: str, code: str
) -> None:
    assert error_of({"model": "m", "input": "Hi", **fields}) == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": code,
    }


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"input": "Hi"}, "model", "missing_required_parameter"),
        ({"model": "m"}, "input", "missing_required_parameter"),
        ({"model": "", "input": "Hi"}, "model", "invalid_type"),  # gateway/errors.py: a length is a kind
        ({"model": "m", "input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"model": "m", "input": 3}, "input", "invalid_type"),
        ({"model": "m", "input": [{"role": 1, "content": "x"}]}, "input[0].role", "invalid_type"),
        ({"model": "m", "input": "Hi", "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
        ({"model": "m", "input": "Hi", "metadata": {"k": 1}}, "metadata[...]", "invalid_type"),  # msgspec names no key
        ({"model": "m", "input": "Hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "invalid_type"),
        ({"model": "m", "input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type", "invalid_value"),
    ],
)
def test_malformed_fields_are_named(body: dict[str, Any], param: str, code: str) -> None:
    error = error_of(body)
    assert (error["param"], error["code"]) == (param, code)


def test_unknown_fields_are_accepted_and_body_errors_are_openai_shaped() -> None:
    assert request(prompt_cache_key="k", safety_identifier="s", background=False).model == "m"
    with pytest.raises(OpenAIError) as caught:
        parse_request(b"{not json")
    assert (caught.value.status, caught.value.code) == (400, "invalid_json")


# -----------------------------------------------------------------------------
# the answer as a response


def as_sent(value: Any) -> Any:
    """What the gateway sends for `value` (an answer struct): its JSON, decoded."""
    return msgspec.json.decode(msgspec.json.encode(value))


SDK = openai.types.responses
SENT_TEXT = schema.OutputText("Hi")
SENT_REASONING = schema.ReasoningItem(id="rs_1", content=[schema.ReasoningText("hm")])
SENT_MESSAGE = schema.MessageItem(id="msg_1", status="completed", content=[SENT_TEXT])
SENT_CALL = schema.FunctionCallItem(id="fc_1", call_id="call_1", name="f", arguments="{}", status="completed")
SENT_USAGE = schema.Usage(
    input_tokens=9,
    input_tokens_details=schema.InputTokensDetails(cached_tokens=2),
    output_tokens=4,
    output_tokens_details=schema.OutputTokensDetails(reasoning_tokens=1),
    total_tokens=13,
)
SENT_JSON_SCHEMA = schema.FormatJSONSchema(name="out", schema={"type": "object"}, description=None, strict=True)
SENT_TOOL = schema.FunctionToolEcho(name="f", description="d", parameters={"type": "object"}, strict=None)
# Every struct of the answer, an instance of it, and the SDK's type it stands for.
ANSWER_STRUCTS = [
    (
        schema.Response(
            id="resp_1",
            created_at=1,
            status="incomplete",
            error=None,
            incomplete_details=schema.IncompleteDetails("max_output_tokens"),
            instructions="Be nice.",
            max_output_tokens=5,
            model="m",
            output=[SENT_REASONING, SENT_MESSAGE, SENT_CALL],
            parallel_tool_calls=True,
            previous_response_id=None,
            store=True,
            temperature=None,
            text=schema.TextEcho(SENT_JSON_SCHEMA),
            tool_choice=schema.ToolChoiceFunction("f"),
            tools=[SENT_TOOL],
            top_p=None,
            usage=SENT_USAGE,
            user=None,
            metadata={"run": "7"},
        ),
        SDK.Response,
    ),
    (SENT_USAGE, SDK.ResponseUsage),
    (SENT_USAGE.input_tokens_details, SDK.response_usage.InputTokensDetails),
    (SENT_USAGE.output_tokens_details, SDK.response_usage.OutputTokensDetails),
    (SENT_MESSAGE, SDK.ResponseOutputMessage),
    (SENT_TEXT, SDK.ResponseOutputText),
    (SENT_REASONING, SDK.ResponseReasoningItem),
    (schema.ReasoningText("hm"), SDK.response_reasoning_item.Content),
    (SENT_CALL, SDK.ResponseFunctionToolCall),
    (schema.IncompleteDetails("content_filter"), SDK.response.IncompleteDetails),
    (schema.ResponseError("server_error", "engine gone"), SDK.ResponseError),
    (schema.ReasoningEcho(), openai.types.shared.Reasoning),
    (schema.FormatText(), openai.types.shared.ResponseFormatText),
    (schema.FormatJSONObject(), openai.types.shared.ResponseFormatJSONObject),
    (SENT_JSON_SCHEMA, SDK.ResponseFormatTextJSONSchemaConfig),
    (schema.TextEcho(schema.FormatText()), SDK.ResponseTextConfig),
    (schema.ToolChoiceFunction("f"), SDK.ToolChoiceFunction),
    (schema.ToolChoiceAllowed("required", [{"type": "function", "name": "f"}]), SDK.ToolChoiceAllowed),
    (SENT_TOOL, SDK.FunctionTool),
]


# Fields OpenAI's API sends that the SDK's type does not declare (it keeps them as extras).
BEYOND_THE_SDK = {schema.Response: {"store"}}


@pytest.mark.parametrize(("struct", "sdk_type"), ANSWER_STRUCTS, ids=[type(s).__name__ for s, _ in ANSWER_STRUCTS])
def test_each_answer_struct_is_the_sdks_type(struct: msgspec.Struct, sdk_type: type[pydantic.BaseModel]) -> None:
    """Each field the struct sends is one the SDK's type has, and the SDK reads what it sends back unchanged."""
    names = {field.encode_name for field in msgspec.structs.fields(struct)}
    tag_field = struct.__struct_config__.tag_field
    sdk_names = {field.alias or name for name, field in sdk_type.model_fields.items()}
    assert names | ({tag_field} if tag_field else set()) <= sdk_names | BEYOND_THE_SDK.get(type(struct), set())
    sent = as_sent(struct)
    assert sdk_type.model_validate(sent).model_dump(mode="json", by_alias=True, exclude_unset=True) == sent


def test_to_response_of_text() -> None:
    req = request(instructions="Be nice.", max_output_tokens=50, temperature=0.2, metadata={"run": "7"})
    response = as_sent(to_response(chat_answer({"content": "Hello!"}), req, "resp_1", 1700000000.9))
    assert without_ids(response) == {
        "id": "resp_1",
        "object": "response",
        "created_at": 1700000000,
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "instructions": "Be nice.",
        "max_output_tokens": 50,
        "model": "m",
        "output": [
            {
                "type": "message",
                "id": "msg_",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello!", "annotations": [], "logprobs": []}],
            }
        ],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": True,
        "temperature": 0.2,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": None,
        "truncation": "disabled",
        "usage": {
            "input_tokens": 12,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 5,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 17,
        },
        "user": None,
        "metadata": {"run": "7"},
    }
    assert Response.model_validate(response).output_text == "Hello!"


def test_to_response_of_tool_calls_keeps_the_chat_call_ids() -> None:
    calls = [
        {
            "id": "chatcmpl-tool-1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        },
        {
            "id": "chatcmpl-tool-2",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
        },
    ]
    req = request(tools=[WEATHER], tool_choice="required", previous_response_id="resp_0")
    response = as_sent(
        to_response(chat_answer({"content": None, "tool_calls": calls}, "tool_calls"), req, "resp_1", 1.0)
    )
    assert without_ids(response["output"]) == [
        {
            "type": "function_call",
            "id": "fc_",
            "call_id": "chatcmpl-tool-1",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
            "status": "completed",
        },
        {
            "type": "function_call",
            "id": "fc_",
            "call_id": "chatcmpl-tool-2",
            "name": "get_weather",
            "arguments": '{"city":"Rome"}',
            "status": "completed",
        },
    ]
    assert response["tools"] == [WEATHER]
    assert (response["tool_choice"], response["previous_response_id"]) == ("required", "resp_0")
    Response.model_validate(response)
    # Back in the history: one assistant message with both calls, as vLLM gave them.
    assert output_messages(response) == [{"role": "assistant", "content": None, "tool_calls": calls}]


def test_to_response_of_reasoning_text_and_a_call_in_order() -> None:
    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    message = {"reasoning": "Need the weather.", "content": "Checking.", "tool_calls": [call]}
    response = as_sent(to_response(chat_answer(message, "tool_calls"), request(tools=[WEATHER]), "resp_1", 1.0))
    assert [(item["type"], item["id"][:3]) for item in response["output"]] == [
        ("reasoning", "rs_"),
        ("message", "msg"),
        ("function_call", "fc_"),
    ]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "Need the weather."}]
    assert Response.model_validate(response).output_text == "Checking."
    # vLLM's older name for the field counts as well.
    older = as_sent(to_response(chat_answer({"reasoning_content": "r", "content": "x"}), request(), "resp_2", 1.0))
    assert older["output"][0]["content"][0]["text"] == "r"
    # The reasoning is dropped from the history; the text and its call are one message.
    assert output_messages(response) == [{"role": "assistant", "content": "Checking.", "tool_calls": [call]}]


def test_to_response_cut_off_by_the_limit_is_incomplete() -> None:
    response = as_sent(to_response(chat_answer({"content": "Once upon"}, "length"), request(), "resp_1", 1.0))
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"
    Response.model_validate(response)


def test_to_response_of_nothing_is_an_empty_message() -> None:
    response = as_sent(to_response(chat_answer({"content": None}), request(), "resp_1", 1.0))
    assert without_ids(response["output"]) == [
        {
            "type": "message",
            "id": "msg_",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
        }
    ]
    assert output_messages(response) == [{"role": "assistant", "content": ""}]


def test_output_messages_equal_the_output_sent_back_as_input() -> None:
    """`previous_response_id` and a client that keeps the history itself must render the same prompt."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    chat = chat_answer({"reasoning": "r", "content": "Sure.", "tool_calls": [call]}, "tool_calls")
    response = as_sent(to_response(chat, request(tools=[WEATHER]), "resp_1", 1.0))
    assert output_messages(response) == input_messages(request(input=response["output"]))


# -----------------------------------------------------------------------------
# input items


def test_input_items_of_a_string() -> None:
    items = input_items(request(input="Hello"), "resp_1")
    assert without_ids(items) == [
        {
            "type": "message",
            "id": items[0]["id"],
            "role": "user",
            "content": [{"type": "input_text", "text": "Hello"}],
            "status": "completed",
        }
    ]
    assert re.fullmatch(r"msg_[0-9a-f]{48}", items[0]["id"])
    assert input_items(request(input="Hello"), "resp_1") == items  # the same ids when listed again
    assert input_items(request(input="Hello"), "resp_2")[0]["id"] != items[0]["id"]


def test_input_items_of_a_list_keep_given_ids_and_validate() -> None:
    req = request(
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]},
            {
                "type": "message",
                "id": "msg_prev",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi", "annotations": []}],
            },
            {"type": "function_call", "id": "fc_prev", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        ]
    )
    items = input_items(req, "resp_1")
    for item in items:
        ITEM.validate_python(item)
    assert [item["id"] for item in items][2:4] == ["msg_prev", "fc_prev"]
    assert [item["id"][:4] for item in items] == ["msg_", "msg_", "msg_", "fc_p", "fco_"]
    assert items[0]["role"] == "developer"  # listed as sent, not as the chat role it became
    assert items[1]["content"] == [{"type": "input_image", "image_url": "https://x/y.png", "detail": "auto"}]
    assert items[2]["content"] == [{"type": "output_text", "text": "Hi", "annotations": [], "logprobs": []}]
    assert items[4] == {
        "type": "function_call_output",
        "id": items[4]["id"],
        "call_id": "call_1",
        "output": "42",
        "status": "completed",
    }


# -----------------------------------------------------------------------------
# the stream


def test_stream_of_text() -> None:
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}),
        chunk(finish_reason="stop"),
        USAGE_CHUNK,
    ]
    body, stream = stream_bytes(request(stream=True), chunks)
    events = events_of(body)
    assert types_of(events) == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "completed",
    ]
    assert events[0]["response"]["status"] == events[1]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    item_id = events[2]["item"]["id"]
    assert item_id.startswith("msg_")
    assert {e["item_id"] for e in events[3:8]} == {item_id}
    assert [e["delta"] for e in events[4:6]] == ["Hel", "lo"]
    assert events[6]["text"] == "Hello"
    assert events[8]["item"]["content"][0]["text"] == "Hello"
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert final["usage"]["input_tokens"] == 12
    assert final == as_sent(stream.response())
    Response.model_validate(final)
    # The same shape as the non-streamed answer to the same generation.
    whole = as_sent(to_response(chat_answer({"content": "Hello"}), request(stream=True), "resp_1", 1700000000.5))
    assert without_ids(final) == without_ids(whole)


def test_stream_of_a_tool_call_in_three_deltas() -> None:
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk(tool_delta(0, "", "chatcmpl-tool-7", "get_weather")),
        chunk(tool_delta(0, '{"city"')),
        chunk(tool_delta(0, ': "Pa')),
        chunk(tool_delta(0, 'ris"}')),
        chunk(finish_reason="tool_calls"),
        USAGE_CHUNK,
    ]
    body, stream = stream_bytes(request(stream=True, tools=[WEATHER]), chunks)
    events = events_of(body)
    assert types_of(events) == [
        "created",
        "in_progress",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]
    added = events[2]["item"]
    assert (added["call_id"], added["name"], added["arguments"], added["status"]) == (
        "chatcmpl-tool-7",
        "get_weather",
        "",
        "in_progress",
    )
    assert [e["delta"] for e in events[3:6]] == ['{"city"', ': "Pa', 'ris"}']
    assert (events[6]["arguments"], events[6]["name"]) == ('{"city": "Paris"}', "get_weather")
    assert events[7]["item"] | {"id": "x"} == {
        "type": "function_call",
        "id": "x",
        "call_id": "chatcmpl-tool-7",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "status": "completed",
    }
    assert [item["type"] for item in as_sent(stream.response())["output"]] == ["function_call"]


def test_stream_of_two_tool_calls_closes_the_first_before_the_second() -> None:
    chunks = [
        chunk(tool_delta(0, '{"city": "Paris"}', "call_a", "get_weather")),
        chunk(tool_delta(1, '{"city": "Rome"}', "call_b", "get_weather")),
        chunk(finish_reason="tool_calls"),
    ]
    events = events_of(stream_bytes(request(stream=True, tools=[WEATHER]), chunks)[0])
    assert types_of(events)[2:-1] == [
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
    ]
    assert [(e["output_index"], e["item"]["call_id"]) for e in events if e["type"] == "response.output_item.done"] == [
        (0, "call_a"),
        (1, "call_b"),
    ]
    assert events[-1]["response"]["usage"] is None  # no usage chunk came


def test_stream_keeps_a_late_delta_of_a_closed_call_and_a_name_sent_in_pieces() -> None:
    chunks = [
        chunk(tool_delta(0, '{"city": ', "call_a", "get_")),
        chunk({"tool_calls": [{"index": 0, "function": {"name": "weather"}}]}),
        chunk(tool_delta(1, "{}", "call_b", "noop")),
        chunk(tool_delta(0, '"Rome"}')),  # not how vLLM streams, but nothing may be lost
        chunk(finish_reason="tool_calls"),
    ]
    body, stream = stream_bytes(request(stream=True), chunks)
    events = events_of(body)
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in done] == [("get_weather", '{"city": '), ("noop", "{}")]
    output = as_sent(stream.response())["output"]
    assert [(item["name"], item["arguments"]) for item in output] == [
        ("get_weather", '{"city": "Rome"}'),
        ("noop", "{}"),
    ]


def test_stream_of_reasoning_then_text() -> None:
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning": "Think"}),
        chunk({"reasoning_content": "ing."}),
        chunk({"content": "Done."}, "stop"),
    ]
    events = events_of(stream_bytes(request(stream=True), chunks)[0])
    assert types_of(events) == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "reasoning_text.delta",
        "reasoning_text.delta",
        "reasoning_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "completed",
    ]
    assert events[6]["text"] == "Thinking."
    assert [e["output_index"] for e in events[2:9]] == [0] * 7
    assert [e["output_index"] for e in events[9:15]] == [1] * 6
    output = events[-1]["response"]["output"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert output[1]["content"][0]["text"] == "Done."


def test_stream_cut_off_by_the_limit_ends_incomplete() -> None:
    events = events_of(stream_bytes(request(stream=True), [chunk({"content": "Once"}, "length")])[0])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


def test_stream_without_output_still_has_a_message() -> None:
    events = events_of(stream_bytes(request(stream=True), [chunk({"role": "assistant", "content": ""}, "stop")])[0])
    assert types_of(events)[2:] == [
        "output_item.added",
        "content_part.added",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "completed",
    ]
    assert output_messages(events[-1]["response"]) == [{"role": "assistant", "content": ""}]


def test_a_turn_cut_before_it_wrote_anything_has_no_message() -> None:
    """A forced call cut before its name (vLLM streams nothing of it): no empty message, whose
    `output_text.done` with no delta before it mirascope 2.8 raises on; the response is incomplete with the output
    the model wrote, none, streamed and not, as OpenAI announces an item only once the model writes one."""
    events = events_of(stream_bytes(request(stream=True), [chunk({"role": "assistant", "content": ""}, "length")])[0])
    assert types_of(events) == ["created", "in_progress", "incomplete"]
    assert events[-1]["response"]["output"] == [] and events[-1]["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    whole = as_sent(to_response(chat_answer({"content": None}, "length"), request(), "resp_1", 1.0))
    assert (whole["status"], whole["output"]) == ("incomplete", [])
    Response.model_validate(whole)
    # After reasoning: the reasoning item only.
    chunks = [chunk({"reasoning": "Hm"}), chunk({}, "length")]
    events = events_of(stream_bytes(request(stream=True), chunks)[0])
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["reasoning"]
    assert "output_text.done" not in types_of(events)


def test_stream_that_fails_mid_text() -> None:
    stream = ResponsesStream(request(stream=True), "resp_1", 1.0)
    body = stream.start() + stream.take(chunk({"content": "Hal"}))
    assert as_sent(stream.response())["output"][0]["content"][0]["text"] == "Hal"  # the snapshot so far
    assert as_sent(stream.response())["status"] == "in_progress"
    body += stream.fail("The engine connection was lost mid-stream.", "upstream_error")
    events = events_of(body)
    assert events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "The engine connection was lost mid-stream."}
    assert failed["output"][0]["status"] == "incomplete"
    assert failed == as_sent(stream.response())
    Response.model_validate(failed)
    assert stream.finish() == b"" and stream.take(chunk({"content": "late"})) == b""  # the stream is over


# -----------------------------------------------------------------------------
# the OpenAI SDK over the translation


def test_sdk_create_reads_the_response_and_sends_a_request_the_gateway_parses() -> None:
    seen: list[dict[str, Any]] = []

    def handler(http: httpx.Request) -> httpx.Response:
        req = parse_request(http.content)
        seen.append(to_chat(req, []))
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}
        chat = chat_answer({"content": "On it.", "tool_calls": [call]}, "tool_calls")
        return httpx.Response(200, json=as_sent(to_response(chat, req, "resp_1", 1.0)))

    client = sdk_client(handler)
    response = client.responses.create(
        model="m",
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=32,
        text={"format": {"type": "json_object"}},
    )
    assert response.output_text == "On it."
    call = response.output[1]
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == ("call_1", "get_weather", '{"city":"Rome"}')
    assert response.usage is not None and response.usage.total_tokens == 17
    assert seen == [
        {
            "model": "m",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Rome?"}],
            "tools": [WEATHER_CHAT],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 32,
            "response_format": {"type": "json_object"},
            "stream": False,
        }
    ]


def stream_handler(chunks: list[dict[str, Any]]) -> Callable[[httpx.Request], httpx.Response]:
    def handler(http: httpx.Request) -> httpx.Response:
        req = parse_request(http.content)
        assert to_chat(req, [])["stream_options"] == {"include_usage": True}
        body = stream_bytes(req, chunks)[0]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    return handler


def test_sdk_stream_helper_assembles_text_and_reasoning() -> None:
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning": "Hmm."}),
        chunk({"content": "Bon"}),
        chunk({"content": "jour"}, "stop"),
        USAGE_CHUNK,
    ]
    client = sdk_client(stream_handler(chunks))
    with client.responses.stream(model="m", input="Say hello in French") as stream:
        events = list(stream)
        final = stream.get_final_response()
    snapshots = [e.snapshot for e in events if e.type == "response.output_text.delta"]
    assert snapshots == ["Bon", "Bonjour"]  # the helper's running text, built from our deltas
    assert final.output_text == "Bonjour"
    assert final.status == "completed"
    assert final.output[0].type == "reasoning"
    assert final.usage is not None and final.usage.output_tokens == 5


def test_sdk_stream_helper_assembles_function_call_arguments() -> None:
    chunks = [
        chunk(tool_delta(0, "", "call_x", "get_weather")),
        chunk(tool_delta(0, '{"ci')),
        chunk(tool_delta(0, 'ty": "Ro')),
        chunk(tool_delta(0, 'me"}')),
        chunk(finish_reason="tool_calls"),
        USAGE_CHUNK,
    ]
    client = sdk_client(stream_handler(chunks))
    with client.responses.stream(model="m", input="Weather?", tools=[WEATHER]) as stream:  # type: ignore[list-item]
        events = list(stream)
        final = stream.get_final_response()
    snapshots = [e.snapshot for e in events if e.type == "response.function_call_arguments.delta"]
    assert snapshots == ['{"ci', '{"city": "Ro', '{"city": "Rome"}']
    call = final.output[0]
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.arguments) == ("call_x", "get_weather", '{"city": "Rome"}')
    assert call.parsed_arguments == {"city": "Rome"}  # the helper parses a strict tool's arguments


def test_sdk_create_with_stream_iterates_typed_events() -> None:
    client = sdk_client(stream_handler([chunk({"content": "Hi"}, "stop"), USAGE_CHUNK]))
    events = list(client.responses.create(model="m", input="x", stream=True))
    assert [type(e).__name__ for e in events] == [
        "ResponseCreatedEvent",
        "ResponseInProgressEvent",
        "ResponseOutputItemAddedEvent",
        "ResponseContentPartAddedEvent",
        "ResponseTextDeltaEvent",
        "ResponseTextDoneEvent",
        "ResponseContentPartDoneEvent",
        "ResponseOutputItemDoneEvent",
        "ResponseCompletedEvent",
    ]
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.output_text == "Hi"
