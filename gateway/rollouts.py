"""Rollouts over HTTP: whose a rollout is and which step it is on (`RolloutOwners`), and reading them (the
store's reader, after the recorder has written what is on its way)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import msgspec
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.adapters import Pin
from gateway.auth import Caller
from gateway.errors import OpenAIError
from recording.recorder import Recorder
from store.calls import RolloutFilter, RolloutOwner, RolloutRow, rollout_owners
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
    # A rollout not seen here yet: the store's answer (what it was on before: a restart, another replica) on its
    # way. Done: `model` and `step` are the store's, then this process's claims on top.
    known: asyncio.Future[None]

    @property
    def pin(self) -> Pin | None:
        return None if self.model is None or self.step is None else Pin(self.model, self.step)


class RolloutOwners:
    """A rollout belongs to the trainable model of its calls, and stays on the step that served its first call.

    Tenants apart: a rollout id names a rollout in its caller's namespace (store.access.Grant.namespace: its key;
    "" for the admin and --auth off's keyless calls), so two keys' `r1` are two rollouts, and neither can join,
    read, group, reward or even tell of the other's. Within one namespace, a call of another trainable model that
    names a rollout is refused (409 `rollout_id_taken`) before any of its answer reaches the client, and is not
    recorded: its calls would be trained as that model's. Calls of the base model (no trainable model) join any
    rollout of their namespace, and a rollout of such calls only is taken by the first trainable model that calls
    in it.

    One policy per rollout: a call to `NAME` in a rollout goes to the step its first call was served by (its
    pin) while that step is loaded, so a promotion between two turns does not mix two policies in one
    trajectory; an explicit `NAME@K` still wins. A rollout that called within `hold_seconds` holds its step
    loaded (`held_steps`).

    Rollouts are remembered here (the newest `size`) and looked up in the store for those not seen yet (a
    restart, another replica). Only the store knows another replica's rollouts (or what was there before a
    restart), so no answer from memory alone (a cache of the ids this process has not seen) could be exact; the
    look-up is kept off the answer's path instead. A SQLite store is read at once (`read_now`: a local
    read by primary key, microseconds, never waiting for a writer). Any other store (PostgreSQL, replicas) is
    asked while the engine works on the call (EngineCalls.answer), which is refused, or sent again to its pinned
    step, only if the store says so: the guard is as exact as before, at the cost of the engine's work on a
    call refused, which is rare. Look-ups waiting together are one query. With the store away the call goes on
    unpinned, and the store keeps a stray call apart when it writes it (store/calls.py).
    """

    def __init__(
        self,
        store: AsyncEngine,
        *,
        size: int = 50_000,
        lookup_seconds: float = 2.0,
        hold_seconds: float = 900.0,
        clock: Clock = SYSTEM_CLOCK,
        read_now: Callable[[RolloutKey], RolloutOwner | None] | None = None,
    ) -> None:
        self.store = store
        # A SQLite store (store/calls.py SqliteRolloutOwners): read at once, on the loop, in microseconds.
        self.read_now = read_now
        self.size = size
        self.lookup_seconds = lookup_seconds  # on `clock`
        self.hold_seconds = hold_seconds
        self.clock = clock
        self._owners: OrderedDict[RolloutKey, _Owner] = OrderedDict()
        self._unknown: dict[RolloutKey, _Owner] = {}  # seen, not yet looked up
        self._lookups: asyncio.Task[None] | None = None

    def owner(self, rollout: RolloutKey) -> _Owner:
        """The rollout as known here, its store look-up started if it is new here (see `known`)."""
        owner = self._owners.get(rollout)
        if owner is not None:
            self._owners.move_to_end(rollout)
            return owner
        owner = self._unknown.get(rollout)  # dropped from the newest while its look-up waited: that one
        if owner is None:
            owner = _Owner(None, None, self.clock.monotonic(), asyncio.get_running_loop().create_future())
            if not self._read_now(rollout, owner):
                self._unknown[rollout] = owner
                if self._lookups is None:
                    self._lookups = asyncio.create_task(self._look_up())
        self._owners[rollout] = owner
        if len(self._owners) > self.size:
            self._owners.popitem(last=False)
        return owner

    def _read_now(self, rollout: RolloutKey, owner: _Owner) -> bool:
        """Known at once from a SQLite store; False: to be looked up (another store, or SQLite busy)."""
        if self.read_now is None:
            return False
        try:
            stored = self.read_now(rollout)
        except sqlite3.Error as exc:
            log.debug("rollout %s: read at once failed (%s); looked up", rollout.id, exc)
            return False
        if stored is not None and stored.model is not None:
            owner.model, owner.step = stored.model, stored.first_step
        owner.known.set_result(None)
        return True

    def claim(self, rollout: RolloutKey, model: str | None, step: int | None) -> Awaitable[Pin | None] | None:
        """Let a call of `model` served by `step` join `rollout` (the first trainable one makes it its model's
        and its step the rollout's pin), or raise the 409. None: decided (joined) at once; else what decides
        once the store has answered, returning the rollout's pin (to be awaited at once, in a task of its own:
        the calls waiting decide in the order they began waiting)."""
        owner = self.owner(rollout)
        if owner.known.done() or model is None:  # a base call is never refused, and pins nothing
            self._join(owner, rollout, model, step)
            return None
        return self._claim_known(owner, rollout, model, step)

    async def _claim_known(self, owner: _Owner, rollout: RolloutKey, model: str, step: int | None) -> Pin | None:
        await asyncio.shield(owner.known)
        self._join(owner, rollout, model, step)
        return owner.pin

    def _join(self, owner: _Owner, rollout: RolloutKey, model: str | None, step: int | None) -> None:
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

    async def _look_up(self) -> None:
        """Look up the rollouts new here, all those waiting in one query, until none waits."""
        waiting: dict[RolloutKey, _Owner] = {}
        try:
            while self._unknown:
                waiting, self._unknown = self._unknown, {}
                stored = await self._lookup(list(waiting))
                for rollout, owner in waiting.items():
                    found = stored.get(rollout)
                    if found is not None and found.model is not None and owner.model is None:
                        owner.model, owner.step = found.model, found.first_step
                    owner.known.set_result(None)
        finally:
            self._lookups = None
            for owner in (*waiting.values(), *self._unknown.values()):  # stopped: what waits goes on unpinned
                if not owner.known.done():
                    owner.known.set_result(None)
            self._unknown.clear()

    async def _lookup(self, waiting: list[RolloutKey]) -> dict[RolloutKey, RolloutOwner]:
        query = asyncio.ensure_future(self._query(waiting))
        timer = asyncio.ensure_future(self.clock.sleep(self.lookup_seconds))
        try:
            await asyncio.wait((query, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
        if not query.done():
            query.cancel()
            error: BaseException = TimeoutError(f"no answer within {self.lookup_seconds} s")
        elif (error_or_none := query.exception()) is None:
            return query.result()
        else:
            error = error_or_none
        if not isinstance(error, SQLAlchemyError | OSError | TimeoutError):
            log.error("rollouts %s: looking up their models failed", [r.id for r in waiting], exc_info=error)
        else:
            ids = [r.id for r in waiting]
            log.warning("rollouts %s: model unknown (%s); the store keeps a stray call apart", ids, error)
        return {}

    async def _query(self, waiting: list[RolloutKey]) -> dict[RolloutKey, RolloutOwner]:
        async with self.store.connect() as conn:
            return await rollout_owners(conn, waiting)


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
