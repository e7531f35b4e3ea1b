"""Which engine serves each call (engine/pool.py): a rollout's calls stay on the engine of its first call, new
rollouts go to the least loaded engine, and a rollout leaves an engine that is out of rotation or saturated."""

from __future__ import annotations

import asyncio

import pytest

from engine.pool import Engine, EnginePool
from tests.conftest import apoll

A, B, C = "http://a", "http://b", "http://c"


def urls(pool: EnginePool, *rollouts: str | None) -> list[str]:
    return [pool.pick(r).engine.url for r in rollouts]


def test_a_rollout_stays_on_the_engine_of_its_first_call() -> None:
    pool = EnginePool([A, B], saturation=10)
    first = pool.pick("r1").engine
    pool.pick("r2")  # new: the other engine, the less loaded
    for _ in range(5):  # the rollout's engine is busier than the other: still its own
        assert pool.pick("r1").engine is first
    assert first.in_flight == 6 and first.calls == 6


def test_new_rollouts_go_to_the_engine_with_the_fewest_calls_in_flight() -> None:
    pool = EnginePool([A, B, C], saturation=10)
    assert urls(pool, "r1", "r2", "r3") == [A, B, C]  # each to an idle engine
    a, b, c = pool.engines
    pool.done(b)  # r2's call ended: B has none in flight
    assert urls(pool, "r4") == [B]
    pool.done(a)
    pool.done(c)
    # A and C have none in flight, B one: of A and C, the one sent fewer calls (ties: the first).
    assert urls(pool, None) == [A]
    # A call of no rollout is not remembered, and one in flight counts: the next goes to C.
    assert urls(pool, None) == [C]


def test_a_rollout_leaves_an_engine_out_of_rotation_and_stays_where_it_went() -> None:
    pool = EnginePool([A, B], saturation=10)
    a, b = pool.engines
    assert pool.pick("r1").engine is a
    pool.failed(a)
    pick = pool.pick("r1")
    assert (pick.engine, pick.moved) == (b, "unhealthy")
    assert pool.pick("r2").engine is b  # new rollouts avoid it too
    pool.probed(a, True)  # back in rotation: r1 stays on B (its prefix is there now), new rollouts use A again
    assert pool.pick("r1") == type(pick)(b, None)
    assert pool.pick("r3").engine is a
    assert pool.moves == {"unhealthy": 1}


def test_a_rollout_leaves_a_saturated_engine_for_a_less_loaded_one() -> None:
    pool = EnginePool([A, B], saturation=2)
    b = pool.engines[1]
    assert urls(pool, "r1", "r1") == [A, A]  # at the bound: saturated
    pick = pool.pick("r1")
    assert (pick.engine, pick.moved) == (b, "saturated")
    assert pool.moves == {"saturated": 1}


def test_a_saturated_engine_keeps_its_rollout_when_no_engine_is_less_loaded() -> None:
    pool = EnginePool([A, B], saturation=1)
    assert urls(pool, "r1", "r2", "r1", "r2") == [A, B, A, B]
    assert pool.moves == {}


def test_with_no_engine_in_rotation_a_call_still_goes_to_its_rollouts_engine() -> None:
    """Nowhere better: the call goes on and fails there with the engine's own error, as with one engine."""
    pool = EnginePool([A, B], saturation=10)
    a, b = pool.engines
    assert urls(pool, "r1", "r2") == [A, B]
    pool.failed(a)
    pool.failed(b)
    assert urls(pool, "r2", None) == [B, A]
    assert pool.moves == {}


def test_a_single_engine_never_leaves_rotation() -> None:
    pool = EnginePool([A], saturation=1)
    (a,) = pool.engines
    pool.failed(a)
    pool.probed(a, False)
    assert a.healthy and pool.failover("r1", a) is None
    assert urls(pool, "r1", "r1") == [A, A]


def test_failover_moves_a_call_and_its_rollout_to_another_engine() -> None:
    pool = EnginePool([A, B, C], saturation=10)
    a, b, c = pool.engines
    pool.pick("r0")  # A
    pool.pick("r0b")  # B
    assert pool.pick("r1").engine is c
    assert pool.failover("r1", c) is a  # C out; A and B have one each, A was sent fewer (ties: order)
    assert (a.in_flight, b.in_flight, c.in_flight, c.healthy) == (2, 1, 0, False)
    assert pool.pick("r1").engine is a
    assert pool.failover("r1", a) is b
    assert pool.failover("r1", b) is None  # none left: the call fails where it is
    assert pool.moves == {"unreachable": 2}


