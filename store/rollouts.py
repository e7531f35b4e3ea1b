"""Reading rollouts back: one rollout assembled, pages of rollouts, an export of them all.

Used by the gateway's `/v1/art/rollouts`, `artgw export` and the trainer. Knows nothing of HTTP: an
unknown rollout is `NotFound`, a bad cursor or limit `Invalid`.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from store.access import Grant
from store.calls import RolloutFilter, RolloutRow, last_chat_call, list_rollouts, rollout_calls
from store.errors import Invalid, NotFound
from store.records import CallRecord, RolloutKey
from store.trajectories import Trajectory, assemble

MAX_PAGE = 1000


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
    except (ValueError, TypeError, msgspec.DecodeError):
        raise Invalid("Invalid cursor: pass `next_cursor` from the previous page.", param="cursor") from None


def check_limit(limit: int) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise Invalid(f"'limit' must be between 1 and {MAX_PAGE}.", param="limit")


class RolloutReader:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def find(
        self, rollout_id: str, *, owner: str | None, grant: Grant, choice: int | None = None
    ) -> Trajectory | None:
        """The assembled rollout `rollout_id` of `owner`'s (`choice`: that choice of its n > 1 calls), or None if
        never recorded, of a model `grant` does not cover, or of an owner it may not read (`owner` None:
        nobody's; see `Grant.owner_of`)."""
        if owner is None or grant.owner_of(owner) != owner:
            return None
        async with self.engine.connect() as conn:
            calls = await rollout_calls(conn, RolloutKey(owner, rollout_id))
        if calls is None:
            return None
        # One choice of an n > 1 call is a rollout of its own, named as groups name it.
        trajectory = assemble(rollout_id if choice is None else f"{rollout_id}/{choice}", calls, choice)
        return msgspec.structs.replace(trajectory, owner=owner) if grant.covers(trajectory.model) else None

    async def last_chat_call(self, rollout: RolloutKey) -> CallRecord | None:
        """The rollout's last answered chat call (store/calls.py `last_chat_call`)."""
        async with self.engine.connect() as conn:
            return await last_chat_call(conn, rollout)

    async def get(self, rollout_id: str, *, owner: str | None, grant: Grant, choice: int | None = None) -> Trajectory:
        trajectory = await self.find(rollout_id, owner=owner, grant=grant, choice=choice)
        if trajectory is None:
            raise NotFound(f"No rollout `{rollout_id}` has been recorded.", code="rollout_not_found")
        return trajectory

    async def page(
        self, where: RolloutFilter, *, grant: Grant, limit: int, cursor: str | None, newest_first: bool = False
    ) -> RolloutPage:
        """A page of the rollouts `where` selects of the models `grant` covers, oldest first (`newest_first`: as
        the UI lists them); `cursor`: the previous page's `next_cursor`."""
        check_limit(limit)
        after = decode_cursor_pair(cursor) if cursor else None
        async with self.engine.connect() as conn:
            rows = await list_rollouts(conn, where, grant=grant, limit=limit, after=after, newest_first=newest_first)
        last = rows[-1] if len(rows) == limit else None
        return RolloutPage(rows, encode_cursor_pair(last.last_call_at, last.id) if last else None)

    async def export(self, where: RolloutFilter, *, grant: Grant) -> AsyncIterator[Trajectory]:
        """Every rollout `where` selects of the models and owners `grant` covers, assembled, page by page."""
        cursor = None
        while True:
            page = await self.page(where, grant=grant, limit=200, cursor=cursor)
            for row in page.data:
                yield await self.get(row.id, owner=row.owner, grant=grant)
            if page.next_cursor is None:
                return
            cursor = page.next_cursor
