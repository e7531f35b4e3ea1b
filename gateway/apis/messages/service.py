"""`/v1/messages`: Anthropic's Messages API, served through the engine's chat completions.

Why through chat: vLLM's own Messages endpoint returns no token ids; translated to chat
(gateway/apis/messages/translate.py), the call is recorded exactly like a chat call, token for token.
Errors on this route are in Anthropic's shape (`{"type": "error", "error": {...}}`). Anthropic's message threads
(`thread`) are kept in the gateway's store (gateway/apis/messages/thread.py).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from gateway.apis.chat.translate import strict_forced_calls, upstream_request
from gateway.apis.messages.schema import MessagesRequest, MessageTokensCount, parse_request
from gateway.apis.messages.thread import Threads
from gateway.apis.messages.translate import MessagesStream, to_chat, to_message
from gateway.asgi import EventStream, HangUp, JSONBody
from gateway.auth import Caller
from gateway.errors import OpenAIError
from gateway.proxy import CHAT_PATH, CallOrigin, EngineCalls, EngineRequest

_encode = msgspec.json.encode


def _with_max_tokens(body: bytes) -> bytes:
    """A count_tokens body as a Messages request: the same fields, and a `max_tokens` (none is sent)."""
    try:
        fields = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # not JSON, not UTF-8, nested too deep
        return body  # parse_request says what is wrong with it (a 400 in Anthropic's shape)
    if isinstance(fields, dict):
        fields.setdefault("max_tokens", 1)
        return _encode(fields)
    return body


class MessagesWire:
    """The engine's chat answer as Anthropic's message or event stream; a thread's is kept before the client gets
    its end (the message, or `message_stop`)."""

    def __init__(self, threads: Threads, request: MessagesRequest, origin: CallOrigin) -> None:
        self.threads = threads
        self.request = request
        self.origin = origin
        self.id = f"msg_{uuid.uuid4().hex}"
        self.stream = MessagesStream(request, self.id)

    async def answer(self, payload: dict[str, Any]) -> bytes:
        message = to_message(payload, self.request, self.id)
        await self.threads.keep(self.request, message, self.origin)
        return _encode(message)

    def event(self, event: dict[str, Any]) -> bytes:
        return self.stream.take(event)

    async def done(self) -> bytes:
        out = self.stream.finish()
        await self.threads.keep(self.request, self.stream.message(), self.origin)
        return out

    def broken(self, error: OpenAIError) -> bytes:
        return self.stream.start() + self.stream.fail(error.message)


class MessagesService:
    def __init__(self, calls: EngineCalls, threads: Threads) -> None:
        self.calls = calls
        self.threads = threads

    async def count_tokens(self, body: bytes, caller: Caller) -> MessageTokensCount:
        """`POST /v1/messages/count_tokens`: the prompt's tokens as the engine counts them, through the same
        translation as `/v1/messages` (its chat template and tokenizer; the tools included). Nothing is
        recorded: no call is made."""
        request = parse_request(_with_max_tokens(body))  # count_tokens has no max_tokens; one is as good as any
        chat = to_chat(request)
        route = self.calls.registry.resolve(request.model, caller)
        tokenize = {k: v for k, v in chat.items() if k in ("messages", "tools", "add_generation_prompt")}
        tokenize.update(model=route.upstream_model, continue_final_message=chat.get("continue_final_message", False))
        tokenize.setdefault("add_generation_prompt", True)
        payload = await self.calls.engine_json("/tokenize", tokenize)
        return MessageTokensCount(int(payload["count"]))

    async def create(self, body: bytes, origin: CallOrigin, hang_up: HangUp | None = None) -> JSONBody | EventStream:
        """Raises AnthropicError for a request it refuses, OpenAIError for the rest (the route re-shapes it)."""
        request = await self.threads.whole(parse_request(body), origin.caller)
        chat = strict_forced_calls(to_chat(request))
        route = await self.calls.route(request.model, origin)
        upstream_body, _ = upstream_request(chat, route)
        wire = MessagesWire(self.threads, request, origin)
        spec = EngineRequest("messages", CHAT_PATH, upstream_body, chat, route, bool(request.stream), wire)
        return await self.calls.run(spec, origin, hang_up)
