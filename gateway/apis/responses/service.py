"""`/v1/responses`: OpenAI's Responses API, served through the engine's chat completions.

Why through chat: vLLM's own Responses endpoint returns no token ids, and the gateway records the tokens the
model really sampled, never a re-tokenization of text. Translated to chat (gateway/apis/responses/translate.py),
the call is recorded exactly like a chat call, and assembles with chat calls of its rollout by token prefix.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import msgspec

from gateway.adapters import Route
from gateway.apis.chat.translate import offered_tools, strict_forced_calls, upstream_request
from gateway.apis.responses.schema import Response, ResponsesRequest, parse_request
from gateway.apis.responses.translate import (
    ResponsesStream,
    input_items,
    input_messages,
    output_messages,
    to_chat,
    to_response,
)
from gateway.asgi import EventStream, HangUp, JSONBody
from gateway.auth import Caller
from gateway.errors import OpenAIError, invalid_request
from gateway.proxy import CHAT_PATH, CallOrigin, EngineCalls, EngineRequest
from store.errors import NotFound
from store.responses import ResponseStore, StoredResponse

log = logging.getLogger("artgw.gateway")
_encode = msgspec.json.encode

MAX_ITEMS_PAGE = 100


class ResponsesWire:
    """The engine's chat answer as a Responses object or event stream; a `store: true` response is kept before
    the client gets its end (the object, or `response.completed`), so a follow-up can name it at once."""

    def __init__(
        self, service: ResponsesService, request: ResponsesRequest, origin: CallOrigin, history: list[dict[str, Any]]
    ) -> None:
        self.service = service
        self.request = request
        self.origin = origin
        self.history = history
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = time.time()
        self.stream = ResponsesStream(request, self.id, self.created_at)
        self.started = False

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        return self.stream.start()

    async def answer(self, payload: dict[str, Any]) -> bytes:
        response = to_response(payload, self.request, self.id, self.created_at)
        await self._keep(response)
        return _encode(response)

    def event(self, event: dict[str, Any]) -> bytes:
        return self._start() + self.stream.take(event)

    async def done(self) -> bytes:
        out = self._start() + self.stream.finish()
        response = self.stream.response()
        if response.status != "failed":
            await self._keep(response)
        return out

    def broken(self, error: OpenAIError) -> bytes:
        return self._start() + self.stream.fail(error.message)

    async def _keep(self, response: Response) -> None:
        if self.request.store is False:
            return
        kept: dict[str, Any] = msgspec.to_builtins(response)  # the store keeps the JSON the client got
        stored = StoredResponse(
            id=self.id,
            rollout_id=self.origin.rollout_id,
            model=self.request.model,
            response=kept,
            input_items=input_items(self.request, self.id),
            messages=[*self.history, *input_messages(self.request), *output_messages(kept)],
            created_at=self.created_at,
            key_id=self.origin.caller.key_id,
        )
        try:
            await self.service.store.save(stored)
        except Exception as exc:  # the answer still goes out (it is recorded); only a follow-up can't name it
            self.service.unsaved += 1
            log.warning("response %s not kept (%s): a follow-up naming it will get a 404", self.id, exc)


class ResponsesService:
    def __init__(self, calls: EngineCalls, store: ResponseStore) -> None:
        self.calls = calls
        self.store = store
        self.unsaved = 0  # stored responses the store refused

    async def create(self, body: bytes, origin: CallOrigin, hang_up: HangUp | None = None) -> JSONBody | EventStream:
        request = parse_request(body)
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            try:
                history = (await self._stored(request.previous_response_id, origin.caller)).messages
            except NotFound:
                raise OpenAIError(
                    404,
                    f"Previous response with id '{request.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                ) from None
        chat = strict_forced_calls(offered_tools(to_chat(request, history)))
        if not chat["messages"]:
            raise invalid_request(
                "Nothing to answer: 'input' is empty, and there are no instructions and no previous response.",
                param="input",
                code="empty_array",
            )

        def build(route: Route) -> EngineRequest:
            upstream_body, _ = upstream_request(chat, route)
            wire = ResponsesWire(self, request, origin, history)
            return EngineRequest("responses", CHAT_PATH, upstream_body, chat, route, bool(request.stream), wire)

        return await self.calls.answer(request.model, origin, build, hang_up)

    async def _stored(self, response_id: str, caller: Caller) -> StoredResponse:
        """The stored response, if the caller's key made it (or is the admin's, or granted to read its maker's);
        else not found, as if it did not exist: another key of the same model can neither read nor continue it."""
        return await self.store.get(response_id, grant=caller.grant, api="responses")

    async def get(self, response_id: str, caller: Caller) -> dict[str, Any]:
        return (await self._stored(response_id, caller)).response

    async def delete(self, response_id: str, caller: Caller) -> dict[str, Any]:
        stored = await self._stored(response_id, caller)
        if not caller.grant.owns(stored.key_id):  # a key granted to read it knows it exists: it may not delete it
            raise OpenAIError(
                403,
                "This API key may read this response (a grant to read its key's), not delete it.",
                param="response_id",
                code="read_only_grant",
            )
        await self.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def input_items(
        self, response_id: str, *, limit: int, order: str, after: str | None, caller: Caller
    ) -> dict[str, Any]:
        """A page of the response's input items, as OpenAI lists them (newest first unless `order=asc`)."""
        if not 1 <= limit <= MAX_ITEMS_PAGE:
            raise invalid_request(
                f"'limit' must be between 1 and {MAX_ITEMS_PAGE}.", param="limit", code="invalid_value"
            )
        if order not in ("asc", "desc"):
            raise invalid_request("'order' must be 'asc' or 'desc'.", param="order", code="invalid_value")
        items = (await self._stored(response_id, caller)).input_items
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise invalid_request(f"No input item '{after}' in this response.", param="after", code="invalid_value")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
