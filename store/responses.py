"""Stored Responses API objects: what `previous_response_id` continues and `GET /v1/responses/{id}` returns.

The call itself is recorded like every call (store/calls.py); this keeps the Responses-shaped answer and the
conversation it ends, which a follow-up needs before the call's record may have reached the store.
"""

from __future__ import annotations

from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from store.access import Grant
from store.errors import NotFound
from store.tables import responses


class StoredResponse(msgspec.Struct, frozen=True):
    id: str
    rollout_id: str
    model: str
    response: dict[str, Any]  # the object the client got
    input_items: list[dict[str, Any]]  # the request's input, as items with ids
    messages: list[dict[str, Any]]  # chat messages: the history it continued, its input, its output
    created_at: float
    key_id: str | None  # the API key that made it: only it (or the admin) may read, continue or delete it


def response_not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param="response_id", code="response_not_found")


class ResponseStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def save(self, stored: StoredResponse) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(sa.insert(responses).values(**msgspec.structs.asdict(stored)))

    async def get(self, response_id: str, *, grant: Grant) -> StoredResponse:
        """The stored response; not found when `grant` does not own it (another key's, even of a model it covers,
        or of a model it does not cover), as if it did not exist."""
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(responses).where(responses.c.id == response_id))).one_or_none()
        if row is None or not (grant.covers_id(row.model) and grant.owns(row.key_id)):
            raise response_not_found(response_id)
        return msgspec.convert({str(k): v for k, v in row._asdict().items()}, StoredResponse)

    async def delete(self, response_id: str) -> None:
        async with self.engine.begin() as conn:
            deleted = (await conn.execute(sa.delete(responses).where(responses.c.id == response_id))).rowcount
        if not deleted:
            raise response_not_found(response_id)
