"""Stored answers a follow-up continues: Responses API objects (`previous_response_id`, and what
`GET /v1/responses/{id}` returns) and Anthropic's message threads (`thread: {"type": "continue",
"previous_message_id": ...}`).

The call itself is recorded like every call (store/calls.py); this keeps the answer as the client got it and the
conversation it ends, which a follow-up needs before the call's record may have reached the store. Each API
reads and continues only its own: a Response is no message thread, nor the other way round.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from store.access import Grant
from store.errors import NotFound
from store.tables import responses

StoredApi = Literal["responses", "messages"]  # the API that made it, and alone reads and continues it


class StoredResponse(msgspec.Struct, frozen=True):
    id: str
    rollout_id: str
    model: str
    response: dict[str, Any]  # the object the client got
    input_items: list[dict[str, Any]]  # the request's input, as items with ids
    # The history it continued, its input, its output: chat messages (Responses), Anthropic's (Messages).
    messages: list[dict[str, Any]]
    created_at: float
    key_id: str | None  # the API key that made it: only it (or the admin) may delete it; it, the admin and the
    # keys granted to read its things (store.access.Grant.reads) may read and continue it
    api: StoredApi = "responses"
    # Request fields every follow-up takes from it rather than sends: an Anthropic thread's `system` and `tools`.
    carried: dict[str, Any] | None = None


def response_not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param="response_id", code="response_not_found")


class ResponseStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def save(self, stored: StoredResponse) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(sa.insert(responses).values(**msgspec.structs.asdict(stored)))

    async def get(self, response_id: str, *, grant: Grant, api: StoredApi) -> StoredResponse:
        """The stored answer of `api`; not found when `grant` may not read it (another key's, even of a model it
        covers, unless granted to read that key's; or of a model it does not cover), or another API made it, as
        if it did not exist."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(responses).where(responses.c.id == response_id))).one_or_none()
        if row is None or row.api != api or not (grant.covers_id(row.model) and grant.may_read(row.key_id)):
            raise response_not_found(response_id)
        return msgspec.convert({str(k): v for k, v in row._asdict().items()}, StoredResponse)

    async def delete(self, response_id: str) -> None:
        async with self.engine.begin() as conn:
            deleted = (await conn.execute(sa.delete(responses).where(responses.c.id == response_id))).rowcount
        if not deleted:
            raise response_not_found(response_id)
