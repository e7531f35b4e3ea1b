"""Anthropic's message threads (`thread`), served from the gateway's own store as `previous_response_id` is.

A request with `thread: {"type": "create"}` (or a `continue`) has its conversation kept under its answer's id,
in the store that keeps Responses (store/responses.py), with the key that made it: only that key (or the admin)
may continue it. `thread: {"type": "continue", "previous_message_id": ...}` sends only the new messages and
no `system` or `tools`; the gateway puts the kept conversation back in front of them, so the engine, the
recording and the continuation of the rollout see the whole conversation, as if the client had sent it (which
Anthropic's tool runners do on a thread they cannot continue). An id that is not the key's, or not a thread's,
is Anthropic's `thread_not_found` (404), on which Anthropic's SDKs send the whole history again.

Unlike Anthropic's, a kept turn may be continued more than once (each continuation is a fork, as a Response
is): the gateway refuses no `thread_already_continued`.
"""

from __future__ import annotations

import logging
import time

import msgspec

from gateway.apis.messages.schema import (
    AnthropicError,
    InputMessage,
    Message,
    MessagesRequest,
    ThreadContinue,
    ThreadFields,
    continued,
)
from gateway.auth import Caller
from gateway.proxy import CallOrigin
from store.errors import NotFound
from store.responses import ResponseStore, StoredResponse

log = logging.getLogger("artgw.gateway")


def thread_not_found(message_id: str) -> AnthropicError:
    return AnthropicError(
        404,
        f"thread.previous_message_id: no message thread holds a message with id '{message_id}' for this key. "
        'Send the whole conversation with `thread: {"type": "create"}` to start one.',
        error_code="thread_not_found",
    )


class Threads:
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