def test_the_sticky_memory_is_bounded_by_recency() -> None:
    pool = EnginePool([A, B], saturation=10, sticky=2)
    assert urls(pool, "r1", "r2") == [A, B]
    pool.pick("r1")  # r1 called again: r2 is now the oldest
    pool.pick("r3")
    for engine in pool.engines:
        while engine.in_flight:
            pool.done(engine)
    # r2 was forgotten: it goes by load (B was sent fewer calls); r1 is still on A though B is idle as well.
    assert urls(pool, "r1", "r2") == [A, B]
    assert pool.engines[1].calls == 3  # r2, r3, and r2 again


async def test_the_probe_loop_takes_an_engine_out_and_brings_it_back() -> None:
    pool = EnginePool([A, B, C], saturation=10)
    answers = {A: True, B: False}
    b, c = pool.engines[1:]

    async def probe(url: str) -> bool:
        if url == C:
            raise OSError("a probe that raises is a failed probe")
        return answers[url]

    task = asyncio.create_task(pool.watch(probe, every=0.01))
    try:
        await apoll(lambda: not b.healthy and not c.healthy, 60, "B and C out of rotation")
        answers[B] = True
        await apoll(lambda: b.healthy, 60, "B back in rotation")
    finally:
        task.cancel()
    assert pool.engines[0].healthy and not c.healthy


def test_a_quarantined_engine_takes_no_call_and_its_rollouts_move() -> None:
    pool = EnginePool([A, B], saturation=10)
    a, b = pool.engines
    assert pool.pick("r1").engine is a
    pool.quarantine(a, "did not load m@2")
    assert (a.healthy, a.in_rotation, pool.in_rotation) == (True, False, (b,))
    pick = pool.pick("r1")
    assert (pick.engine, pick.moved) == (b, "quarantined")
    assert urls(pool, "r2", None) == [B, B]
    assert pool.failover("r2", b) is None  # not to a quarantined engine either
    assert pool.moves == {"quarantined": 1}


def test_the_only_engine_is_never_quarantined() -> None:
    """A step it cannot load is published to none instead (gateway/adapters.py)."""
    pool = EnginePool([A], saturation=1)
    pool.quarantine(pool.engines[0], "did not load m@1")
    assert pool.engines[0].in_rotation


async def test_an_engine_back_is_prepared_before_it_is_in_rotation_and_stays_out_until_it_is() -> None:
    pool = EnginePool([A, B], saturation=10)
    a, b = pool.engines
    pool.failed(b)  # a call could not reach it: it may come back restarted, holding nothing
    lacking = {B: "did not load m@2"}  # what `prepare` says of each engine: B's load fails
    asked: list[tuple[str, bool]] = []

    async def probe(url: str) -> bool:
        return True

    async def prepare(engine: Engine) -> str | None:
        asked.append((engine.url, engine.in_rotation))
        return lacking.get(engine.url)

    task = asyncio.create_task(pool.watch(probe, every=0.01, prepare=prepare))
    try:
        await apoll(lambda: b.quarantined == "did not load m@2", 60, "B quarantined: its load failed")
        assert b.healthy and not b.in_rotation and a.in_rotation
        assert (B, True) not in asked  # never in rotation before `prepare` said it holds everything
        del lacking[B]  # the next round's retry loads it
        await apoll(lambda: b.in_rotation, 60, "B back in rotation")
        lacking[A] = "it lost m@2 (restarted?)"  # an engine in rotation that lost a step: out until it has it
        await apoll(lambda: not a.in_rotation, 60, "A quarantined")
        assert pool.in_rotation == (b,)
    finally:
        task.cancel()


def test_an_empty_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        EnginePool([], saturation=1)


def test_a_rollout_new_to_the_pool_rejoins_the_engine_of_its_last_call_if_it_can_take_it() -> None:
    pool = EnginePool([A, B, C], saturation=3)
    a, b, c = pool.engines
    assert pool.pick(None).engine is a  # a call of no rollout: the first engine has served one
    pick = pool.pick("r1")  # its last call was on the first engine (another replica's): picked for the second
    assert (pick.engine, pick.remembered) == (b, False)
    assert pool.rejoin("r1", b, A) is a  # back where its prefix is, counted there
    assert (a.in_flight, b.in_flight, a.calls, b.calls) == (2, 0, 2, 1)
    pick = pool.pick("r1")  # remembered from now on
    assert (pick.engine, pick.remembered) == (a, True)
    # Where the last call's engine cannot take it (out of rotation, saturated, or not one of the pool's), the call
    # stays where it was picked.
    c.healthy = False
    assert pool.rejoin("r2", b, C) is b
    assert pool.rejoin("r3", b, "http://gone") is b
    assert a.in_flight == pool.saturation and pool.rejoin("r4", b, A) is b
