"""Rollouts over HTTP: whose a rollout is (`RolloutOwners`), and reading them (the store's reader, after the
recorder has written what is on its way)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.auth import ANONYMOUS, Caller
from gateway.errors import OpenAIError
from gateway.recorder import Recorder
from store.calls import RolloutFilter, rollout_model
from store.errors import NotFound
from store.rollouts import RolloutPage, RolloutReader
from store.trajectories import Trajectory

log = logging.getLogger("artgw.gateway")

ROLLOUT_HEADER = "X-ART-Rollout-Id"  # the rollout a call belongs to (or a `/rollouts/{id}/v1` prefix)


class RolloutOwners:
    """A rollout belongs to the trainable model of its calls. A call of another trainable model that names it is
    refused (409 `rollout_id_taken`) before the engine sees it, so it never joins it: another key's calls can't
    be read, grouped or trained as this model's, nor this model's as theirs. Calls of the base model (no
    trainable model; no model-scoped key may make them) join any rollout, and a rollout of such calls only is
    taken by the first trainable model that calls in it.

    Rollout ids are not namespaced per model: a tenant that can guess another's ids can take them first (that
    one's calls then get the 409), so clients should use ids nobody can guess (a UUID in them); the ones the
    gateway makes up are random. Owners are remembered here (the newest `size` ids) and looked up in the store
    for ids not seen yet; with the store away the call goes on, and the store keeps a stray call apart when it
    writes it (store/calls.py).
    """

    def __init__(self, store: AsyncEngine, *, size: int = 50_000, lookup_seconds: float = 2.0) -> None:
        self.store = store
        self.size = size
        self.lookup_seconds = lookup_seconds
        self._owners: OrderedDict[str, str | None] = OrderedDict()  # rollout id -> its model (None: none yet)

    async def claim(self, rollout_id: str, model: str | None) -> None:
        """Let a call of `model` join `rollout_id` (the first trainable one makes it its own), or raise the 409."""
        if rollout_id in self._owners:
            self._owners.move_to_end(rollout_id)
        else:
            stored = await self._lookup(rollout_id)
            if rollout_id not in self._owners:  # else another call claimed it while the store answered
                self._owners[rollout_id] = stored
                if len(self._owners) > self.size:
                    self._owners.popitem(last=False)
        owner = self._owners[rollout_id]
        if owner is None:
            self._owners[rollout_id] = model
        elif model is not None and model != owner:
            raise OpenAIError(
                409,
                f"Rollout `{rollout_id}` belongs to another model: all the calls of a rollout are of one model. "
                "Use another rollout id (one nobody can guess).",
                param=ROLLOUT_HEADER,
                code="rollout_id_taken",
            )

    async def _lookup(self, rollout_id: str) -> str | None:
        try:
            async with asyncio.timeout(self.lookup_seconds), self.store.connect() as conn:
                return await rollout_model(conn, rollout_id)
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            log.warning("rollout %s: owner unknown (%s); the store keeps a stray call apart", rollout_id, exc)
            return None


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
