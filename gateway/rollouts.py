"""Reading rollouts back: the service behind `/v1/art/rollouts` and `artgw export`."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.errors import OpenAIError, invalid_request
from gateway.recorder import Recorder
from gateway.store.calls import RolloutRow, list_rollouts, rollout_calls
from gateway.trajectories import Trajectory, assemble


class RolloutPage(msgspec.Struct, frozen=True):
    data: list[RolloutRow]
    next_cursor: str | None  # pass as `cursor` for the next page; None: this was the last
    object: str = "list"


def encode_cursor(row: RolloutRow) -> str:
    return base64.urlsafe_b64encode(msgspec.json.encode([row.last_call_at, row.id])).decode()


def decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        last_call_at, rollout_id = msgspec.json.decode(base64.urlsafe_b64decode(cursor.encode()))
        return float(last_call_at), str(rollout_id)
    except Exception:
        raise invalid_request("Invalid cursor: pass `next_cursor` from the previous page.", param="cursor") from None


class RolloutService:
    def __init__(self, store: AsyncEngine, recorder: Recorder | None = None) -> None:
        self.store = store
        self.recorder = recorder

    async def get(self, rollout_id: str, *, settle_seconds: float = 5.0) -> Trajectory:
        """The assembled rollout; waits briefly for its calls still on their way to the store."""
        if self.recorder is not None:
            await self.recorder.settled([rollout_id], settle_seconds)
        async with self.store.connect() as conn:
            calls = await rollout_calls(conn, rollout_id)
        if calls is None:
            raise OpenAIError(404, f"No rollout `{rollout_id}` has been recorded.", code="rollout_not_found")
        return assemble(rollout_id, calls)

    async def page(self, *, model: str | None, since: float | None, limit: int, cursor: str | None) -> RolloutPage:
        if not 1 <= limit <= 1000:
            raise invalid_request("'limit' must be between 1 and 1000.", param="limit")
        after = decode_cursor(cursor) if cursor else None
        async with self.store.connect() as conn:
            rows = await list_rollouts(conn, model=model, since=since, limit=limit, after=after)
        return RolloutPage(rows, encode_cursor(rows[-1]) if len(rows) == limit else None)

    async def export(self, *, model: str | None, since: float | None) -> AsyncIterator[Trajectory]:
        """Every rollout of `model` since `since`, assembled, page by page."""
        cursor = None
        while True:
            page = await self.page(model=model, since=since, limit=200, cursor=cursor)
            for row in page.data:
                yield await self.get(row.id, settle_seconds=0)
            if page.next_cursor is None:
                return
            cursor = page.next_cursor
