"""Reading rollouts over HTTP: the store's reader, after the recorder has written what is on its way."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from gateway.auth import ANONYMOUS, Caller
from gateway.errors import OpenAIError
from gateway.recorder import Recorder
from store.calls import RolloutFilter
from store.errors import NotFound
from store.rollouts import RolloutPage, RolloutReader
from store.trajectories import Trajectory


class RolloutService:
    def __init__(self, reader: RolloutReader, recorder: Recorder, *, settle_seconds: float = 5.0) -> None:
        self.reader = reader
        self.recorder = recorder
        self.settle_seconds = settle_seconds  # read-your-writes: wait this long for calls on their way

    async def settle(self, rollout_ids: Sequence[str], within: float | None = None) -> bool:
        """Wait until no call of these rollouts is still on its way to the store; False on time-out."""
        return await self.recorder.settled(list(rollout_ids), self.settle_seconds if within is None else within)

    async def find(self, rollout_id: str, *, choice: int | None = None) -> Trajectory | None:
        await self.settle([rollout_id])
        return await self.reader.find(rollout_id, choice=choice)

    async def get(self, rollout_id: str, *, choice: int | None = None, caller: Caller = ANONYMOUS) -> Trajectory:
        """The rollout once its answered calls are in the store (read-your-writes, waiting up to settle_seconds).

        404 either way when it is not there, but saying which: unknown, or answered and still on its way to
        the store (a slow or locked store), which a client should retry."""
        settled = await self.settle([rollout_id])
        trajectory = await self.reader.find(rollout_id, choice=choice)
        if trajectory is not None and caller.covers(trajectory.model):
            return trajectory
        if trajectory is not None:  # another key's model: as if it did not exist
            raise NotFound(f"No rollout `{rollout_id}` has been recorded.", code="rollout_not_found")
        if not settled or self.recorder.in_flight(rollout_id):
            raise OpenAIError(
                404,
                f"Rollout `{rollout_id}` is still being written to the store; retry shortly.",
                code="rollout_pending",
            )
        raise NotFound(f"No rollout `{rollout_id}` has been recorded.", code="rollout_not_found")

    async def page(
        self,
        where: RolloutFilter,
        *,
        limit: int,
        cursor: str | None,
        caller: Caller = ANONYMOUS,
        newest_first: bool = False,
    ) -> RolloutPage:
        """A page of the rollouts `where` selects, of the caller's models only (`newest_first`: as the UI lists
        them)."""
        if caller.models is not None:
            covered = caller.models if where.models is None else where.models & caller.models
            where = msgspec.structs.replace(where, models=covered)
        return await self.reader.page(where, limit=limit, cursor=cursor, newest_first=newest_first)
