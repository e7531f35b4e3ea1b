"""Chat completions' request, as the gateway reads it: the typed head it relies on or bounds, the whole body
as sent, and the tool-schema check every API shares. The rest of the request is vLLM's to validate.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

import msgspec
from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for

from gateway.errors import decode_body, decode_json, invalid_request

_decode = msgspec.json.decode

# OpenAI's roles; vLLM would render any other into the prompt as text.
ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
MAX_N = 128  # choices per call: each is a full generation, so one request could otherwise occupy the engine
MAX_TOP_LOGPROBS = 20  # OpenAI's cap, and vLLM's default --max-logprobs


class ChatMessageHead(msgspec.Struct, frozen=True):
    role: str  # checked against ROLES by hand: OpenAI's message names the supported values


class FunctionHead(msgspec.Struct, frozen=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    # Kept as the bytes sent: the schema check is cached by them, and agents send the same tools every call.
    parameters: msgspec.Raw = msgspec.Raw()


class ToolHead(msgspec.Struct, frozen=True):
    type: Literal["function"]
    function: FunctionHead


class ChatRequestHead(msgspec.Struct, frozen=True):
    """The fields of a chat request the gateway itself relies on or bounds. The rest goes to vLLM as sent
    (unknown fields are kept, not dropped): vLLM validates them and its 400s pass through."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    messages: Annotated[list[ChatMessageHead], msgspec.Meta(min_length=1)]
    stream: bool | None = False
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = 1
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ToolHead] | None = None


_head_decoder = msgspec.json.Decoder(ChatRequestHead)
_request_decoder: msgspec.json.Decoder[dict[str, Any]] = msgspec.json.Decoder(dict)


def parse_chat_request(body: bytes) -> tuple[ChatRequestHead, dict[str, Any]]:
    """The typed head (400 naming the param if it is wrong) and the whole request as sent."""
    head = decode_body(body, ChatRequestHead, _head_decoder)  # nesting depth checked here, once
    request = decode_json(body, dict, _request_decoder)
    for i, message in enumerate(head.messages):
        if message.role not in ROLES:
            raise invalid_request(
                f"Invalid value: '{message.role}'. Supported values are: 'system', 'assistant', 'user', "
                "'function', 'tool', and 'developer'.",
                param=f"messages[{i}].role",
                code="invalid_value",
            )
    for i, tool in enumerate(head.tools or ()):
        problem = schema_problem(bytes(tool.function.parameters))
        if problem is not None:
            raise invalid_request(
                f"Invalid schema for function '{tool.function.name}': {problem}",
                param=f"tools[{i}].function.parameters",
                code="invalid_function_parameters",
            )
    return head, request


@functools.lru_cache(maxsize=1024)
def schema_problem(raw: bytes) -> str | None:
    """What is wrong with a tool's `parameters` (None: a valid JSON Schema object, or none given). Cached by the
    encoded schema: agents send the same tools on every call. Every API's tools are checked by it."""
    if raw in (b"", b"null"):
        return None
    schema = _decode(raw)
    if not isinstance(schema, dict):
        return "parameters must be a JSON Schema object."
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"{exc.message}" + (f" (at '{where}')." if where else ".")
    return None
