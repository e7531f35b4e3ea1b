"""Anthropic's Messages API over chat completions: gateway/apis/messages/ (schema.py, translate.py), the pure
translation.

Requests and answers are checked against hand-written expectations, and against Anthropic's own SDK: its
`Message` type, and its client (`messages.create`, `messages.stream`) talking to a mock transport that answers
with what the translation produced, so the SDK's own parsing and stream accumulator read our bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import httpx2
import msgspec
import pydantic
import pytest
from anthropic.types import Message

from gateway.apis.messages import schema
from gateway.apis.messages.schema import AnthropicError, MessagesRequest, from_openai_error, parse_request
from gateway.apis.messages.translate import MessagesStream, to_chat, to_message
from gateway.errors import OpenAIError, model_not_found

MODEL = "tiny"
HELLO = [{"role": "user", "content": "Hello"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER_CHAT = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": WEATHER["input_schema"],
    },
}


def body(**fields: Any) -> bytes:
    return msgspec.json.encode({"model": MODEL, "max_tokens": 16, "messages": HELLO, **fields})


def parse(**fields: Any) -> MessagesRequest:
    return parse_request(body(**fields))


def refused(raw: bytes) -> tuple[int, dict[str, Any]]:
    with pytest.raises(AnthropicError) as caught:
        parse_request(raw)
    return caught.value.status, caught.value.body()


def error_body(message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


# -----------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (415, "invalid_request_error"),  # "other 4xx" in Anthropic's list
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
    ],
)
def test_error_type_follows_the_status(status: int, kind: str) -> None:
    error = AnthropicError(status, "boom")
    assert error.body() == {"type": "error", "error": {"type": kind, "message": "boom"}}
    assert AnthropicError(status, "boom", "overloaded_error").type == "overloaded_error"


def test_openai_errors_keep_their_status_and_lead_with_the_param() -> None:
    not_found = from_openai_error(model_not_found("gpt-x"))
    assert (not_found.status, not_found.type) == (404, "not_found_error")
    assert not_found.message == "The model `gpt-x` does not exist or you do not have access to it."
    starting = from_openai_error(OpenAIError(503, "The engine is starting; retry shortly.", code="engine_unavailable"))
    assert (starting.status, starting.type, starting.message) == (
        503,
        "overloaded_error",
        "The engine is starting; retry shortly.",
    )
    nested = from_openai_error(
        OpenAIError(
            400,
            "Invalid request: Expected `str`, got `int` (at 'messages[3].content[1].text').",
            param="messages[3].content[1].text",
        )
    )
    assert nested.message == "messages.3.content.1.text: Expected `str`, got `int`"


def test_missing_max_tokens_is_anthropics_400() -> None:
    raw = msgspec.json.encode({"model": MODEL, "messages": HELLO})
    assert refused(raw) == (400, error_body("max_tokens: Field required"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "max_tokens: Expected `int` >= 1"),
        ({"messages": []}, "messages: Expected `array` of length >= 1"),
        ({"model": ""}, "model: Expected `str` of length >= 1"),
        ({"messages": [{"role": "user"}]}, "messages.0.content: Field required"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role: Input should be 'user' or 'assistant'"),
        (
            {"messages": [{"role": "system", "content": "be brief"}, *HELLO]},
            'messages.0.role: Unexpected role "system". The Messages API accepts a top-level `system` parameter, '
            'not "system" as an input message role.',
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "video"}]}]},
            "messages.0.content.1: Input tag 'video' found using 'type' does not match any of the expected tags: "
            "'text', 'image', 'tool_use', 'tool_result', 'thinking', 'redacted_thinking'",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}
                ]
            },
            "messages.0.content.0.source: Input tag 'file' found using 'type' does not match any of the expected "
            "tags: 'base64', 'url'",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "audio"}]}],
                    }
                ]
            },
            "messages.0.content.0.content.0: Input tag 'audio' found using 'type' does not match any of the "
            "expected tags: 'text', 'image'",
        ),
        (
            {"system": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]},
            "system.0: Input tag 'image' found using 'type' does not match any of the expected tags: 'text'",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "d"}}]}
                ]
            },
            "messages.0.content.0: document blocks are not supported by this gateway: send the document's text as "
            "a text block.",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            "messages.0.content.0: tool_use blocks are only allowed in assistant messages.",
        ),
        (
            {
                "messages": [
                    *HELLO,
                    {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]},
                    *HELLO,
                ]
            },
            "messages.1.content.0: tool_result blocks are only allowed in user messages.",
        ),
        (
            {
                "messages": [
                    *HELLO,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
                    },
                ]
            },
            "messages.1: a final assistant message is continued as a prefill and may not hold tool_use blocks: "
            "send their tool_result blocks in a user message after it.",
        ),
        ({"tool_choice": {"type": "maybe"}}, "tool_choice.type: Invalid enum value 'maybe'"),
        ({"tool_choice": {"type": "any"}}, "tool_choice: tool_choice of type 'any' needs `tools`."),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name: Field required"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_time"}},
            "tool_choice.name: no tool named 'get_time' among `tools`.",
        ),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema: Field required"),
        (
            {"tools": [WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]},
            "tools.1.type: server tool 'web_search_20250305' is not supported by this gateway; only custom tools "
            "(name, description, input_schema) are.",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools: Tool names must be unique: 'get_weather' is given twice."),
        (
            {"tools": [{"name": "f", "input_schema": {"type": "objekt"}}]},
            "tools.0.input_schema: 'objekt' is not valid under any of the given schemas (at 'type').",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_param(fields: dict[str, Any], message: str) -> None:
    assert refused(body(**fields)) == (400, error_body(message))


def test_a_body_that_is_not_json_is_a_400() -> None:
    status, error = refused(b'{"model": ')
    assert status == 400
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith("Request body is not valid JSON")


def test_accepted_extras_and_unknown_fields() -> None:
    request = parse(
        thinking={"type": "enabled", "budget_tokens": 1024},
        metadata={"user_id": "u1"},
        service_tier="auto",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}
        ],
        tools=[{**WEATHER, "type": "custom", "cache_control": {"type": "ephemeral"}}],
    )
    assert request.thinking == {"type": "enabled", "budget_tokens": 1024}
    assert to_chat(request)["messages"] == [{"role": "user", "content": "hi"}]


# -----------------------------------------------------------------------------
# request → chat request


def test_minimal_request() -> None:
    assert to_chat(parse()) == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 16,
        "stream": False,
    }


def test_system_as_string_and_as_blocks() -> None:
    assert to_chat(parse(system="Be brief."))["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
    ]
    blocks = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in French."}]
    assert to_chat(parse(system=blocks))["messages"][0] == {
        "role": "system",
        "content": "Be brief.\nAnswer in French.",
    }
    assert to_chat(parse(system=""))["messages"] == [{"role": "user", "content": "Hello"}]
    assert to_chat(parse(system=[]))["messages"] == [{"role": "user", "content": "Hello"}]


def test_tool_use_and_tool_results_become_one_assistant_message_then_tool_messages() -> None:
    request = parse(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "two calls", "signature": "sig"},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Zürich"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here you go."},  # after the results, as the results answer the calls
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "rain"}, {"type": "text", "text": "12°C"}],
                        "is_error": False,
                    },
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "redacted_thinking", "data": "xx"}, {"type": "text", "text": "Done"}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
        ],
    )
    assert to_chat(request)["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Zürich"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "rain\n12°C"},
        {"role": "user", "content": "Here you go."},
        {"role": "assistant", "content": "Done"},
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""},  # no user message: it held only a result
    ]


def test_an_assistant_message_of_calls_only_has_no_content() -> None:
    request = parse(
        tools=[WEATHER],
        messages=[
            *HELLO,
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
        ],
    )
    assistant = to_chat(request)["messages"][1]
    assert assistant == {
        "role": "assistant",
        "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
    }


def test_images_become_image_url_parts() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}
    linked = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}}
    request = parse(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image, linked]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [linked]}]},
        ]
    )
    assert to_chat(request)["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
            ],
        },
        {
            "role": "assistant",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "look", "arguments": "{}"}}],
        },
        {
            "role": "tool",
            "tool_call_id": "t1",
            "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}],
        },
    ]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any) -> None:
    chat = to_chat(parse(tools=[WEATHER], tool_choice=choice))
    assert chat["tools"] == [WEATHER_CHAT]
    assert chat["tool_choice"] == expected
    assert "parallel_tool_calls" not in chat
    serial = to_chat(parse(tools=[WEATHER], tool_choice={**choice, "disable_parallel_tool_use": True}))
    assert serial["parallel_tool_calls"] is False


def test_tools_without_choice_and_choice_without_tools() -> None:
    chat = to_chat(parse(tools=[{"name": "ping", "input_schema": {"type": "object"}}]))
    assert chat["tools"] == [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}]
    assert "tool_choice" not in chat  # the engine then picks "auto", as Anthropic does
    assert "tool_choice" not in to_chat(parse(tool_choice={"type": "auto"}))  # the engine refuses one without tools


def test_sampling_options_and_streaming() -> None:
    bias = {"9": 100.0}  # vLLM's, passed on: how a test closes a random model's reasoning (test_families.py)
    chat = to_chat(
        parse(stop_sequences=["END", "\n\n"], temperature=0.5, top_p=0.9, top_k=40, logit_bias=bias, stream=True)
    )
    assert chat == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 16,
        "stop": ["END", "\n\n"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "logit_bias": bias,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_a_final_assistant_message_is_continued() -> None:
    prefill = parse(messages=[*HELLO, {"role": "assistant", "content": "The answer is ("}])
    chat = to_chat(prefill)
    assert chat["messages"][-1] == {"role": "assistant", "content": "The answer is ("}
    assert chat["continue_final_message"] is True
    assert chat["add_generation_prompt"] is False
    normal = to_chat(parse(messages=[*HELLO, {"role": "assistant", "content": "Hi"}, *HELLO]))
    assert "continue_final_message" not in normal
    assert "add_generation_prompt" not in normal


# -----------------------------------------------------------------------------
# chat answer → message


def as_sent(value: Any) -> Any:
    """What the gateway sends for `value` (an answer struct): its JSON, decoded."""
    return msgspec.json.decode(msgspec.json.encode(value))


TOOL_USE = schema.ToolUseBlock("toolu_1", "get_weather", {"city": "Rome"})
# Every struct of the answer, an instance of it, and the SDK's type it stands for.
ANSWER_STRUCTS = [
    (
        schema.Message(
            id="msg_1",
            model=MODEL,
            content=[schema.ThinkingBlock("hm"), schema.TextBlock("Hi"), TOOL_USE],
            stop_reason="tool_use",
            stop_sequence=None,
            usage=schema.Usage(9, 4),
        ),
        anthropic.types.Message,
    ),
    (schema.Usage(9, 4), anthropic.types.Usage),
    (schema.TextBlock("Hi"), anthropic.types.TextBlock),
    (schema.ThinkingBlock("hm"), anthropic.types.ThinkingBlock),
    (TOOL_USE, anthropic.types.ToolUseBlock),
    (schema.MessageTokensCount(12), anthropic.types.MessageTokensCount),
]


@pytest.mark.parametrize(("struct", "sdk_type"), ANSWER_STRUCTS, ids=[type(s).__name__ for s, _ in ANSWER_STRUCTS])
def test_each_answer_struct_is_the_sdks_type(struct: msgspec.Struct, sdk_type: type[pydantic.BaseModel]) -> None:
    """Each field the struct sends is one the SDK's type has, and the SDK reads what it sends back unchanged."""
    names = {field.encode_name for field in msgspec.structs.fields(struct)}
    tag_field = struct.__struct_config__.tag_field
    assert names | ({tag_field} if tag_field else set()) <= set(sdk_type.model_fields)
    sent = as_sent(struct)
    assert sdk_type.model_validate(sent).model_dump(mode="json", exclude_unset=True) == sent


