"""OpenAI's Responses API (`POST /v1/responses`), served by translation to and from Chat Completions.

vLLM's chat endpoint is the one that returns the token ids the gateway records, so a Responses request becomes
a chat request (`to_chat`), and vLLM's chat answer becomes a Responses object (`to_response`) or the Responses
event stream (`ResponsesStream`, one chat chunk at a time). Pure translation, no I/O: the service that serves
the route loads the chat history behind `previous_response_id` and stores what it gets back here.

The shapes follow the OpenAI SDK's own types (`openai.types.responses`): the unit tests validate every object
and event with them and run the SDK's stream helper over the bytes.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from gateway.apis.responses.schema import (
    ContentPart,
    FormatJSONObject,
    FormatJSONSchema,
    FormatText,
    FunctionCallItem,
    FunctionToolEcho,
    IncompleteDetails,
    InputItem,
    InputTokensDetails,
    ItemStatus,
    MessageItem,
    NamedToolChoice,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponseError,
    ResponsesRequest,
    ResponseStatus,
    TextEcho,
    TextFormat,
    Tool,
    ToolChoiceAllowed,
    ToolChoiceFunction,
    Usage,
    item_kind,
)

_encode = msgspec.json.encode


# -----------------------------------------------------------------------------
# the request as chat messages

# vLLM's chat templates know `system`, rarely `developer`: the instructions a developer gives are the system's.
_CHAT_ROLE = {"developer": "system"}


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's `input` as chat messages (its `instructions` not included: they are not history)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    return _chat_messages(request.input)


def output_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as the chat messages that follow it in the history: the same messages a client
    sending `response.output` back as input would give, so `previous_response_id` and a client-kept history
    render the same prompt (assistant text and its tool calls are one assistant message; reasoning dropped)."""
    return _chat_messages(msgspec.convert(response.get("output") or [], list[InputItem]))


