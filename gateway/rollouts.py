"""Rollouts over HTTP: whose a rollout is and which step it is on (`RolloutOwners`), and reading them (the
store's reader, after the recorder has written what is on its way)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.adapters import Pin
from gateway.auth import Caller
from gateway.errors import OpenAIError
from recording.recorder import Recorder
from store.access import Grant
from store.calls import RolloutFilter, RolloutOwner, RolloutRow, rollout_owner
from store.clock import SYSTEM_CLOCK, Clock
from store.errors import NotFound
from store.rollouts import RolloutPage, RolloutReader
from store.trajectories import Trajectory

log = logging.getLogger("artgw.gateway")

ROLLOUT_HEADER = "X-ART-Rollout-Id"  # the rollout a call belongs to (or a `/rollouts/{id}/v1` prefix)


@dataclass(slots=True)
class _Owner:
    model: str | None  # the trainable model whose rollout it is; None: none yet (unknown, or base calls only)
    step: int | None  # the step that served its first call of `model` (its pin); None: not known yet
    last_call: float  # when a call last joined it (the clock's monotonic seconds): an active rollout holds its step
    taken: bool = False  # a call has joined it: it is `key_id`'s
    key_id: str | None = None  # the key whose rollout it is (None: made by the admin, or without a key)


class RolloutOwners:
    """A rollout belongs to the trainable model of its calls, and stays on the step that served its first call.

    Tenants apart: a rollout is the key's that made its first call. A call of another key (of the same model
    too) or of another trainable model that names it is refused (409 `rollout_id_taken`, worded the same
    either way) before the engine sees it, so it never joins it: another key's calls can't be spliced into
    its sequence, read, grouped or trained as this key's, nor this key's as theirs. The admin joins any
    rollout; a keyless caller (--auth off) only those made without a key. Calls of the base model (no
    trainable model; no model-scoped key may make them) join any rollout their key may, and a rollout of such
    calls only is taken by the first trainable model that calls in it. Rollout ids are one space: a tenant
    that can guess another's ids learns they are taken, and can take them first (that one's calls then get the
    409), so clients should use ids nobody can guess (a UUID in them); the ones the gateway makes up are random.

    One policy per rollout: a call to `NAME` in a rollout goes to the step its first call was served by (its
    pin) while that step is loaded, so a promotion between two turns does not mix two policies in one
    trajectory; an explicit `NAME@K` still wins. A rollout that called within `hold_seconds` holds its step
    loaded (`held_steps`).

    Owners are remembered here (the newest `size` ids) and looked up in the store for ids not seen yet (a
    restart, another replica); with the store away the call goes on unpinned, and the store keeps a stray call
    apart when it writes it (store/calls.py).
    """

    def __init__(
        self,
        store: AsyncEngine,
        *,
        size: int = 50_000,
        lookup_seconds: float = 2.0,
        hold_seconds: float = 900.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.size = size
        self.lookup_seconds = lookup_seconds
        self.hold_seconds = hold_seconds
        self.clock = clock
        self._owners: OrderedDict[str, _Owner] = OrderedDict()

    async def pin(self, rollout_id: str, grant: Grant) -> Pin | None:
        """The model and step the rollout's first call was served by, once known (looked up in the store for
        an id not seen here yet); none for a rollout `grant` may not join (`claim` refuses its call)."""
        owner = await self._owner(rollout_id)
        if owner.model is None or owner.step is None or (owner.taken and not grant.owns(owner.key_id)):
            return None
        return Pin(owner.model, owner.step)

    async def claim(self, rollout_id: str, model: str | None, step: int | None, grant: Grant) -> None:
        """Let a call of `model` served by `step`, by a caller with `grant`, join `rollout_id` (the first call
        makes it its key's, the first trainable one makes it its model's and its step the rollout's pin), or
        raise the 409."""
        owner = await self._owner(rollout_id)
        if (owner.taken and not grant.owns(owner.key_id)) or (model is not None and owner.model not in (None, model)):
            # One wording for another key's and another model's: a tenant learns no more than that it is taken.
            raise OpenAIError(
                409,
                f"Rollout `{rollout_id}` is taken: all the calls of a rollout are one key's, of one model. "
                "Use another rollout id (one nobody can guess).",
                param=ROLLOUT_HEADER,
                code="rollout_id_taken",
            )
        if not owner.taken:
            owner.taken, owner.key_id = True, grant.owner
        if owner.model is None and model is not None:
            owner.model, owner.step = model, step
        elif owner.step is None:
            owner.step = step
        owner.last_call = self.clock.monotonic()

    def held_steps(self, model: str) -> dict[int, int]:
        """step -> how many of `model`'s rollouts that called within `hold_seconds` are pinned to it."""
        since = self.clock.monotonic() - self.hold_seconds
        held: dict[int, int] = {}
        for owner in self._owners.values():
            if owner.model == model and owner.step is not None and owner.last_call >= since:
                held[owner.step] = held.get(owner.step, 0) + 1
        return held

    async def _owner(self, rollout_id: str) -> _Owner:
        owner = self._owners.get(rollout_id)
        if owner is not None:
            self._owners.move_to_end(rollout_id)
            return owner
        stored = await self._lookup(rollout_id)
        owner = self._owners.get(rollout_id)  # another call may have claimed it while the store answered
        if owner is None:
            owner = self._owners[rollout_id] = _Owner(None, None, last_call=self.clock.monotonic())
            if stored is not None:
                owner.model, owner.step, owner.taken, owner.key_id = (
                    stored.model,
                    stored.first_step,
                    True,
                    stored.key_id,
                )
            if len(self._owners) > self.size:
                self._owners.popitem(last=False)
        return owner

    async def _lookup(self, rollout_id: str) -> RolloutOwner | None:
        try:
            async with asyncio.timeout(self.lookup_seconds), self.store.connect() as conn:
                return await rollout_owner(conn, rollout_id)
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

    async def find(self, rollout_id: str, *, choice: int | None = None, caller: Caller) -> Trajectory | None:
        """The rollout once its answered calls are in the store, if the caller may see it."""
        await self.settle([rollout_id])
        return await self.reader.find(rollout_id, grant=caller.grant, choice=choice)

    async def sequence_counts(self, summaries: Sequence[RolloutRow], *, caller: Caller) -> dict[str, int]:
        """How many sequences each of these rollouts assembles into (one when every call continued its rollout's
        tokens); a one-call rollout is one without being read. Only rollouts the caller may see are read."""
        counts = {r.id: 1 for r in summaries if r.call_count <= 1}
        slots = asyncio.Semaphore(8)

        async def count(rollout_id: str) -> None:
            async with slots:
                trajectory = await self.reader.find(rollout_id, grant=caller.grant)
            if trajectory is not None:
                counts[rollout_id] = len(trajectory.sequences)

        await asyncio.gather(*(count(r.id) for r in summaries if r.call_count > 1))
        return counts

    async def get(self, rollout_id: str, *, choice: int | None = None, caller: Caller) -> Trajectory:
        """The rollout once its answered calls are in the store (read-your-writes, waiting up to settle_seconds).

        404 either way when it is not there, but saying which: unknown, or answered and still on its way to
        the store (a slow or locked store), which a client should retry."""
        settled = await self.settle([rollout_id])
        trajectory = await self.reader.find(rollout_id, grant=caller.grant, choice=choice)
        if trajectory is not None:
            return trajectory
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
        caller: Caller,
        newest_first: bool = False,
    ) -> RolloutPage:
        """A page of the rollouts `where` selects, of the caller's models only (`newest_first`: as the UI lists
        them)."""
        return await self.reader.page(where, grant=caller.grant, limit=limit, cursor=cursor, newest_first=newest_first)
