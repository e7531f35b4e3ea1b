"""The trainer's turns between several models (trainer/lineage.py), on a real SQLite store behind the trainer's
synchronous view of it (trainer/store_view.py): who is ready, who is polled first, who trains next, and that the
groups a model claimed but did not train go back to `ready`."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from store.provide import open_store
from store.tables import groups
from trainer.config import TrainConfig
from trainer.lineage import Lineage, Turns, give_back
from trainer.stopping import SignalStop
from trainer.store_view import TrainerStore

OWNER = "trainer-1"


def lineage(name: str) -> Lineage:
    # The scheduler never touches a lineage's model or optimizer: nothing is loaded here.
    return Lineage(name, policy=None, optimizer=None, step=0, committed=None)  # type: ignore[arg-type]


def config(**options: object) -> TrainConfig:
    return TrainConfig(base_model="unused", db="unused", **{"groups_per_step": 2, "min_groups_per_step": 1, **options})


@pytest.fixture
def store(tmp_path: Path):
    """A migrated SQLite store holding ready groups: a-1 of model a, b-1 and b-2 of model b (oldest first)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'store.sqlite'}"

    async def make() -> None:
        async with open_store(url, migrate_schema=True) as made, made.engine.begin() as conn:
            rows = [("a-1", "a", 1.0), ("b-1", "b", 2.0), ("b-2", "b", 3.0)]
            await conn.execute(
                sa.insert(groups),
                [
                    {"id": i, "model": m, "state": "ready", "request_hash": i, "created_at": t, "updated_at": t}
                    for i, m, t in rows
                ],
            )

    asyncio.run(make())
    with TrainerStore.open(url) as opened:
        yield opened


def states(store: TrainerStore) -> dict[str, tuple[str, str | None]]:
    return {g.id: (g.state, g.lease_owner) for g in store.groups(["a-1", "b-1", "b-2"])}


def test_a_full_batch_is_ready_at_once_a_small_one_after_its_wait() -> None:
    waiting = lineage("a")
    waiting.deadline = 100.0
    waiting.claimed = ["g-1"]
    assert not waiting.ready(config(), now=99.0)  # one of two, and still within its wait
    assert waiting.ready(config(), now=100.0)  # the wait is over: one is enough
    assert not waiting.ready(config(min_groups_per_step=2), now=100.0)
    waiting.claimed = ["g-1", "g-2"]
    assert waiting.ready(config(), now=0.0)


def test_the_model_that_trained_goes_to_the_back_and_a_finished_one_leaves_the_line() -> None:
    a, b, c = lineage("a"), lineage("b"), lineage("c")
    turns = Turns([a, b, c])
    turns.trained(a)
    assert [x.name for x in turns.line] == ["b", "c", "a"]
    assert turns.others(c) == [b, a]
    b.done = 3
    assert [x.name for x in turns.waiting(config(max_steps=3))] == ["c", "a"]
    assert [x.name for x in turns.waiting(config())] == ["b", "c", "a"]  # no --max-steps: nobody finishes


def test_the_first_model_with_a_batch_trains_and_the_others_claims_go_back(store: TrainerStore) -> None:
    a, b = lineage("a"), lineage("b")
    turns = Turns([a, b])
    stop = threading.Event()
    settings = config(max_wait_seconds=3600.0)  # a's one group is never enough: b's two are a full batch
    chosen = turns.wait_for_batch(store, settings, OWNER, stop)
    assert chosen is b and b.claimed == ["b-1", "b-2"] and a.claimed == ["a-1"]
    assert states(store) == {"a-1": ("training", OWNER), "b-1": ("training", OWNER), "b-2": ("training", OWNER)}
    give_back(store, turns.others(b), OWNER)
    turns.trained(b)
    assert a.claimed == [] and states(store)["a-1"] == ("ready", None)
    assert [x.name for x in turns.line] == ["a", "b"]

    # b's groups are its step's now; a alone has one, enough once its wait is over.
    b.claimed, b.deadline = [], None
    a.deadline = None
    chosen = turns.wait_for_batch(store, config(max_wait_seconds=0.2), OWNER, stop)
    assert chosen is a and a.claimed == ["a-1"] and b.claimed == []


def test_a_stop_ends_the_wait_with_nothing_chosen(store: TrainerStore) -> None:
    stop = SignalStop()  # what `artgw train`'s signals set (trainer/stopping.py)
    a = lineage("a")
    threading.Timer(0.3, stop.set).start()
    assert Turns([a]).wait_for_batch(store, config(max_wait_seconds=3600.0), OWNER, stop) is None
    assert a.claimed == ["a-1"]  # what it claimed is the caller's to give back
    give_back(store, [a], OWNER)
    assert states(store)["a-1"] == ("ready", None)
