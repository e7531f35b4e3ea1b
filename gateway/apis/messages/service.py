"""`/v1/messages`: Anthropic's Messages API, served through the engine's chat completions.

Why through chat: vLLM's own Messages endpoint returns no token ids; translated to chat
(gateway/apis/messages/translate.py), the call is recorded exactly like a chat call, token for token.
Errors on this route are in Anthropic's shape (`{"type": "error", "error": {...}}`).

Anthropic's message threads (`thread`) are served from the gateway's own store, as `previous_response_id` is.
A request with `thread: {"type": "create"}` (or a `continue`) has its conversation kept under its answer's id,
in the store that keeps Responses (store/responses.py), with the key that made it: only that key (or the admin)
may continue it. `thread: {"type": "continue", "previous_message_id": ...}` sends only the new messages and
no `system` or `tools`; the gateway puts the kept conversation back in front of them, so the engine, the
recording and the continuation of the rollout see the whole conversation, as if the client had sent it. An id
that is not the key's, or not a thread's, is Anthropic's `thread_not_found` (404), on which Anthropic's SDKs
send the whole history again. Unlike Anthropic's, a kept turn may be continued more than once (each
continuation forks, as a Response does): the gateway refuses no `thread_already_continued`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import msgspec

from engine.answers import TokenizeAnswer
from gateway.adapters import Route
from gateway.apis.chat.translate import strict_forced_calls, upstream_request
from gateway.apis.messages.schema import (
    AnthropicError,
    InputMessage,
    Message,
    MessagesRequest,
    MessageTokensCount,
    ThreadContinue,
    ThreadFields,
    continued,
    parse_request,
)
from gateway.apis.messages.translate import MessagesStream, to_chat, to_message
from gateway.asgi import EventStream, HangUp, JSONBody
from gateway.auth import Caller
from gateway.errors import OpenAIError
from gateway.proxy import CHAT_PATH, CallOrigin, EngineCalls, EngineRequest
from store.errors import NotFound
from store.responses import ResponseStore, StoredResponse

_encode = msgspec.json.encode

log = logging.getLogger("artgw.gateway")


def thread_not_found(message_id: str) -> AnthropicError:
    return AnthropicError(
        404,
        f"thread.previous_message_id: no message thread holds a message with id '{message_id}' for this key. "
        'Send the whole conversation with `thread: {"type": "create"}` to start one.',
        error_code="thread_not_found",
    )


class Threads:
    """Anthropic's message threads, kept in the store of Responses as the API `messages` (see above)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def whole(self, request: MessagesRequest, caller: Caller) -> MessagesRequest:
        """The request with its thread's conversation, `system` and `tools` in front of it (a `continue`), or as
        it is."""
        if not isinstance(request.thread, ThreadContinue):
            return request
        message_id = request.thread.previous_message_id
        try:
            kept = await self.store.get(message_id, grant=caller.grant, api="messages")
        except NotFound:
            raise thread_not_found(message_id) from None
        fields = msgspec.convert(kept.carried or {}, ThreadFields)
        return continued(request, fields, msgspec.convert(kept.messages, list[InputMessage]))

    async def keep(self, request: MessagesRequest, message: Message, origin: CallOrigin) -> None:
        """Keep a thread's conversation, `message` last, under its id, before the client gets its end (so the
        next turn can name it at once). A request without `thread` keeps nothing."""
        if request.thread is None:
            return
        reply = InputMessage("assistant", list(message.content))
        stored = StoredResponse(
            id=message.id,
            rollout_id=origin.rollout_id,
            model=request.model,
            response=msgspec.to_builtins(message),
            input_items=[],  # no Messages endpoint lists a request's input
            messages=msgspec.to_builtins([*request.messages, reply]),
            created_at=time.time(),
            key_id=origin.caller.key_id,
            api="messages",
            carried=msgspec.to_builtins(ThreadFields.of(request)),
        )
        try:
            await self.store.save(stored)
        except Exception as exc:  # the answer still goes out (it is recorded); its next turn sends it all again
            log.warning("thread message %s not kept (%s): continuing it gets thread_not_found", message.id, exc)


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
        tokenized = await self.calls.engine_json("/tokenize", tokenize, TokenizeAnswer)
        return MessageTokensCount(tokenized.count)

    async def create(self, body: bytes, origin: CallOrigin, hang_up: HangUp | None = None) -> JSONBody | EventStream:
        """Raises AnthropicError for a request it refuses, OpenAIError for the rest (the route re-shapes it)."""
        request = await self.threads.whole(parse_request(body), origin.caller)
        chat = strict_forced_calls(to_chat(request))

        def build(route: Route) -> EngineRequest:
            upstream_body, _ = upstream_request(chat, route)
            wire = MessagesWire(self.threads, request, origin)
            return EngineRequest("messages", CHAT_PATH, upstream_body, chat, route, bool(request.stream), wire)

        return await self.calls.answer(request.model, origin, build, hang_up)
