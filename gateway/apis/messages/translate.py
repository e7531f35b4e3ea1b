"""Anthropic's Messages API (`POST /v1/messages`), translated to and from the engine's chat completions.

The engine speaks OpenAI's chat completions, and only its answers carry the token ids the gateway records.
So a Messages request is turned into a chat request (`to_chat`), sent and recorded like any chat call,
and the engine's answer is turned back into Anthropic's message (`to_message`) or, streamed, into
Anthropic's server-sent events (`MessagesStream`). Nothing here does I/O.

What does not translate, and what is done instead:
- `thinking` and `redacted_thinking` blocks sent back in a conversation are accepted and left out of the
  prompt (chat templates drop earlier turns' reasoning too); the request's `thinking` option is ignored.
- A conversation ending on an assistant message is a prefill: the engine continues that message
  (`continue_final_message`), and the answer holds only the continuation, as Anthropic's does.
- Text blocks are joined with "\\n", as the engine joins the text parts of one message, so the prompt is the
  one the engine would render from the same blocks sent as parts.
- A tool call whose arguments are not a JSON object becomes a `tool_use` with input `{}` (the engine's text
  is still recorded); Anthropic's SDK would otherwise fail the whole response on it.
- `document` blocks, server tools and a `tool_result`'s `is_error` have no chat equivalent: the first two
  are refused (400), `is_error` is dropped (the result's content says what went wrong).
- The order of roles is not checked (a conversation may open on an assistant message, and two messages of
  one role may follow each other, which Anthropic merges): they pass as they are and the chat template decides.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from gateway.apis.messages.schema import (
    AnthropicError,
    Base64Source,
    ContentBlock,
    ImageBlock,
    Message,
    MessagesRequest,
    OutputBlock,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)

_encode = msgspec.json.encode
_decode = msgspec.json.decode


# -----------------------------------------------------------------------------
# request → chat request


def to_chat(request: MessagesRequest) -> dict[str, Any]:
    """The chat completions request for the engine. Options the client left out are left out."""
    messages: list[dict[str, Any]] = []
    system = _system_text(request.system)
    if system:
        messages.append({"role": "system", "content": system})
    for message in request.messages:
        if message.role == "user":
            messages.extend(_user_messages(message.content))
        else:
            messages.append(_assistant_message(message.content))
    chat: dict[str, Any] = {"model": request.model, "messages": messages, "max_tokens": request.max_tokens}
    if request.messages[-1].role == "assistant":  # a prefill: the answer continues it
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    if request.stop_sequences:
        chat["stop"] = list(request.stop_sequences)
    for name in ("temperature", "top_p", "top_k", "seed", "logit_bias"):
        value = getattr(request, name)
        if value is not None:
            chat[name] = value
    if request.tools:
        chat["tools"] = [_chat_tool(tool) for tool in request.tools]
        if request.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(request.tool_choice)
            if request.tool_choice.disable_parallel_tool_use:
                chat["parallel_tool_calls"] = False
    # Without tools a tool_choice can only be "auto" or "none" (checked), which is what no tools means anyway;
    # the engine refuses a tool_choice without tools.
    chat["stream"] = bool(request.stream)
    if request.stream:
        chat["stream_options"] = {"include_usage": True}  # the usage closes Anthropic's stream
    return chat


def _system_text(system: str | list[TextBlock] | None) -> str:
    if isinstance(system, list):
        return "\n".join(block.text for block in system)
    return system or ""


def _image_url(block: ImageBlock) -> str:
    source = block.source
    if isinstance(source, Base64Source):
        return f"data:{source.media_type};base64,{source.data}"
    return source.url


def _chat_content(blocks: list[TextBlock | ImageBlock]) -> str | list[dict[str, Any]]:
    """A string when all blocks are text; the parts, in order, when an image is among them."""
    if all(isinstance(block, TextBlock) for block in blocks):
        return "\n".join(block.text for block in blocks if isinstance(block, TextBlock))
    return [
        {"type": "text", "text": block.text}
        if isinstance(block, TextBlock)
        else {"type": "image_url", "image_url": {"url": _image_url(block)}}
        for block in blocks
    ]


def _user_messages(content: str | list[ContentBlock]) -> list[dict[str, Any]]:
    """A user message's tool results become `tool` messages, before the rest of the message: they answer the
    assistant's calls just before, and the user's own words come after them."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    messages: list[dict[str, Any]] = []
    own: list[TextBlock | ImageBlock] = []
    for block in content:
        if isinstance(block, ToolResultBlock):
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_content(block)})
        elif isinstance(block, TextBlock | ImageBlock):
            own.append(block)
    if own or not messages:
        messages.append({"role": "user", "content": _chat_content(own)})
    return messages


def _result_content(block: ToolResultBlock) -> str | list[dict[str, Any]]:
    if block.content is None:
        return ""
    if isinstance(block.content, str):
        return block.content
    return _chat_content([part for part in block.content if isinstance(part, TextBlock | ImageBlock)])


