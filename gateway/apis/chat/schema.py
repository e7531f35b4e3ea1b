"""Chat completions' request, as the gateway reads it: the typed head it relies on or bounds, the whole body
as sent, and the tool-schema check every API shares. The rest of the request is vLLM's to validate.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
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
    choice = request.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        offered = {tool.function.name for tool in head.tools or ()}
        check_allowed_tools(choice.get("allowed_tools"), offered, "tool_choice.allowed_tools", chat=True)
    return head, request


def check_allowed_tools(allowed: Any, offered: Collection[str | None], where: str, *, chat: bool) -> None:
    """OpenAI's `allowed_tools` tool choice (`where`: its `mode` and `tools`; chat names a tool as
    `{"type": "function", "function": {"name"}}`, Responses as `{"type": "function", "name"}`): a mode the engine
    has (`auto`, `required`), and function tools among those the request offers. A 400 naming the param else."""
    fields = allowed if isinstance(allowed, dict) else {}
    if "mode" not in fields:
        raise invalid_request(
            f"Missing required parameter: '{where}.mode'.", param=f"{where}.mode", code="missing_required_parameter"
        )
    if fields["mode"] not in ("auto", "required"):
        raise invalid_request(
            f"Invalid value: '{fields['mode']}'. Supported values are: 'auto' and 'required'.",
            param=f"{where}.mode",
            code="invalid_value",
        )
    tools = fields.get("tools")
    if not isinstance(tools, list) or not tools:
        raise invalid_request(
            f"'{where}.tools' must name at least one of the request's tools.",
            param=f"{where}.tools",
            code="invalid_value",
        )
    for i, tool in enumerate(tools):
        at = f"{where}.tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise invalid_request(
                f"Unsupported tool type: '{kind}'. This gateway supports only 'function' tools.",
                param=f"{at}.type",
                code="unsupported_value",
            )
        named = (tool.get("function") or {}) if chat else tool
        name = named.get("name") if isinstance(named, dict) else None
        if name not in offered:
            raise invalid_request(
                f"Allowed tool '{name}' not found in 'tools' parameter.",
                param=f"{at}.function.name" if chat else f"{at}.name",
                code="invalid_value",
            )


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