def chat_answer(
    message: dict[str, Any], finish: str = "stop", stop_reason: Any = None, usage: tuple[int, int] = (9, 4)
) -> dict[str, Any]:
    """vLLM's chat.completion, as the gateway receives it."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "tiny@3",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": [], **message},
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": [5, 6, 7, 8],
            }
        ],
        "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)},
        "prompt_token_ids": list(range(usage[0])),
    }


def test_text_answer() -> None:
    message = as_sent(to_message(chat_answer({"content": "Hi there"}), parse(), "msg_1"))
    assert message == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "text", "text": "Hi there"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 9,
            "output_tokens": 4,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }
    assert Message.model_validate(message).content[0].text == "Hi there"


@pytest.mark.parametrize(
    ("finish", "matched", "stop_reason", "stop_sequence"),
    [
        ("stop", None, "end_turn", None),
        ("stop", 151645, "end_turn", None),  # a stop token's id, not one of the stop sequences
        ("stop", "END", "stop_sequence", "END"),
        ("length", None, "max_tokens", None),
    ],
)
def test_stop_reasons(finish: str, matched: Any, stop_reason: str, stop_sequence: str | None) -> None:
    request = parse(stop_sequences=["END"])
    message = as_sent(to_message(chat_answer({"content": "x"}, finish, matched), request, "msg_1"))
    assert (message["stop_reason"], message["stop_sequence"]) == (stop_reason, stop_sequence)
    Message.model_validate(message)


def test_reasoning_and_tool_calls() -> None:
    answer = chat_answer(
        {
            "reasoning": "Need the weather.",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": Rome'}},
            ],
        },
        finish="tool_calls",
    )
    message = as_sent(to_message(answer, parse(tools=[WEATHER]), "msg_2"))
    assert message["content"] == [
        {"type": "thinking", "thinking": "Need the weather.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Rome"}},
        {"type": "tool_use", "id": "call_2", "name": "get_weather", "input": {}},  # arguments not JSON
    ]
    assert message["stop_reason"] == "tool_use"
    validated = Message.model_validate(message)
    assert [block.type for block in validated.content] == ["thinking", "text", "tool_use", "tool_use"]


def test_a_named_tool_choice_answer_is_tool_use_even_when_the_engine_says_stop() -> None:
    call = {"id": "", "type": "function", "function": {"name": "get_weather", "arguments": '["Rome"]'}}
    message = as_sent(
        to_message(chat_answer({"reasoning_content": "hm", "tool_calls": [call]}), parse(tools=[WEATHER]), "m")
    )
    assert message["stop_reason"] == "tool_use"
    thinking, tool_use = message["content"]
    assert thinking == {"type": "thinking", "thinking": "hm", "signature": ""}
    assert tool_use["id"].startswith("toolu_") and len(tool_use["id"]) == 30  # made up: the engine sent none
    assert tool_use["input"] == {}  # JSON, but not an object
    Message.model_validate(message)


def test_a_malformed_engine_answer_raises() -> None:
    with pytest.raises(IndexError):
        to_message({"choices": []}, parse(), "m")
    with pytest.raises(KeyError):
        to_message({"choices": [{"index": 0}]}, parse(), "m")


# -----------------------------------------------------------------------------
# chat stream → events


def chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    stop_reason: Any = None,
    token_ids: list[int] | None = None,
    **top: Any,
) -> dict[str, Any]:
    """One vLLM chat.completion.chunk, as the engine sends it."""
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish, "token_ids": token_ids}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tiny", "choices": [choice], **top}


def first_chunk(prompt_tokens: int = 7) -> dict[str, Any]:
    return chunk({"role": "assistant", "content": ""}, prompt_token_ids=list(range(prompt_tokens)))


def usage_chunk(prompt: int, completion: int) -> dict[str, Any]:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tiny", "choices": [], "usage": usage}


def stream_bytes(request: MessagesRequest, chunks: list[dict[str, Any]], message_id: str = "msg_s") -> bytes:
    stream = MessagesStream(request, message_id)
    return b"".join(stream.take(c) for c in chunks) + stream.finish()


def events(raw: bytes) -> list[dict[str, Any]]:
    """The SSE events' data, checking each event's name is its data's `type`."""
    found = []
    for frame in raw.decode().split("\n\n"):
        if not frame:
            continue
        name_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        found.append(data)
    assert raw == b"" or raw.endswith(b"\n\n")
    return found


