"""Reading rollouts over HTTP: the store's reader, after the recorder has written what is on its way."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.recorder import Recorder
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

    async def get(self, rollout_id: str, *, choice: int | None = None) -> Trajectory:
        await self.settle([rollout_id])
        return await self.reader.get(rollout_id, choice=choice)

    async def page(self, *, model: str | None, since: float | None, limit: int, cursor: str | None) -> RolloutPage:
        return await self.reader.page(model=model, since=since, limit=limit, cursor=cursor)