def _chat_messages(items: Iterable[InputItem]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item_kind(item)
        if kind == "message":
            role = item.role or "user"
            messages.append({"role": _CHAT_ROLE.get(role, role), "content": _chat_content(item.content)})
        elif kind == "function_call":
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            # An assistant turn is text and then its tool calls: one chat message, as a chat client sends it.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _chat_content(item.output)})
        # reasoning: dropped (see _check_item)
    return messages


def _chat_content(content: str | list[ContentPart] | None) -> str | list[dict[str, Any]]:
    """Text parts joined into one string, as vLLM itself joins a list of text parts (with newlines) for the
    templates that take a string; with an image, chat's list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if all(part.type != "input_image" for part in content):
        return "\n".join(_part_text(part) for part in content)
    return [_chat_part(part) for part in content]


def _part_text(part: ContentPart) -> str:
    return (part.refusal if part.type == "refusal" else part.text) or ""


def _chat_part(part: ContentPart) -> dict[str, Any]:
    if part.type != "input_image":
        return {"type": "text", "text": _part_text(part)}
    image: dict[str, Any] = {"url": part.image_url}
    if part.detail is not None:
        image["detail"] = part.detail
    return {"type": "image_url", "image_url": image}


def to_chat(request: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request for the engine. `history`: the chat messages of the conversation before this request
    (`previous_response_id`), without instructions: OpenAI does not carry them over, each request gives its own."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    messages += history
    messages += input_messages(request)
    stream = bool(request.stream)
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "tools": [_chat_tool(tool) for tool in request.tools] if request.tools else None,
        "tool_choice": _chat_tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "top_k": request.top_k,
        "logit_bias": request.logit_bias,
        "response_format": _response_format(request.text.format if request.text else None),
        "stream": stream,
        # The usage comes in a last chunk only when asked for; the final response event carries it.
        "stream_options": {"include_usage": True} if stream else None,
    }
    return {key: value for key, value in body.items() if value is not None}


def _chat_tool(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    if tool.strict is not None:
        function["strict"] = tool.strict
    elif tool.parameters is not None and strict_compatible(tool.parameters):
        function["strict"] = True  # OpenAI: a function tool with `strict` omitted is strict when its schema allows
    return {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}


def strict_compatible(schema: Any) -> bool:
    """Whether a JSON schema is one OpenAI's strict mode takes: every object lists all its properties as required
    and allows no others (checked through properties, items, anyOf and $defs)."""
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "object" or "properties" in schema:
        properties = schema.get("properties") or {}
        if schema.get("additionalProperties") is not False or set(schema.get("required") or ()) != set(properties):
            return False
        if not all(strict_compatible(p) for p in properties.values()):
            return False
    nested = [schema.get("items"), *(schema.get("anyOf") or ()), *(schema.get("$defs") or {}).values()]
    return all(strict_compatible(n) for n in nested if n is not None)


def _chat_tool_choice(choice: str | NamedToolChoice | None) -> str | dict[str, Any] | None:
    if isinstance(choice, NamedToolChoice) and choice.type == "allowed_tools":
        tools = [{"type": "function", "function": {"name": tool["name"]}} for tool in choice.tools or ()]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": tools}}
    if isinstance(choice, NamedToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(text_format: TextFormat | None) -> dict[str, Any] | None:
    if text_format is None:
        return None
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    schema = {
        "name": text_format.name,
        "schema": text_format.schema,
        "strict": text_format.strict,
        "description": text_format.description,
    }
    return {"type": "json_schema", "json_schema": {key: value for key, value in schema.items() if value is not None}}


# -----------------------------------------------------------------------------
# the input items, as GET /v1/responses/{id}/input_items lists them


def input_items(request: ResponsesRequest, response_id: str) -> list[dict[str, Any]]:
    """The request's input as Responses items with ids: an item's own id if it came with one (the output of an
    earlier response sent back), else one derived from the response id and the position, so listing twice
    gives the same ids without storing them."""
    items = [InputItem(role="user", content=request.input)] if isinstance(request.input, str) else request.input
    return [_listed_item(item, response_id, i) for i, item in enumerate(items)]


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _derived_id(prefix: str, response_id: str, position: int) -> str:
    return f"{prefix}_{hashlib.sha256(f'{response_id}/{position}'.encode()).hexdigest()[:48]}"


def _listed_item(item: InputItem, response_id: str, position: int) -> dict[str, Any]:
    kind = item_kind(item)
    item_id = item.id or _derived_id(_ID_PREFIX[kind], response_id, position)
    if kind == "function_call":
        return {
            "type": "function_call",
            "id": item_id,
            "call_id": item.call_id,
            "name": item.name,
            "arguments": item.arguments,
            "status": item.status or "completed",
        }
    if kind == "function_call_output":
        output = item.output if isinstance(item.output, str) else [_input_part(p) for p in item.output or ()]
        return {
            "type": "function_call_output",
            "id": item_id,
            "call_id": item.call_id,
            "output": output,
            "status": item.status or "completed",
        }
    if kind == "reasoning":
        listed: dict[str, Any] = {
            "type": "reasoning",
            "id": item_id,
            "summary": [{"type": "summary_text", "text": p.text or ""} for p in item.summary or ()],
        }
        if isinstance(item.content, list):
            listed["content"] = [{"type": "reasoning_text", "text": p.text or ""} for p in item.content]
        return listed
    parts = [ContentPart("input_text", text=item.content)] if isinstance(item.content, str) else item.content or []
    if item.role == "assistant":
        content = [_output_part(part) for part in parts]
    else:
        content = [_input_part(part) for part in parts]
    return {"type": "message", "id": item_id, "role": item.role, "content": content, "status": "completed"}


def _input_part(part: ContentPart) -> dict[str, Any]:
    if part.type == "input_image":
        return {"type": "input_image", "image_url": part.image_url, "detail": part.detail or "auto"}
    return {"type": "input_text", "text": _part_text(part)}


def _output_part(part: ContentPart) -> dict[str, Any]:
    if part.type == "refusal":
        return {"type": "refusal", "refusal": part.refusal or ""}
    return msgspec.to_builtins(OutputText(_part_text(part)))  # type: ignore[no-any-return]


# -----------------------------------------------------------------------------
# the engine's answer as a response


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _outcome(finish_reason: str | None) -> tuple[ResponseStatus, IncompleteDetails | None]:
    """The response's status and `incomplete_details` for the engine's finish reason."""
    if finish_reason == "length":
        return "incomplete", IncompleteDetails("max_output_tokens")
    if finish_reason == "content_filter":
        return "incomplete", IncompleteDetails("content_filter")
    return "completed", None


def _empty_turn(status: ResponseStatus) -> bool:
    """Whether an answer with no text and no tool call gets an empty message: only a turn the model ended. One
    cut before it wrote any (a forced call cut before its name: vLLM streams nothing of it) has no message, as
    OpenAI announces an item only once the model writes one; an empty message would stream `output_text.done`
    with no text before it, which clients that pair it with a first delta (mirascope 2.8) raise on."""
    return status == "completed"


def _usage(usage: dict[str, Any] | None) -> Usage | None:
    """Chat usage as Responses usage."""
    if not usage:
        return None
    input_tokens = usage.get("prompt_tokens") or 0
    output_tokens = usage.get("completion_tokens") or 0
    return Usage(
        input_tokens=input_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        ),
        output_tokens=output_tokens,
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=(usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
        ),
        total_tokens=usage.get("total_tokens") or input_tokens + output_tokens,
    )


def _response_object(
    request: ResponsesRequest,
    response_id: str,
    created_at: float,
    *,
    status: ResponseStatus,
    output: list[OutputItem],
    usage: Usage | None,
    incomplete_details: IncompleteDetails | None = None,
    error: ResponseError | None = None,
) -> Response:
    """The response object, the request's settings echoed as OpenAI echoes them (defaults filled in)."""
    return Response(
        id=response_id,
        created_at=int(created_at),
        status=status,
        error=error,
        incomplete_details=incomplete_details,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        model=request.model,
        output=output,
        parallel_tool_calls=True if request.parallel_tool_calls is None else request.parallel_tool_calls,
        previous_response_id=request.previous_response_id,
        store=True if request.store is None else request.store,
        temperature=request.temperature,
        text=TextEcho(_format_echo(request.text.format if request.text else None)),
        tool_choice=_tool_choice_echo(request.tool_choice),
        tools=[_tool_echo(tool) for tool in request.tools or ()],
        top_p=request.top_p,
        usage=usage,
        user=request.user,
        metadata=dict(request.metadata or {}),
    )


def _format_echo(text_format: TextFormat | None) -> FormatText | FormatJSONObject | FormatJSONSchema:
    if text_format is None or text_format.type == "text":
        return FormatText()
    if text_format.type == "json_object":
        return FormatJSONObject()
    return FormatJSONSchema(
        name=text_format.name,
        schema=text_format.schema,
        description=text_format.description,
        strict=text_format.strict,
    )


def _tool_choice_echo(choice: str | NamedToolChoice | None) -> str | ToolChoiceFunction | ToolChoiceAllowed:
    if isinstance(choice, NamedToolChoice) and choice.type == "allowed_tools":
        return ToolChoiceAllowed(choice.mode or "", list(choice.tools or ()))
    if isinstance(choice, NamedToolChoice):
        return ToolChoiceFunction(choice.name)
    return choice or "auto"


def _tool_echo(tool: Tool) -> FunctionToolEcho:
    return FunctionToolEcho(
        name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict
    )


def to_response(chat: dict[str, Any], request: ResponsesRequest, response_id: str, created_at: float) -> Response:
    """vLLM's chat.completion (one choice) as a Responses object: reasoning, then the text, then the tool calls,
    in the order the model wrote them. A turn that ended without text or tool calls is still an (empty) message,
    so it shows in the history, as a chat client would send back `{"role": "assistant", "content": ""}`; a
    turn cut before it wrote any has none (`_empty_turn`)."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    status, details = _outcome(choice.get("finish_reason"))
    output: list[OutputItem] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        output.append(ReasoningItem(id=_new_id("rs"), content=[ReasoningText(reasoning)]))
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if content or (not calls and _empty_turn(status)):
        output.append(MessageItem(id=_new_id("msg"), status="completed", content=[OutputText(content)]))
    for call in calls:
        function = call.get("function") or {}
        output.append(
            FunctionCallItem(
                id=_new_id("fc"),
                call_id=call.get("id") or _new_id("call"),
                name=function.get("name") or "",
                arguments=function.get("arguments") or "",
                status="completed",
            )
        )
    last = output[-1] if output else None
    if status == "incomplete" and isinstance(last, MessageItem | FunctionCallItem):
        output[-1] = msgspec.structs.replace(last, status="incomplete")  # the item the limit cut off
    return _response_object(
        request,
        response_id,
        created_at,
        status=status,
        output=output,
        usage=_usage(chat.get("usage")),
        incomplete_details=details,
    )


# -----------------------------------------------------------------------------
# the engine's stream as the Responses event stream

# The codes the SDK's `ResponseError` admits that a gateway can mean; any other becomes `server_error`.
_ERROR_CODES = frozenset({"server_error", "rate_limit_exceeded", "invalid_prompt"})

ItemKind = Literal["reasoning", "message", "function_call"]


@dataclass
class _OpenItem:
    """The output item being streamed: its text arrives in pieces, joined once when it closes."""

    kind: ItemKind
    output_index: int
    tool_index: int | None = None  # function_call: the chat tool call's index
    parts: list[str] = field(default_factory=list)


class ResponsesStream:
    """vLLM's chat chunks, one at a time, as the Responses event stream.

    One output item is open at a time, as OpenAI streams them: a delta of another kind (reasoning, text, a tool
    call of another index) closes the open item (its `.done` events) before opening the next. Every event is
    `event: <type>` and `data: <json>`, with a `sequence_number` counting from 0 across the whole stream.
    """

    def __init__(self, request: ResponsesRequest, response_id: str, created_at: float) -> None:
        self._request = request
        self._response_id = response_id
        self._created_at = created_at
        self._sequence = 0
        self._output: list[OutputItem] = []
        self._open: _OpenItem | None = None
        self._calls: dict[int, int] = {}  # chat tool call index -> output index
        self._finish_reason: str | None = None
        self._usage: Usage | None = None
        self._status: ResponseStatus = "in_progress"
        self._incomplete_details: IncompleteDetails | None = None
        self._error: ResponseError | None = None
        self._ended = False

    def start(self) -> bytes:
        """`response.created` and `response.in_progress`: the response, no output yet."""
        snapshot = self.response()
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def take(self, chunk: dict[str, Any]) -> bytes:
        """One decoded chat.completion.chunk -> the events it makes (none for a role-only or usage chunk)."""
        if self._ended:
            return b""
        if chunk.get("usage"):
            self._usage = _usage(chunk["usage"])
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:  # a Responses call has one choice
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                out.append(self._reasoning_delta(reasoning))
            if delta.get("content"):
                out.append(self._text_delta(delta["content"]))
            for call in delta.get("tool_calls") or ():
                out.append(self._tool_call_delta(call))
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return b"".join(out)

    def finish(self) -> bytes:
        """Close the open item, then `response.completed` (`response.incomplete` when the engine hit the output
        limit) with the whole response."""
        if self._ended:
            return b""
        status, details = _outcome(self._finish_reason)
        item_status: ItemStatus = "incomplete" if status == "incomplete" else "completed"
        out = self._close(item_status)
        if _empty_turn(status) and not any(isinstance(item, MessageItem | FunctionCallItem) for item in self._output):
            out += self._open_message() + self._close(item_status)  # an empty turn, as to_response gives
        self._status, self._incomplete_details, self._ended = status, details, True
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._event(kind, response=self.response())

    def fail(self, message: str, code: str = "server_error") -> bytes:
        """End the stream with `response.failed`: the output so far (the open item `incomplete`) and the error.
        `code` must be one the SDK's `ResponseError` admits; any other is sent as `server_error`."""
        if self._ended:
            return b""
        if self._open is not None:
            self._fill(self._open, "incomplete")
            self._open = None
        self._status, self._ended = "failed", True
        self._error = ResponseError(code if code in _ERROR_CODES else "server_error", message)
        return self._event("response.failed", response=self.response())

    def response(self) -> Response:
        """The response as it stands: in progress (the open item with its text so far), or final."""
        output = list(self._output)
        if self._open is not None:
            output[self._open.output_index] = self._filled(self._open, "in_progress")
        return _response_object(
            self._request,
            self._response_id,
            self._created_at,
            status=self._status,
            output=output,
            usage=self._usage,
            incomplete_details=self._incomplete_details,
            error=self._error,
        )

    # -- deltas

    def _reasoning_delta(self, text: str) -> bytes:
        out = b""
        if self._open is None or self._open.kind != "reasoning":
            out = self._close("completed") + self._open_reasoning()
        return out + self._append("response.reasoning_text.delta", text, content_index=0, item_id=self._open_id())

    def _text_delta(self, text: str) -> bytes:
        out = b""
        if self._open is None or self._open.kind != "message":
            out = self._close("completed") + self._open_message()
        return out + self._append(
            "response.output_text.delta", text, content_index=0, item_id=self._open_id(), logprobs=[]
        )

    def _tool_call_delta(self, call: dict[str, Any]) -> bytes:
        index = call.get("index", 0)
        function = call.get("function") or {}
        arguments = function.get("arguments") or ""
        out = b""
        open_ = self._open
        if open_ is not None and open_.kind == "function_call" and open_.tool_index == index:
            if function.get("name"):  # a name sent in pieces
                item = self._call_item(open_.output_index)
                self._output[open_.output_index] = msgspec.structs.replace(item, name=item.name + function["name"])
        elif index in self._calls:
            # A call already closed gets more (vLLM streams one call at a time, so this is not expected): kept in
            # the item the final response carries, no event after its `.done`.
            item = self._call_item(self._calls[index])
            self._output[self._calls[index]] = msgspec.structs.replace(item, arguments=item.arguments + arguments)
            return b""
        else:
            out = self._close("completed") + self._open_function_call(index, call.get("id"), function.get("name"))
        if not arguments:
            return out
        return out + self._append("response.function_call_arguments.delta", arguments, item_id=self._open_id())

    def _append(self, kind: str, delta: str, **fields: Any) -> bytes:
        """Add a delta to the open item and send its event."""
        assert self._open is not None
        self._open.parts.append(delta)
        return self._event(kind, output_index=self._open.output_index, delta=delta, **fields)

    def _open_id(self) -> str:
        assert self._open is not None
        return self._output[self._open.output_index].id

    def _call_item(self, output_index: int) -> FunctionCallItem:
        item = self._output[output_index]
        assert isinstance(item, FunctionCallItem)
        return item

    # -- opening and closing items

    def _open_item(self, kind: ItemKind, item: OutputItem, tool_index: int | None = None) -> bytes:
        self._open = _OpenItem(kind, len(self._output), tool_index)
        self._output.append(item)
        return self._event("response.output_item.added", output_index=self._open.output_index, item=item)

    def _open_reasoning(self) -> bytes:
        item_id = _new_id("rs")
        out = self._open_item("reasoning", ReasoningItem(id=item_id, content=[]))
        return out + self._part_event("response.content_part.added", ReasoningText(""))

    def _open_message(self) -> bytes:
        item = MessageItem(id=_new_id("msg"), status="in_progress", content=[])
        # The SDK's stream helper appends the part on `content_part.added` and adds text deltas to it.
        return self._open_item("message", item) + self._part_event("response.content_part.added", OutputText(""))

    def _open_function_call(self, index: int, call_id: str | None, name: str | None) -> bytes:
        # `call_id` is the chat tool call's id: the client's function_call_output names it, and back in the chat
        # history it is the `tool_call_id` the template matches to the call.
        item = FunctionCallItem(
            id=_new_id("fc"), call_id=call_id or _new_id("call"), name=name or "", arguments="", status="in_progress"
        )
        self._calls[index] = len(self._output)
        return self._open_item("function_call", item, index)

    def _part_event(self, kind: str, part: OutputText | ReasoningText) -> bytes:
        assert self._open is not None
        return self._event(
            kind, item_id=self._open_id(), output_index=self._open.output_index, content_index=0, part=part
        )

    def _close(self, status: ItemStatus) -> bytes:
        """The open item's `.done` events (none open: nothing), its text joined into the item."""
        open_ = self._open
        if open_ is None:
            return b""
        item = self._fill(open_, status)
        index, item_id = open_.output_index, item.id
        if isinstance(item, ReasoningItem):
            reasoning = item.content[0]
            out = self._event(
                "response.reasoning_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=reasoning.text,
            )
            out += self._part_event("response.content_part.done", reasoning)
        elif isinstance(item, MessageItem):
            text = item.content[0]
            out = self._event(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text.text,
                logprobs=[],
            )
            out += self._part_event("response.content_part.done", text)
        else:
            out = self._event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                arguments=item.arguments,
                name=item.name,
            )
        self._open = None
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def _filled(self, open_: _OpenItem, status: ItemStatus) -> OutputItem:
        """The open item with its text so far, as a new item (the one in the output is left as it is)."""
        item = self._output[open_.output_index]
        text = "".join(open_.parts)
        if isinstance(item, ReasoningItem):
            return msgspec.structs.replace(item, content=[ReasoningText(text)])
        if isinstance(item, MessageItem):
            return msgspec.structs.replace(item, content=[OutputText(text)], status=status)
        return msgspec.structs.replace(item, arguments=text, status=status)

    def _fill(self, open_: _OpenItem, status: ItemStatus) -> OutputItem:
        """Write the open item's text and final status into the output (it is closing)."""
        item = self._output[open_.output_index] = self._filled(open_, status)
        return item

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n"