TEXT_CHUNKS = [
    first_chunk(7),
    chunk({"content": "Hel"}, token_ids=[1]),
    chunk({"content": "lo"}, token_ids=[2]),
    chunk({"content": "!"}, finish="stop", token_ids=[3]),
    usage_chunk(7, 3),
]


def test_text_stream_events() -> None:
    sent = events(stream_bytes(parse(stream=True), TEXT_CHUNKS))
    assert sent == [
        {
            "type": "message_start",
            "message": {
                "id": "msg_s",
                "type": "message",
                "role": "assistant",
                "model": MODEL,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": 7,  # from the first chunk's prompt token ids
                    "output_tokens": 0,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                },
            },
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": 3, "input_tokens": 7},
        },
        {"type": "message_stop"},
    ]


def test_start_sends_message_start_once() -> None:
    stream = MessagesStream(parse(stream=True), "msg_s")
    started = events(stream.start())
    assert [e["type"] for e in started] == ["message_start"]
    assert started[0]["message"]["usage"]["input_tokens"] == 0  # not known before the engine answers
    assert stream.start() == b""
    later = events(stream.take(first_chunk(7)) + stream.take(chunk({"content": "x"})))
    assert [e["type"] for e in later] == ["content_block_start", "content_block_delta"]
    end = events(stream.finish())
    assert end[-2]["usage"] == {"output_tokens": 0, "input_tokens": 7}


