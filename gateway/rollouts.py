"""Reading rollouts back: the service behind `/v1/art/rollouts` and `artgw export`."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.errors import OpenAIError, invalid_request
from gateway.recorder import Recorder
from store.calls import RolloutRow, list_rollouts, rollout_calls
from store.trajectories import Trajectory, assemble


class RolloutPage(msgspec.Struct, frozen=True):
    data: list[RolloutRow]
    next_cursor: str | None  # pass as `cursor` for the next page; None: this was the last
    object: str = "list"


def encode_cursor_pair(at: float, key: str) -> str:
    """A keyset cursor: the (time, id) of the last row of a page, opaque to clients."""
    return base64.urlsafe_b64encode(msgspec.json.encode([at, key])).decode()


def decode_cursor_pair(cursor: str) -> tuple[float, str]:
    try:
        at, key = msgspec.json.decode(base64.urlsafe_b64decode(cursor.encode()))
        return float(at), str(key)
    except Exception:
        raise invalid_request("Invalid cursor: pass `next_cursor` from the previous page.", param="cursor") from None


class RolloutService:
    def __init__(self, store: AsyncEngine, recorder: Recorder | None = None) -> None:
        self.store = store
        self.recorder = recorder

    async def find(
        self, rollout_id: str, *, choice: int | None = None, settle_seconds: float = 0.0
    ) -> Trajectory | None:
        """The assembled rollout, or None; waits up to `settle_seconds` for calls on their way to the store."""
        if self.recorder is not None and settle_seconds > 0:
            await self.recorder.settled([rollout_id], settle_seconds)
        async with self.store.connect() as conn:
            calls = await rollout_calls(conn, rollout_id)
        if calls is None:
            return None
        return assemble(rollout_id, calls, choice)

    async def get(self, rollout_id: str, *, choice: int | None = None, settle_seconds: float = 5.0) -> Trajectory:
        trajectory = await self.find(rollout_id, choice=choice, settle_seconds=settle_seconds)
        if trajectory is None:
            raise OpenAIError(404, f"No rollout `{rollout_id}` has been recorded.", code="rollout_not_found")
        return trajectory

    async def page(self, *, model: str | None, since: float | None, limit: int, cursor: str | None) -> RolloutPage:
        if not 1 <= limit <= 1000:
            raise invalid_request("'limit' must be between 1 and 1000.", param="limit")
        after = decode_cursor_pair(cursor) if cursor else None
        async with self.store.connect() as conn:
            rows = await list_rollouts(conn, model=model, since=since, limit=limit, after=after)
        last = rows[-1] if len(rows) == limit else None
        return RolloutPage(rows, encode_cursor_pair(last.last_call_at, last.id) if last else None)

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
