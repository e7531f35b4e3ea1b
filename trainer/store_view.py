"""The store as the trainer's synchronous loop sees it: one method a transaction, each run on an event loop in a
thread of its own (anyio's blocking portal).

The store's API is async (SQLAlchemy's async engine, shared with the gateway); the trainer's loop is torch work,
which must not run inside an event loop (it would block it) nor wait on one. This is the one boundary: the loop
calls plain methods, and only this module knows that an event loop exists.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal
from sqlalchemy.ext.asyncio import AsyncEngine

from store.access import EVERYTHING
from store.adapters import AdapterRow, committed_steps, last_committed_step
from store.groups import (
    GroupRow,
    MemberRow,
    claim_groups,
    drop_groups,
    finish_without_update,
    load_groups,
    release_earlier_attempts,
    release_groups,
    renew_lease,
    retrain_lost,
)
from store.provide import open_store
from store.rollouts import RolloutReader
from store.trajectories import Trajectory

T = TypeVar("T")
# The trainer is on no client's path: it waits out a store stall (a lock held 30 s) rather than fail a step.
STORE_WAIT_SECONDS = 30.0


class TrainerStore:
    """Claims, leases and the trained/failed moves of groups, the rollouts they hold, and the committed steps."""

    def __init__(self, portal: BlockingPortal, engine: AsyncEngine) -> None:
        self.portal = portal
        self.engine = engine

    @classmethod
    @contextmanager
    def open(cls, url: str) -> Iterator[TrainerStore]:
        """The store at `url` (StoreMissing if the gateway has not made it yet), for as long as the block runs."""
        with (
            start_blocking_portal() as portal,
            portal.wrap_async_context_manager(open_store(url, wait_seconds=STORE_WAIT_SECONDS)) as store,
        ):
            yield cls(portal, store.engine)

    def _write(self, action: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any) -> T:
        async def transaction() -> T:
            async with self.engine.begin() as conn:
                return await action(conn, *args, **kwargs)

        return self.portal.call(transaction)

    def _read(self, action: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any) -> T:
        async def read() -> T:
            async with self.engine.connect() as conn:
                return await action(conn, *args, **kwargs)

        return self.portal.call(read)

    # -- groups
    def claim(self, model: str, owner: str, lease_seconds: float, limit: int) -> list[str]:
        """Up to `limit` ready groups of `model`, oldest first, now leased to `owner`."""
        return self._write(
            claim_groups, model=model, owner=owner, lease_seconds=lease_seconds, limit=limit, now=time.time()
        )

    def renew(self, group_ids: Sequence[str], owner: str, lease_seconds: float) -> int:
        return self._write(renew_lease, group_ids, owner, lease_seconds, now=time.time())

    def release(self, group_ids: Sequence[str], owner: str) -> None:
        """Back to `ready`: the next claim trains them."""
        self._write(release_groups, group_ids, owner)

    def release_earlier_attempts(self, models: Sequence[str], prefix: str, owner: str) -> list[str]:
        return self._write(release_earlier_attempts, models, prefix, owner)

    def retrain_lost(self, model: str, kept: int) -> list[str]:
        """Back to `ready`: the groups of `model`'s steps after `kept`, whose checkpoints no longer load."""
        return self._write(retrain_lost, model, kept)

    def drop(self, group_id: str, owner: str, reason: str) -> None:
        """To `failed`, with why: never trained."""
        self._write(drop_groups, [group_id], owner, reason)

    def finish_without_update(self, group_ids: Sequence[str], owner: str, step: int) -> None:
        """To `trained` at `step` without a new adapter (no learning signal)."""
        self._write(finish_without_update, group_ids, owner, step)

    def groups(self, group_ids: Sequence[str]) -> list[GroupRow]:
        return self._read(load_groups, group_ids, grant=EVERYTHING)  # the trainer trains every model

    def trajectories(self, members: Sequence[MemberRow]) -> list[Trajectory]:
        """Each member's trajectory (its choice of its rollout), in order; NotFound for one that is gone."""
        reader = RolloutReader(self.engine)

        async def read() -> list[Trajectory]:
            return [
                await reader.get(m.rollout_id, owner=m.rollout_owner, grant=EVERYTHING, choice=m.choice)
                for m in members
            ]

        return self.portal.call(read)

    # -- committed steps
    def committed_steps(self, model: str) -> list[AdapterRow]:
        """Every step of `model` that served, newest first."""
        return self._read(committed_steps, model)

    def last_committed(self, model: str) -> AdapterRow | None:
        return self._read(last_committed_step, model)