def test_block_kinds_change_in_order_and_stop_sequence() -> None:
    request = parse(stream=True, stop_sequences=["STOP"])
    chunks = [
        first_chunk(),
        chunk({"reasoning": "think"}),
        chunk({"reasoning_content": "ing"}),
        chunk({"content": "Answer"}, finish="stop", stop_reason="STOP"),
    ]
    stream = MessagesStream(request, "msg_s")
    sent = events(b"".join(stream.take(c) for c in chunks) + stream.finish())
    assert [(e["type"], e.get("index")) for e in sent] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert sent[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert sent[3]["delta"] == {"type": "thinking_delta", "thinking": "ing"}
    assert sent[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}
    # No usage chunk came: the output count is what the chunks carried (none here), the input the prompt's.
    assert sent[-2]["usage"] == {"output_tokens": 0, "input_tokens": 7}
    final = as_sent(stream.message())
    assert final["content"] == [
        {"type": "thinking", "thinking": "thinking", "signature": ""},
        {"type": "text", "text": "Answer"},
    ]
    Message.model_validate(final)


def tool_chunks(arguments: list[str], call_id: str = "call_1") -> list[dict[str, Any]]:
    head = {"index": 0, "id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    rest = [{"index": 0, "function": {"arguments": piece}} for piece in arguments]
    return [
        first_chunk(11),
        chunk({"content": "Let me look."}, token_ids=[1, 2]),
        chunk({"tool_calls": [head]}, token_ids=[3]),
        *(chunk({"tool_calls": [call]}, token_ids=[4]) for call in rest),
        chunk({}, finish="tool_calls"),
        usage_chunk(11, 9),
    ]


def test_tool_call_stream_holds_arguments_until_the_block_ends() -> None:
    stream = MessagesStream(parse(stream=True, tools=[WEATHER]), "msg_t")
    chunks = tool_chunks(['{"ci', 'ty": "Pa', 'ris"}'])
    sent: list[dict[str, Any]] = []
    for c in chunks[:-2]:
        sent += events(stream.take(c))
    assert sent[-1] == {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}},
    }
    assert as_sent(stream.message())["content"][1]["input"] == {"city": "Paris"}
    sent = events(b"".join(stream.take(c) for c in chunks[-2:]) + stream.finish())
    assert sent == [
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"ci'}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": 'ty": "Pa'}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": 'ris"}'}},
        {"type": "content_block_stop", "index": 1},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 9, "input_tokens": 11},
        },
        {"type": "message_stop"},
    ]