def _assistant_message(content: str | list[ContentBlock]) -> dict[str, Any]:
    """One assistant message: its text, and its tool_use blocks as tool calls (no `content` if only calls)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts = [block.text for block in content if isinstance(block, TextBlock)]
    calls = [
        {
            "id": block.id,
            "type": "function",
            # Not ASCII-escaped: the engine parses the arguments back for the template, but a template that
            # prints the string as given should see the characters the model wrote.
            "function": {"name": block.name, "arguments": _encode(block.input).decode()},
        }
        for block in content
        if isinstance(block, ToolUseBlock)
    ]
    message: dict[str, Any] = {"role": "assistant"}
    if texts or not calls:
        message["content"] = "\n".join(texts)
    if calls:
        message["tool_calls"] = calls
    return message


def _chat_tool(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# -----------------------------------------------------------------------------
# chat answer → message


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _json_object(arguments: str | None) -> dict[str, Any] | None:
    """A tool call's arguments, if they are a JSON object."""
    try:
        value = _decode(arguments or "")
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


def _tool_input(arguments: str | None) -> dict[str, Any]:
    """A tool call's arguments as `tool_use.input`: `{}` unless they are a JSON object."""
    value = _json_object(arguments)
    return {} if value is None else value


def _stop(finish_reason: str | None, matched: Any, request: MessagesRequest, tool_use: bool) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence`. The engine's `stop_reason` is the stop string it matched
    (or a stop token's id); a tool call is `tool_use` even when the engine says "stop" (named tool choice)."""
    if finish_reason == "length":
        return "max_tokens", None
    if tool_use:
        return "tool_use", None
    if isinstance(matched, str) and matched in (request.stop_sequences or ()):
        return "stop_sequence", matched
    return "end_turn", None


def to_message(chat: dict[str, Any], request: MessagesRequest, message_id: str) -> Message:
    """The engine's chat.completion (its first choice) as Anthropic's message. A malformed answer raises what
    reading it raises (KeyError, IndexError, TypeError, ...: gateway.proxy.ENGINE_DATA_ERRORS)."""
    choice = chat["choices"][0]
    reply = choice["message"]
    content: list[OutputBlock] = []
    reasoning = reply.get("reasoning") or reply.get("reasoning_content")
    if reasoning:
        content.append(ThinkingBlock(reasoning))
    if reply.get("content"):
        content.append(TextBlock(reply["content"]))
    for call in reply.get("tool_calls") or ():
        function = call["function"]
        content.append(
            ToolUseBlock(call.get("id") or _tool_id(), function["name"], _tool_input(function.get("arguments")))
        )
    tool_use = any(isinstance(block, ToolUseBlock) for block in content)
    stop_reason, stop_sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"), request, tool_use)
    usage = chat.get("usage") or {}
    return Message(
        id=message_id,
        model=request.model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=Usage(usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0),
    )


# -----------------------------------------------------------------------------
# chat stream → Anthropic's events


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode({"type": kind, **payload}) + b"\n\n"


@dataclass(slots=True)
class _Block:
    index: int
    kind: Literal["text", "thinking", "tool_use"]
    pieces: list[str] = field(default_factory=list)
    id: str = ""
    name: str = ""
    closed: bool = False

    def snapshot(self) -> OutputBlock:
        if self.kind == "text":
            return TextBlock("".join(self.pieces))
        if self.kind == "thinking":
            return ThinkingBlock("".join(self.pieces))
        return ToolUseBlock(self.id, self.name, _tool_input("".join(self.pieces)))


class MessagesStream:
    """Turns the engine's chat.completion.chunks into Anthropic's stream, one chunk at a time.

    `message_start` waits for the engine's first chunk (`take` sends it first), which carries the prompt's
    token ids (the gateway always asks for them), so the message starts with its real `input_tokens`, as
    Anthropic's does. `start()` sends it at once instead (with `input_tokens` 0, the count then arrives in
    `message_delta`), for a caller that must send something before the engine answers.

    A tool call's argument pieces are held until its block ends, then sent as they came if together they are
    a JSON object, else as `{}`: Anthropic's SDK parses every prefix and would fail the whole stream on a
    model's malformed arguments. Tool calls are expected one after another, as the engine's parsers send them.
    """

    def __init__(self, request: MessagesRequest, message_id: str) -> None:
        self.request = request
        self.message_id = message_id
        self._started = False
        self._blocks: list[_Block] = []
        self._open: _Block | None = None
        self._tools: dict[int, int] = {}  # the engine's tool call index → our block index
        self._input_tokens: int | None = None
        self._output_tokens: int | None = None  # the engine's count, from its usage
        self._sampled = 0  # tokens seen in the chunks: the count when the usage never came
        self._finish_reason: str | None = None
        self._matched: Any = None
        self._stop_reason: str | None = None
        self._stop_sequence: str | None = None

    def start(self) -> bytes:
        """`message_start`, unless it was sent already."""
        if self._started:
            return b""
        self._started = True
        return _event("message_start", {"message": msgspec.structs.replace(self.message(), content=[])})

    def take(self, chunk: dict[str, Any]) -> bytes:
        """The events for one decoded chat.completion.chunk (possibly none). Give it the engine's chunk as sent:
        its first carries `prompt_token_ids`, the input token count of `message_start`."""
        usage = chunk.get("usage") or {}
        if self._input_tokens is None and chunk.get("prompt_token_ids") is not None:
            self._input_tokens = len(chunk["prompt_token_ids"])
        if usage.get("prompt_tokens") is not None:
            self._input_tokens = usage["prompt_tokens"]
        if usage.get("completion_tokens") is not None:
            self._output_tokens = usage["completion_tokens"]
        out = [self.start()]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:  # Anthropic has one answer per request; to_chat asks for one
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                out.append(self._append("thinking", reasoning))
            if delta.get("content"):
                out.append(self._append("text", delta["content"]))
            for call in delta.get("tool_calls") or ():
                out.append(self._tool_call(call))
            self._sampled += len(choice.get("token_ids") or ())
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
                self._matched = choice.get("stop_reason")
        return b"".join(out)

    def finish(self) -> bytes:
        """The events that end the message: the open block's stop, `message_delta`, `message_stop`."""
        out = [self.start(), self._close()]
        tool_use = any(block.kind == "tool_use" for block in self._blocks)
        self._stop_reason, self._stop_sequence = _stop(self._finish_reason, self._matched, self.request, tool_use)
        usage: dict[str, Any] = {"output_tokens": self._output_count()}
        if self._input_tokens is not None:
            usage["input_tokens"] = self._input_tokens
        delta = {"stop_reason": self._stop_reason, "stop_sequence": self._stop_sequence}
        out.append(_event("message_delta", {"delta": delta, "usage": usage}))
        out.append(_event("message_stop", {}))
        return b"".join(out)

    def fail(self, message: str) -> bytes:
        """The `error` event that ends a stream the engine broke off (Anthropic's SDK raises it)."""
        return b"event: error\ndata: " + _encode(AnthropicError(500, message).body()) + b"\n\n"

    def message(self) -> Message:
        """The message so far (`stop_reason` None until `finish`), as `to_message` would give it."""
        return Message(
            id=self.message_id,
            model=self.request.model,
            content=[block.snapshot() for block in self._blocks],
            stop_reason=self._stop_reason,
            stop_sequence=self._stop_sequence,
            usage=Usage(self._input_tokens or 0, self._output_count()),
        )

    def _output_count(self) -> int:
        return self._output_tokens if self._output_tokens is not None else self._sampled

    def _begin(self, kind: Literal["text", "thinking", "tool_use"], content_block: dict[str, Any]) -> bytes:
        """Close the open block and start the next; the new block is the open one."""
        closing = self._close()
        block = _Block(len(self._blocks), kind, id=content_block.get("id", ""), name=content_block.get("name", ""))
        self._blocks.append(block)
        self._open = block
        return closing + _event("content_block_start", {"index": block.index, "content_block": content_block})

    def _append(self, kind: Literal["text", "thinking"], text: str) -> bytes:
        out = b""
        if self._open is None or self._open.kind != kind:
            start = {"type": "text", "text": ""} if kind == "text" else {"type": kind, "thinking": "", "signature": ""}
            out = self._begin(kind, start)
        assert self._open is not None
        self._open.pieces.append(text)
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return out + _event("content_block_delta", {"index": self._open.index, "delta": delta})

    def _tool_call(self, call: dict[str, Any]) -> bytes:
        function = call.get("function") or {}
        index = call.get("index", 0)
        out = b""
        if index not in self._tools:
            start = {"type": "tool_use", "id": call.get("id") or _tool_id(), "name": function.get("name") or ""}
            out = self._begin("tool_use", {**start, "input": {}})
            self._tools[index] = len(self._blocks) - 1
        block = self._blocks[self._tools[index]]
        # Pieces for a call whose block has ended (other output came between) cannot be sent any more: dropped,
        # from the message too, so that the stream and `message()` agree.
        if function.get("arguments") and not block.closed:
            block.pieces.append(function["arguments"])
        return out

    def _close(self) -> bytes:
        """The open block's stop (a tool call's held arguments first)."""
        block = self._open
        if block is None:
            return b""
        self._open = None
        block.closed = True
        out = b""
        if block.kind == "tool_use" and block.pieces:
            pieces = block.pieces if _json_object("".join(block.pieces)) is not None else ["{}"]
            for piece in pieces:
                delta = {"type": "input_json_delta", "partial_json": piece}
                out += _event("content_block_delta", {"index": block.index, "delta": delta})
        return out + _event("content_block_stop", {"index": block.index})
