"""Rollouts over HTTP: whose a rollout is and which step it is on (`RolloutOwners`), and reading them (the
store's reader, after the recorder has written what is on its way)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.adapters import Pin
from gateway.auth import Caller
from gateway.errors import OpenAIError
from recording.recorder import Recorder
from store.calls import RolloutFilter, RolloutOwner, RolloutRow, rollout_owner
from store.clock import SYSTEM_CLOCK, Clock
from store.errors import NotFound
from store.groups import group_key
from store.records import RolloutKey
from store.rollouts import RolloutPage, RolloutReader
from store.trajectories import Trajectory

log = logging.getLogger("artgw.gateway")

ROLLOUT_HEADER = "X-ART-Rollout-Id"  # the rollout a call belongs to (or a `/rollouts/{id}/v1` prefix)


@dataclass(slots=True)
class _Owner:
    model: str | None  # the trainable model whose rollout it is; None: none yet (unknown, or base calls only)
    step: int | None  # the step that served its first call of `model` (its pin); None: not known yet
    last_call: float  # when a call last joined it (the clock's monotonic seconds): an active rollout holds its step


class RolloutOwners:
    """A rollout belongs to the trainable model of its calls, and stays on the step that served its first call.

    Tenants apart: a rollout id names a rollout in its caller's namespace (store.access.Grant.namespace: its key;
    "" for the admin and --auth off's keyless calls), so two keys' `r1` are two rollouts, and neither can join,
    read, group, reward or even tell of the other's. Within one namespace, a call of another trainable model that
    names a rollout is refused (409 `rollout_id_taken`) before the engine sees it: its calls would be trained as
    that model's. Calls of the base model (no trainable model) join any rollout of their namespace, and a rollout
    of such calls only is taken by the first trainable model that calls in it.

    One policy per rollout: a call to `NAME` in a rollout goes to the step its first call was served by (its
    pin) while that step is loaded, so a promotion between two turns does not mix two policies in one
    trajectory; an explicit `NAME@K` still wins. A rollout that called within `hold_seconds` holds its step
    loaded (`held_steps`).

    Rollouts are remembered here (the newest `size`) and looked up in the store for those not seen yet (a
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
        self._owners: OrderedDict[RolloutKey, _Owner] = OrderedDict()

    async def pin(self, rollout: RolloutKey) -> Pin | None:
        """The model and step the rollout's first call was served by, once known (looked up in the store for
        a rollout not seen here yet)."""
        owner = await self._owner(rollout)
        if owner.model is None or owner.step is None:
            return None
        return Pin(owner.model, owner.step)

    async def claim(self, rollout: RolloutKey, model: str | None, step: int | None) -> None:
        """Let a call of `model` served by `step` join `rollout` (the first trainable one makes it its model's
        and its step the rollout's pin), or raise the 409."""
        owner = await self._owner(rollout)
        if model is not None and owner.model not in (None, model):
            raise OpenAIError(
                409,
                f"Rollout `{rollout.id}` is taken: all the calls of a rollout are of one model (it began with "
                "another one). Use another rollout id.",
                param=ROLLOUT_HEADER,
                code="rollout_id_taken",
            )
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

    async def _owner(self, rollout: RolloutKey) -> _Owner:
        owner = self._owners.get(rollout)
        if owner is not None:
            self._owners.move_to_end(rollout)
            return owner
        stored = await self._lookup(rollout)
        owner = self._owners.get(rollout)  # another call may have claimed it while the store answered
        if owner is None:
            owner = self._owners[rollout] = _Owner(None, None, last_call=self.clock.monotonic())
            if stored is not None:
                owner.model, owner.step = stored.model, stored.first_step
            if len(self._owners) > self.size:
                self._owners.popitem(last=False)
        return owner

    async def _lookup(self, rollout: RolloutKey) -> RolloutOwner | None:
        try:
            async with asyncio.timeout(self.lookup_seconds), self.store.connect() as conn:
                return await rollout_owner(conn, rollout)
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            log.warning("rollout %s: model unknown (%s); the store keeps a stray call apart", rollout.id, exc)
            return None


class RolloutService:
    def __init__(self, reader: RolloutReader, recorder: Recorder, *, settle_seconds: float = 5.0) -> None:
        self.reader = reader
        self.recorder = recorder
        self.settle_seconds = settle_seconds  # read-your-writes: wait this long for calls on their way

    async def settle(self, rollouts: Sequence[RolloutKey], within: float | None = None) -> bool:
        """Wait until no call of these rollouts is still on its way to the store; False on time-out."""
        return await self.recorder.settled(list(rollouts), self.settle_seconds if within is None else within)

    async def find(
        self, rollout_id: str, *, choice: int | None = None, caller: Caller, owner: str | None = None
    ) -> Trajectory | None:
        """The caller's rollout once its answered calls are in the store (`owner`: another owner's, for a caller
        with every owner's; see store.access.Grant.owner_of), if the caller may see it."""
        reads = caller.grant.owner_of(owner)
        if reads is not None:
            await self.settle([RolloutKey(reads, rollout_id)])
        return await self.reader.find(rollout_id, owner=reads, grant=caller.grant, choice=choice)

    async def sequence_counts(self, summaries: Sequence[RolloutRow], *, caller: Caller) -> dict[RolloutKey, int]:
        """How many sequences each of these rollouts assembles into (one when every call continued its rollout's
        tokens); a one-call rollout is one without being read. Only rollouts the caller may see are read."""
        counts = {RolloutKey(r.owner, r.id): 1 for r in summaries if r.call_count <= 1}
        slots = asyncio.Semaphore(8)

        async def count(row: RolloutRow) -> None:
            async with slots:
                trajectory = await self.reader.find(row.id, owner=row.owner, grant=caller.grant)
            if trajectory is not None:
                counts[RolloutKey(row.owner, row.id)] = len(trajectory.sequences)

        await asyncio.gather(*(count(r) for r in summaries if r.call_count > 1))
        return counts

    async def get(
        self, rollout_id: str, *, choice: int | None = None, caller: Caller, owner: str | None = None
    ) -> Trajectory:
        """The caller's rollout (`owner`: as in `find`) once its answered calls are in the store
        (read-your-writes, waiting up to settle_seconds).

        404 either way when it is not there, but saying which: unknown, or answered and still on its way to
        the store (a slow or locked store), which a client should retry. Another owner's rollout, for a caller
        that may not read it, is unknown: its own namespace has no such id."""
        reads = caller.grant.owner_of(owner)
        rollout = RolloutKey(reads or "", rollout_id)
        settled = await self.settle([rollout]) if reads is not None else True
        trajectory = await self.reader.find(rollout_id, owner=reads, grant=caller.grant, choice=choice)
        if trajectory is not None:
            return trajectory
        if reads is not None and (not settled or self.recorder.in_flight(rollout)):
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
        """A page of the rollouts `where` selects, of the caller's models and its own (every owner's for the
        admin) only (`newest_first`: as the UI lists them). `where.group_id` is one of the caller's groups (the
        admin, whose ids are kept as they are, names a key's group by its store key, `<key id>/<id>`)."""
        if where.group_id is not None:
            where = msgspec.structs.replace(where, group_id=group_key(caller.grant.namespace, where.group_id))
        return await self.reader.page(where, grant=caller.grant, limit=limit, cursor=cursor, newest_first=newest_first)