def test_malformed_tool_arguments_stream_as_an_empty_object() -> None:
    raw = stream_bytes(parse(stream=True, tools=[WEATHER]), tool_chunks(['{"city": ', "Paris}"]))
    deltas = [e["delta"] for e in events(raw) if e["type"] == "content_block_delta" and e["index"] == 1]
    assert deltas == [{"type": "input_json_delta", "partial_json": "{}"}]


def test_two_tool_calls_are_two_blocks() -> None:
    calls = [
        chunk({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "get_weather", "arguments": '{"city":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Rome"}'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "get_weather", "arguments": "{}"}}]}),
    ]
    stream = MessagesStream(parse(stream=True, tools=[WEATHER]), "msg_t")
    sent = events(b"".join(stream.take(c) for c in [first_chunk(), *calls, chunk({}, finish="stop")]) + stream.finish())
    assert [(e["type"], e.get("index")) for e in sent[1:-2]] == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
    ]
    assert as_sent(stream.message())["content"] == [
        {"type": "tool_use", "id": "a", "name": "get_weather", "input": {"city": "Rome"}},
        {"type": "tool_use", "id": "b", "name": "get_weather", "input": {}},
    ]
    assert as_sent(stream.message())["stop_reason"] == "tool_use"


def test_the_output_count_falls_back_to_the_tokens_seen() -> None:
    stream = MessagesStream(parse(stream=True), "msg_s")
    raw = b"".join(stream.take(c) for c in TEXT_CHUNKS[:-1]) + stream.finish()  # no usage chunk
    assert events(raw)[-2]["usage"] == {"output_tokens": 3, "input_tokens": 7}


