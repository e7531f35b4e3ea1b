"""`/v1/messages`: Anthropic's Messages API, served through the engine's chat completions.

Why through chat: vLLM's own Messages endpoint returns no token ids; translated to chat
(gateway/apis/messages/translate.py), the call is recorded exactly like a chat call, token for token.
Errors on this route are in Anthropic's shape (`{"type": "error", "error": {...}}`).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from gateway.apis.chat.translate import strict_forced_calls, upstream_request
from gateway.apis.messages.schema import MessagesRequest, MessageTokensCount, parse_request
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
    def __init__(self, request: MessagesRequest) -> None:
        self.request = request
        self.id = f"msg_{uuid.uuid4().hex}"
        self.stream = MessagesStream(request, self.id)

    async def answer(self, payload: dict[str, Any]) -> bytes:
        return _encode(to_message(payload, self.request, self.id))

    def event(self, event: dict[str, Any]) -> bytes:
        return self.stream.take(event)

    async def done(self) -> bytes:
        return self.stream.finish()

    def broken(self, error: OpenAIError) -> bytes:
        return self.stream.start() + self.stream.fail(error.message)


class MessagesService:
    def __init__(self, calls: EngineCalls) -> None:
        self.calls = calls

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
        request = parse_request(body)
        chat = strict_forced_calls(to_chat(request))
        route = await self.calls.route(request.model, origin)
        upstream_body, _ = upstream_request(chat, route)
        spec = EngineRequest(
            "messages", CHAT_PATH, upstream_body, chat, route, bool(request.stream), MessagesWire(request)
        )
        return await self.calls.run(spec, origin, hang_up)
