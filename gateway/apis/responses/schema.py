"""OpenAI's Responses API on the wire: the request, typed and checked (`parse_request`: what msgspec checks
(types, bounds, JSON, depth) and what it cannot (each input item kind's required fields, roles, the supported
tools and items), each error a 400 in OpenAI's shape naming the param); and the answer's structs (`Response`,
its output items, usage and echoed settings), which the translation fills.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

import msgspec

from gateway.apis.chat.schema import check_allowed_tools, schema_problem
from gateway.errors import OpenAIError, decode_body, invalid_request

_encode = msgspec.json.encode


class ContentPart(msgspec.Struct, frozen=True):
    """One part of a message's content, or of a function call's output. Every kind in one struct: which fields
    a part needs depends on its `type`, checked by `parse_request` so the error can name the part."""

    type: str
    text: str | None = None
    refusal: str | None = None  # a `refusal` part's text
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputItem(msgspec.Struct, frozen=True):
    """One item of `input`, of any kind. Not a tagged union: a message may leave out `type` (OpenAI's "easy"
    message), and an item reference may too, so the kind is worked out by hand (`item_kind`)."""

    type: str | None = None
    id: str | None = None
    status: str | None = None
    role: str | None = None  # message
    content: str | list[ContentPart] | None = None  # message; reasoning (its reasoning_text parts)
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    output: str | list[ContentPart] | None = None  # function_call_output
    summary: list[ContentPart] | None = None  # reasoning


class Tool(msgspec.Struct, frozen=True):
    """A tool as the Responses API declares it (flat, unlike chat's `{"type", "function": {...}}`). `type` is a
    plain string so that another kind of tool gets a message saying only functions are supported."""

    type: str
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(msgspec.Struct, frozen=True):
    """A tool choice object: a named function (`type`: "function", `name`), or OpenAI's allowed tools
    (`type`: "allowed_tools", `mode`, `tools`: `{"type": "function", "name"}` each)."""

    type: str
    name: str | None = None
    mode: str | None = None
    tools: list[Any] | None = None


class TextFormat(msgspec.Struct, frozen=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, frozen=True):
    format: TextFormat | None = None


# OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
    msgspec.Meta(max_length=16),
]


class ResponsesRequest(msgspec.Struct, frozen=True):
    """The fields of a Responses request the gateway reads or bounds. Other fields OpenAI defines (`include`,
    `service_tier`, ...) are accepted and ignored: msgspec skips fields a struct does not name."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    metadata: Metadata | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    # vLLM's sampling extras, passed to the engine as its own endpoints take them (OpenAI's API has none of them).
    seed: int | None = None
    top_k: int | None = None
    logit_bias: dict[str, float] | None = None


_decoder = msgspec.json.Decoder(ResponsesRequest)

_ROLES = ("assistant", "system", "developer", "user")
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_PART_TYPES = ("input_text", "output_text", "refusal", "input_image")
# Input items OpenAI defines for its hosted tools and features: a clear "not supported" rather than "invalid".
_UNSUPPORTED_ITEM_TYPES = frozenset(
    """
    item_reference file_search_call computer_call computer_call_output web_search_call image_generation_call
    code_interpreter_call local_shell_call local_shell_call_output shell_call shell_call_output apply_patch_call
    apply_patch_call_output mcp_list_tools mcp_approval_request mcp_approval_response mcp_call custom_tool_call
    custom_tool_call_output tool_search_call tool_search_output additional_tools compaction
    """.split()
)
_UNSUPPORTED_PART_TYPES = frozenset({"input_file", "input_audio"})


def parse_request(body: bytes) -> ResponsesRequest:
    """The request, or a 400 in OpenAI's shape naming the param: what msgspec checks (types, bounds, JSON, depth)
    and what it cannot (each item kind's required fields, roles, supported tool and item types)."""
    request = decode_body(body, ResponsesRequest, _decoder)
    if isinstance(request.input, list):
        for i, item in enumerate(request.input):
            _check_item(item, f"input[{i}]")
    for i, tool in enumerate(request.tools or ()):
        _check_tool(tool, f"tools[{i}]")
    _check_tool_choice(request)
    if request.text is not None and request.text.format is not None:
        _check_text_format(request.text.format)
    return request


def _missing(param: str) -> OpenAIError:
    return invalid_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")


def _invalid_value(value: str, supported: Iterable[str], param: str) -> OpenAIError:
    """OpenAI's message for a value outside an enum: "Supported values are: 'a', 'b', and 'c'."."""
    names = [f"'{s}'" for s in supported]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + f", and {names[-1]}"
    return invalid_request(
        f"Invalid value: '{value}'. Supported values are: {listed}.", param=param, code="invalid_value"
    )


def _unsupported(message: str, param: str) -> OpenAIError:
    return invalid_request(message, param=param, code="unsupported_value")


def item_kind(item: InputItem) -> str:
    """The item's type; OpenAI lets a message leave it out (`{"role", "content"}`), and an item reference too
    (`{"id"}`)."""
    if item.type is not None:
        return item.type
    if item.role is not None:
        return "message"
    return "item_reference" if item.id is not None else ""


def _check_item(item: InputItem, where: str) -> None:
    kind = item_kind(item)
    if kind == "message":
        _check_message(item, where)
    elif kind == "function_call":
        for name, value in (("call_id", item.call_id), ("name", item.name), ("arguments", item.arguments)):
            if value is None:
                raise _missing(f"{where}.{name}")
    elif kind == "function_call_output":
        if item.call_id is None:
            raise _missing(f"{where}.call_id")
        if item.output is None:
            raise _missing(f"{where}.output")
        if isinstance(item.output, list):
            for j, part in enumerate(item.output):
                _check_part(part, f"{where}.output[{j}]")
    elif kind == "reasoning":
        pass  # accepted and dropped: the chat templates vLLM renders leave past reasoning out
    elif kind == "item_reference":
        raise _unsupported(
            "Input items of type 'item_reference' are not supported: send the items themselves, or use "
            "'previous_response_id'.",
            f"{where}.type",
        )
    elif kind in _UNSUPPORTED_ITEM_TYPES:
        raise _unsupported(
            f"Input items of type '{kind}' are not supported: this gateway serves function tools only.",
            f"{where}.type",
        )
    elif not kind:
        raise _missing(f"{where}.type")
    else:
        raise _invalid_value(kind, _ITEM_TYPES, f"{where}.type")


def _check_message(item: InputItem, where: str) -> None:
    if item.role is None:
        raise _missing(f"{where}.role")
    if item.role not in _ROLES:
        raise _invalid_value(item.role, _ROLES, f"{where}.role")
    if item.content is None:
        raise _missing(f"{where}.content")
    if isinstance(item.content, list):
        for j, part in enumerate(item.content):
            _check_part(part, f"{where}.content[{j}]")


def _check_part(part: ContentPart, where: str) -> None:
    if part.type in ("input_text", "output_text"):
        if part.text is None:
            raise _missing(f"{where}.text")
    elif part.type == "refusal":
        if part.refusal is None:
            raise _missing(f"{where}.refusal")
    elif part.type == "input_image":
        if part.image_url is None and part.file_id is not None:
            raise _unsupported("Images given by 'file_id' are not supported: send an 'image_url'.", f"{where}.file_id")
        if part.image_url is None:
            raise _missing(f"{where}.image_url")
    elif part.type in _UNSUPPORTED_PART_TYPES:
        raise _unsupported(f"Content parts of type '{part.type}' are not supported.", f"{where}.type")
    else:
        raise _invalid_value(part.type, _PART_TYPES, f"{where}.type")


def _check_tool(tool: Tool, where: str) -> None:
    if tool.type != "function":
        raise _unsupported(
            f"Unsupported tool type: '{tool.type}'. This gateway supports only 'function' tools.", f"{where}.type"
        )
    if tool.name is None:
        raise _missing(f"{where}.name")
    if tool.parameters is not None:
        problem = schema_problem(_encode(tool.parameters))
        if problem is not None:
            raise invalid_request(
                f"Invalid schema for function '{tool.name}': {problem}",
                param=f"{where}.parameters",
                code="invalid_function_parameters",
            )


def _check_tool_choice(request: ResponsesRequest) -> None:
    choice = request.tool_choice
    if not isinstance(choice, NamedToolChoice):
        return
    if choice.type == "allowed_tools":
        fields = {k: v for k, v in (("mode", choice.mode), ("tools", choice.tools)) if v is not None}
        check_allowed_tools(fields, {tool.name for tool in request.tools or ()}, "tool_choice", chat=False)
        return
    if choice.type != "function":
        raise _unsupported(
            f"Unsupported tool choice type: '{choice.type}'. This gateway supports only 'function' and "
            "'allowed_tools'.",
            "tool_choice.type",
        )
    if choice.name is None:
        raise _missing("tool_choice.name")
    if choice.name not in {tool.name for tool in request.tools or ()}:
        raise invalid_request(
            f"Tool choice '{choice.name}' not found in 'tools' parameter.", param="tool_choice", code="invalid_value"
        )


def _check_text_format(text_format: TextFormat) -> None:
    if text_format.type != "json_schema":
        return
    if text_format.name is None:
        raise _missing("text.format.name")
    if text_format.schema is None:
        raise _missing("text.format.schema")


# -----------------------------------------------------------------------------
# the answer: OpenAI's response object, built by the translation (translate.py) and sent as msgspec encodes it,
# the fields in the order OpenAI sends them. The unit tests check every struct here against the SDK's type it
# stands for (openai.types.responses).

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class OutputText(msgspec.Struct, frozen=True, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(msgspec.Struct, frozen=True, tag="reasoning_text", tag_field="type"):
    text: str


class MessageItem(msgspec.Struct, frozen=True, kw_only=True, tag="message", tag_field="type"):
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningItem(msgspec.Struct, frozen=True, kw_only=True, tag="reasoning", tag_field="type"):
    id: str
    summary: list[Any] = []  # the engine writes no summary
    content: list[ReasoningText]


class FunctionCallItem(msgspec.Struct, frozen=True, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int
    cache_write_tokens: int = 0  # the SDK's type requires it; vLLM has no such count


class OutputTokensDetails(msgspec.Struct, frozen=True):
    reasoning_tokens: int


class Usage(msgspec.Struct, frozen=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct, frozen=True):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(msgspec.Struct, frozen=True):
    code: str
    message: str


class ReasoningEcho(msgspec.Struct, frozen=True):
    """The request's `reasoning` as echoed: nothing of it is applied."""

    effort: str | None = None
    summary: str | None = None


class FormatText(msgspec.Struct, frozen=True, tag="text", tag_field="type"):
    pass


class FormatJSONObject(msgspec.Struct, frozen=True, tag="json_object", tag_field="type"):
    pass


class FormatJSONSchema(msgspec.Struct, frozen=True, kw_only=True, tag="json_schema", tag_field="type"):
    name: str | None
    schema: dict[str, Any] | None
    description: str | None
    strict: bool | None


class TextEcho(msgspec.Struct, frozen=True):
    format: FormatText | FormatJSONObject | FormatJSONSchema


class ToolChoiceFunction(msgspec.Struct, frozen=True, tag="function", tag_field="type"):
    name: str | None


class ToolChoiceAllowed(msgspec.Struct, frozen=True, tag="allowed_tools", tag_field="type"):
    mode: str
    tools: list[Any]


class FunctionToolEcho(msgspec.Struct, frozen=True, kw_only=True, tag="function", tag_field="type"):
    name: str | None
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class Response(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI's response object (`openai.types.responses.Response`), the request's settings echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ReasoningEcho = ReasoningEcho()
    store: bool
    temperature: float | None
    text: TextEcho
    tool_choice: str | ToolChoiceFunction | ToolChoiceAllowed
    tools: list[FunctionToolEcho]
    top_p: float | None
    truncation: Literal["disabled"] = "disabled"
    usage: Usage | None
    user: str | None
    metadata: dict[str, str]