def test_streamed_message_equals_the_unstreamed_one() -> None:
    request = parse(tools=[WEATHER])
    stream = MessagesStream(request, "m")
    stream_bytes_ = b"".join(stream.take(c) for c in tool_chunks(['{"city": "Rome"}'])) + stream.finish()
    assert stream_bytes_
    unstreamed = chat_answer(
        {
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        finish="tool_calls",
        usage=(11, 9),
    )
    assert stream.message() == to_message(unstreamed, request, "m")


def test_fail_is_an_error_event() -> None:
    assert MessagesStream(parse(), "m").fail("engine gone") == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"engine gone"}}\n\n'
    )


# -----------------------------------------------------------------------------
# Anthropic's SDK against the translation


Handler = Callable[[httpx2.Request], httpx2.Response]


def sdk(handler: Handler) -> anthropic.Anthropic:
    transport = httpx2.MockTransport(handler)
    return anthropic.Anthropic(
        base_url="http://test", api_key="x", max_retries=0, http_client=httpx2.Client(transport=transport)
    )


def serving(answer: Callable[[MessagesRequest], httpx2.Response], seen: list[MessagesRequest]) -> Handler:
    """A /v1/messages endpoint: parses what the SDK sent with parse_request, answers with `answer`."""

    def handle(http: httpx2.Request) -> httpx2.Response:
        assert http.method == "POST" and http.url.path == "/v1/messages"
        try:
            request = parse_request(http.content)
        except AnthropicError as exc:
            return httpx2.Response(exc.status, json=exc.body())
        seen.append(request)
        return answer(request)

    return handle


def sse(raw: bytes) -> httpx2.Response:
    return httpx2.Response(200, content=raw, headers={"content-type": "text/event-stream"})


def test_sdk_create_reads_to_message() -> None:
    seen: list[MessagesRequest] = []

    def answer(request: MessagesRequest) -> httpx2.Response:
        chat = chat_answer({"content": "Bonjour"}, finish="stop", stop_reason="FIN")
        return httpx2.Response(200, json=as_sent(to_message(chat, request, "msg_sdk")))

    client = sdk(serving(answer, seen))
    message = client.messages.create(
        model=MODEL,
        max_tokens=32,
        system=[{"type": "text", "text": "French only."}],
        stop_sequences=["FIN"],
        messages=[{"role": "user", "content": "Hello"}],
    )
    assert to_chat(seen[0]) == {
        "model": MODEL,
        "messages": [{"role": "system", "content": "French only."}, {"role": "user", "content": "Hello"}],
        "max_tokens": 32,
        "stop": ["FIN"],
        "stream": False,
    }
    assert message.id == "msg_sdk"
    assert message.content[0].type == "text" and message.content[0].text == "Bonjour"
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "FIN")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (9, 4)


