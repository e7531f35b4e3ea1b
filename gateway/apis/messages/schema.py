"""Anthropic's Messages API on the wire: the request, typed and checked (`parse_request`); the answer's structs
(`Message`, its blocks and usage), which the translation fills; and the error shape (`AnthropicError`) every
error on `/v1/messages` is sent in. A bad request is an `AnthropicError` (400) whose message starts with the
parameter's path, as Anthropic's do.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

import msgspec

from gateway.apis.chat.schema import schema_problem
from gateway.errors import OpenAIError, decode_body

_encode = msgspec.json.encode

# Anthropic's error types (https://docs.anthropic.com/en/api/errors); any other 4xx is an
# invalid_request_error and any other 5xx an api_error, as Anthropic documents.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # the engine is starting or restarting: retry shortly
    504: "timeout_error",
    529: "overloaded_error",
}


class AnthropicError(Exception):
    """An error the client should see, in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

    Anthropic's SDK picks its exception class by the HTTP status (`BadRequestError` for 400, ...)."""

    def __init__(self, status: int, message: str, type: str | None = None, error_code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")
        # `error.details.error_code`: what Anthropic's SDK branches on (a thread it may replay, say).
        self.error_code = error_code
        self.headers: dict[str, str] | None = None  # the rollout id, echoed on the error

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.error_code is not None:
            error["details"] = {"error_code": self.error_code}
        return {"type": "error", "error": error}


def _dotted(param: str) -> str:
    """OpenAI's `messages[0].role` as Anthropic writes it: `messages.0.role`."""
    return re.sub(r"\[(\d+)\]", r".\1", param)


_AT_SUFFIX = re.compile(r" \(at '[^']*'\)\.$")


def from_openai_error(exc: OpenAIError) -> AnthropicError:
    """The gateway's own error (a bad body, an unknown model, the engine down, ...) for this route: same status,
    and the parameter, if any, leads the message as in Anthropic's errors (`max_tokens: Field required`)."""
    message = exc.message
    if exc.param and exc.status == 400:  # a request error names its field; a missing model says so itself
        if exc.code == "missing_required_parameter":
            message = "Field required"
        else:  # a validation message ends with where it happened: that now leads it
            message = _AT_SUFFIX.sub("", message.removeprefix("Invalid request: "))
        message = f"{_dotted(exc.param)}: {message}"
    return AnthropicError(exc.status, message)


# -----------------------------------------------------------------------------
# the request


class TextBlock(msgspec.Struct, frozen=True, tag="text", tag_field="type"):
    text: str


class Base64Source(msgspec.Struct, frozen=True, tag="base64", tag_field="type"):
    media_type: str
    data: str


class URLSource(msgspec.Struct, frozen=True, tag="url", tag_field="type"):
    url: str


class ImageBlock(msgspec.Struct, frozen=True, tag="image", tag_field="type"):
    source: Base64Source | URLSource


class DocumentBlock(msgspec.Struct, frozen=True, tag="document", tag_field="type"):
    """Accepted by the decoder only to be refused by name (a 400 saying documents are unsupported)."""


class ToolUseBlock(msgspec.Struct, frozen=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


ResultPart = TextBlock | ImageBlock | DocumentBlock


class ToolResultBlock(msgspec.Struct, frozen=True, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[ResultPart] | None = None
    is_error: bool | None = None


class ThinkingBlock(msgspec.Struct, frozen=True, tag="thinking", tag_field="type"):
    thinking: str = ""
    signature: str = ""


class RedactedThinkingBlock(msgspec.Struct, frozen=True, tag="redacted_thinking", tag_field="type"):
    data: str = ""


ContentBlock = (
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | DocumentBlock
)


class InputMessage(msgspec.Struct, frozen=True):
    role: str  # checked by hand: "system" gets Anthropic's pointer to the top-level `system`
    content: str | list[ContentBlock]


class Tool(msgspec.Struct, frozen=True):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required by hand, after `type`: a server tool has none
    type: str | None = None  # None or "custom"; Anthropic's server tools (`web_search_...`) are refused
    strict: bool | None = None  # Anthropic's strict tool use: the engine then samples under the schema


class ToolChoice(msgspec.Struct, frozen=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThreadCreate(msgspec.Struct, frozen=True, tag="create", tag_field="type"):
    """Keep this conversation (its system, tools, messages and the answer) under the answer's id."""


class ThreadContinue(msgspec.Struct, frozen=True, tag="continue", tag_field="type"):
    """Continue the conversation kept under `previous_message_id`: the request sends only the new messages, and
    takes `system` and `tools` from the thread."""

    previous_message_id: Annotated[str, msgspec.Meta(min_length=1)]


Thread = ThreadCreate | ThreadContinue


class MessagesRequest(msgspec.Struct, frozen=True):
    """A Messages request, typed. Unknown fields are ignored."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    messages: Annotated[list[InputMessage], msgspec.Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    seed: int | None = None  # vLLM's, passed on (Anthropic's API has none)
    logit_bias: dict[str, float] | None = None  # vLLM's, passed on (as on Responses)
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    thread: Thread | None = None  # Anthropic's message threads, kept in the gateway's store (service.py)


_decoder = msgspec.json.Decoder(MessagesRequest)


class ThreadFields(msgspec.Struct, frozen=True):
    """What a thread's first request sets for all its turns: a `continue` leaves them out (or repeats them)."""

    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None

    @classmethod
    def of(cls, request: MessagesRequest) -> ThreadFields:
        return cls(request.system, request.tools)


def _tags(union: Any) -> str:
    """The block types a union accepts, as an error names them (documents are decoded only to be refused)."""
    return ", ".join(
        f"'{kind.__struct_config__.tag}'" for kind in get_args(union) or (union,) if kind is not DocumentBlock
    )


# Where a block's `type` picks its kind, and the kinds allowed there.
_TAGGED = (
    (re.compile(r"^messages\[\d+\]\.content\[\d+\]\.content\[\d+\]\.type$"), _tags(ResultPart)),
    (re.compile(r"^messages\[\d+\]\.content\[\d+\]\.type$"), _tags(ContentBlock)),
    (re.compile(r"\.source\.type$"), _tags(Base64Source | URLSource)),
    (re.compile(r"^system\[\d+\]\.type$"), _tags(TextBlock)),
    (re.compile(r"^thread\.type$"), _tags(Thread)),
)
_BAD_TAG = re.compile(r"^Invalid request: Invalid value (?P<value>'.*') \(at ")


def _bad_tag(exc: OpenAIError) -> AnthropicError | None:
    """An unknown block `type`, named with the types allowed there (msgspec only says the value is invalid)."""
    bad = _BAD_TAG.match(exc.message)
    if bad is None or exc.param is None:
        return None
    for where, tags in _TAGGED:
        if where.search(exc.param):
            path = _dotted(exc.param.removesuffix(".type"))
            return AnthropicError(
                400,
                f"{path}: Input tag {bad['value']} found using 'type' does not match any of the expected tags: {tags}",
            )
    return None


def parse_request(body: bytes) -> MessagesRequest:
    """The typed request; anything wrong is an `AnthropicError` (400) whose message starts with the parameter's
    path (`messages.0.role: ...`). Only AnthropicError is raised: the body's decoding errors are re-shaped here.
    A thread's `continue` has its tools checked once the thread's are added (`continued`)."""
    try:
        request = decode_body(body, MessagesRequest, _decoder)
    except OpenAIError as exc:
        raise (_bad_tag(exc) or from_openai_error(exc)) from None
    _check_messages(request.messages)
    if not isinstance(request.thread, ThreadContinue):
        _check_tools(request)
    return request


def continued(request: MessagesRequest, fields: ThreadFields, history: list[InputMessage]) -> MessagesRequest:
    """A thread's `continue` as the whole request it stands for: the thread's `system` and `tools` (`fields`),
    its conversation (`history`, the answer last), then the new messages. A `system` or `tools` sent again must
    be the thread's (Anthropic's `thread_fingerprint_mismatch` otherwise)."""
    sent = ThreadFields.of(request)
    for name in ThreadFields.__struct_fields__:
        if getattr(sent, name) is not None and getattr(sent, name) != getattr(fields, name):
            raise AnthropicError(
                400,
                f"{name}: differs from the `{name}` this thread was created with; a `continue` takes it from the "
                'thread: leave it out, or send the whole conversation with `thread: {"type": "create"}`.',
                error_code="thread_fingerprint_mismatch",
            )
    full = msgspec.structs.replace(
        request, system=fields.system, tools=fields.tools, messages=[*history, *request.messages]
    )
    _check_tools(full)
    return full


def _invalid(message: str) -> AnthropicError:
    return AnthropicError(400, message)


def _check_messages(messages: list[InputMessage]) -> None:
    last = len(messages) - 1
    for i, message in enumerate(messages):
        if message.role == "system":
            raise _invalid(
                f'messages.{i}.role: Unexpected role "system". The Messages API accepts a top-level `system` '
                'parameter, not "system" as an input message role.'
            )
        if message.role not in ("user", "assistant"):
            raise _invalid(f"messages.{i}.role: Input should be 'user' or 'assistant'")
        if isinstance(message.content, str):
            continue
        for j, block in enumerate(message.content):
            problem = _block_problem(block, message.role)
            if problem is not None:
                raise _invalid(f"messages.{i}.content.{j}: {problem}")
            if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                for k, part in enumerate(block.content):
                    if isinstance(part, DocumentBlock):
                        raise _invalid(f"messages.{i}.content.{j}.content.{k}: {_NO_DOCUMENTS}")
        if i == last and message.role == "assistant" and any(isinstance(b, ToolUseBlock) for b in message.content):
            raise _invalid(
                f"messages.{i}: a final assistant message is continued as a prefill and may not hold tool_use "
                "blocks: send their tool_result blocks in a user message after it."
            )


_NO_DOCUMENTS = "document blocks are not supported by this gateway: send the document's text as a text block."


def _block_problem(block: ContentBlock, role: str) -> str | None:
    if isinstance(block, DocumentBlock):
        return _NO_DOCUMENTS
    if role == "user" and isinstance(block, ToolUseBlock):
        return "tool_use blocks are only allowed in assistant messages."
    if role == "assistant" and isinstance(block, ToolResultBlock | ImageBlock):
        kind = "tool_result" if isinstance(block, ToolResultBlock) else "image"
        return f"{kind} blocks are only allowed in user messages."
    return None


def _check_tools(request: MessagesRequest) -> None:
    names: set[str] = set()
    for i, tool in enumerate(request.tools or ()):
        if tool.type not in (None, "custom"):
            raise _invalid(
                f"tools.{i}.type: server tool '{tool.type}' is not supported by this gateway; only custom tools "
                "(name, description, input_schema) are."
            )
        if tool.input_schema is None:
            raise _invalid(f"tools.{i}.input_schema: Field required")
        problem = schema_problem(_encode(tool.input_schema))
        if problem is not None:
            raise _invalid(f"tools.{i}.input_schema: {problem}")
        if tool.name in names:
            raise _invalid(f"tools: Tool names must be unique: '{tool.name}' is given twice.")
        names.add(tool.name)
    choice = request.tool_choice
    if choice is None:
        return
    if choice.type in ("any", "tool") and not names:
        raise _invalid(f"tool_choice: tool_choice of type '{choice.type}' needs `tools`.")
    if choice.type == "tool":
        if not choice.name:
            raise _invalid("tool_choice.name: Field required")
        if choice.name not in names:
            raise _invalid(f"tool_choice.name: no tool named '{choice.name}' among `tools`.")


# -----------------------------------------------------------------------------
# the answer: Anthropic's message, built by the translation (translate.py), sent as msgspec encodes it. Its
# blocks are the request's own (`TextBlock`, `ThinkingBlock`, `ToolUseBlock`: the same shape both ways). The unit
# tests check every struct here against the SDK's type of the same name (anthropic.types).

OutputBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Usage(msgspec.Struct, frozen=True):
    input_tokens: int
    output_tokens: int
    # No prompt caching in Anthropic's sense (billed cache writes and reads): both are 0.
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """Anthropic's message (`anthropic.types.Message`); the fields in the order Anthropic sends them."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class MessageTokensCount(msgspec.Struct, frozen=True):
    """The answer of `/v1/messages/count_tokens` (`anthropic.types.MessageTokensCount`)."""

    input_tokens: int