def test_sdk_stream_text() -> None:
    seen: list[MessagesRequest] = []
    client = sdk(serving(lambda request: sse(stream_bytes(request, TEXT_CHUNKS)), seen))
    with client.messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert seen[0].stream is True
    assert to_chat(seen[0])["stream_options"] == {"include_usage": True}
    assert text == "Hello!"
    assert [(b.type, b.text) for b in final.content if b.type == "text"] == [("text", "Hello!")]
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == ("end_turn", 7, 3)


def test_sdk_stream_tool_use() -> None:
    seen: list[MessagesRequest] = []
    chunks = tool_chunks(['{"ci', 'ty": "Pa', 'ris"}'])
    client = sdk(serving(lambda request: sse(stream_bytes(request, chunks)), seen))
    with client.messages.stream(
        model=MODEL,
        max_tokens=64,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert to_chat(seen[0])["tool_choice"] == "required"
    assert text == "Let me look."
    assert [block.type for block in final.content] == ["text", "tool_use"]
    tool_use = final.content[1]
    assert tool_use.type == "tool_use"
    assert (tool_use.id, tool_use.name, tool_use.input) == ("call_1", "get_weather", {"city": "Paris"})
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == ("tool_use", 11, 9)


def test_sdk_stream_thinking_then_text() -> None:
    chunks = [
        first_chunk(5),
        chunk({"reasoning": "The user "}),
        chunk({"reasoning": "greets."}),
        chunk({"content": "Hi"}),
        chunk({"content": "!"}, finish="length"),
        usage_chunk(5, 6),
    ]
    client = sdk(serving(lambda request: sse(stream_bytes(request, chunks)), []))
    with client.messages.stream(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "Hi!"
    thinking, answer = final.content
    assert thinking.type == "thinking" and thinking.thinking == "The user greets." and thinking.signature == ""
    assert answer.type == "text" and answer.text == "Hi!"
    assert final.stop_reason == "max_tokens"


def test_sdk_raises_on_a_stream_error_event() -> None:
    def answer(request: MessagesRequest) -> httpx2.Response:
        stream = MessagesStream(request, "m")
        return sse(stream.take(first_chunk()) + stream.take(chunk({"content": "par"})) + stream.fail("engine gone"))

    client = sdk(serving(answer, []))
    with (
        pytest.raises(anthropic.APIStatusError) as caught,
        client.messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}]) as s,
    ):
        "".join(s.text_stream)
    assert (caught.value.type, caught.value.api_message) == ("api_error", "engine gone")


@pytest.mark.parametrize(
    ("error", "raised"),
    [
        (None, anthropic.BadRequestError),  # parse_request's own refusal: the missing max_tokens below
        (from_openai_error(model_not_found(MODEL)), anthropic.NotFoundError),
        (AnthropicError(429, "slow down"), anthropic.RateLimitError),
        (from_openai_error(OpenAIError(503, "The engine is starting; retry shortly.")), anthropic.InternalServerError),
    ],
)
def test_sdk_raises_typed_errors_with_our_message(error: AnthropicError | None, raised: type[Exception]) -> None:
    def handle(http: httpx2.Request) -> httpx2.Response:
        try:
            parse_request(http.content)
        except AnthropicError as exc:
            return httpx2.Response(exc.status, json=exc.body())
        assert error is not None
        return httpx2.Response(error.status, json=error.body())

    client = sdk(handle)
    kwargs: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    if error is not None:
        kwargs["max_tokens"] = 8
    expected = error or AnthropicError(400, "max_tokens: Field required")
    with pytest.raises(raised) as caught:
        if error is None:  # the SDK insists on max_tokens: send the body by hand
            client.post("/v1/messages", body=kwargs, cast_to=Message)
        else:
            client.messages.create(**kwargs)
    assert caught.value.status_code == expected.status
    assert caught.value.type == expected.type
    assert caught.value.api_message == expected.message
