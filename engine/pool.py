"""Several engines behind one gateway: which engine serves each call.

A rollout's calls go to the engine that served its first call (its prefix is in that engine's cache: keeping a
session on one engine is the largest published win for multi-turn agents), new rollouts and calls of no rollout to
the least loaded engine (the gateway's own count of its calls in flight there; ties to the one that served fewer).
Pinning alone backfires under load, so a rollout whose engine is out of rotation or saturated (more calls in flight
than `saturation`) moves to the least loaded engine, and stays there. An engine leaves rotation when a call to it
fails to connect or its health probe fails, or when it does not hold every LoRA step the gateway routes to
(quarantined: gateway/adapters.py publishes a step to every engine in rotation or to none); it comes back when its
probe answers and it holds them all again (`watch`'s `prepare` loads them first: an engine that restarted has none).

Pure bookkeeping, no I/O: the gateway (gateway/proxy.py) asks `pick` and reports `done` and `failed`; the probe
loop (`watch`) is given the probe to run.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass

log = logging.getLogger("artgw.engine")

# Rollouts whose engine is remembered (the most recently called): a rollout pushed out goes to the least loaded
# engine at its next call, which costs its prefix cache, nothing else. ~150 bytes each.
STICKY_ROLLOUTS = 200_000


@dataclass(slots=True, eq=False)
class Engine:
    """One engine of the pool, as the gateway sees it."""

    url: str  # its base URL, what a call's record names (CallRecord.engine)
    healthy: bool = True
    in_flight: int = 0  # calls of this gateway sent there and not yet ended
    calls: int = 0  # calls sent there, ever
    quarantined: str | None = None  # why it is out of rotation though it answers: a LoRA step it does not hold

    @property
    def in_rotation(self) -> bool:
        return self.healthy and self.quarantined is None


@dataclass(frozen=True, slots=True)
class Pick:
    """Where a call goes, and whether its rollout left the engine that served it before (and why)."""

    engine: Engine
    moved: str | None = None  # "unhealthy" | "quarantined" | "saturated": its previous engine could not take it
    remembered: bool = True  # the pool knew the rollout's engine (False: new here; `rejoin` may still find it)


class EnginePool:
    """The engines of one gateway and each rollout's engine."""

    def __init__(self, urls: Sequence[str], *, saturation: int, sticky: int = STICKY_ROLLOUTS) -> None:
        if not urls:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = tuple(Engine(url) for url in urls)
        self.saturation = saturation
        self.moves: dict[str, int] = {}  # rollouts moved off their engine, by why (Pick.moved, "unreachable")
        self._sticky: OrderedDict[Hashable, Engine] = OrderedDict()
        self._limit = sticky

    def __len__(self) -> int:
        return len(self.engines)

    @property
    def in_rotation(self) -> tuple[Engine, ...]:
        return tuple(e for e in self.engines if e.in_rotation)

    def least_loaded(self, exclude: Engine | None = None) -> Engine | None:
        """The engine in rotation with the fewest calls in flight (then the fewest calls); None if none is."""
        candidates = [e for e in self.engines if e.in_rotation and e is not exclude]
        return min(candidates, key=lambda e: (e.in_flight, e.calls), default=None)

    def pick(self, rollout: Hashable | None) -> Pick:
        """The engine for a call of `rollout` (None: a call of no rollout), counted in flight until `done`.
        With no engine in rotation the call still goes somewhere (its rollout's, else the first): it fails there
        with the engine's own error, as it would with one engine."""
        if len(self.engines) == 1:  # the supervised engine, or one --upstream: nothing to choose or remember
            only = self.engines[0]
            only.in_flight += 1
            only.calls += 1
            return Pick(only)
        sticky = self._sticky.get(rollout) if rollout is not None else None
        moved: str | None = None
        chosen: Engine | None = None
        if sticky is not None:
            if not sticky.healthy:
                moved = "unhealthy"
            elif sticky.quarantined is not None:
                moved = "quarantined"
            elif sticky.in_flight >= self.saturation:
                other = self.least_loaded(exclude=sticky)
                if other is not None and other.in_flight < sticky.in_flight:
                    moved = "saturated"
            if moved is None:
                chosen = sticky
        if chosen is None:
            chosen = self.least_loaded() or sticky or self.engines[0]
            if chosen is sticky:
                moved = None  # nowhere better to go
        if rollout is not None:
            self._remember(rollout, chosen)
        if moved is not None:
            self.moves[moved] = self.moves.get(moved, 0) + 1
        chosen.in_flight += 1
        chosen.calls += 1
        return Pick(chosen, moved, remembered=rollout is None or sticky is not None)

    def rejoin(self, rollout: Hashable, picked: Engine, url: str) -> Engine:
        """A call of a rollout the pool did not remember was picked for `picked`; `url` served the rollout's last
        call (through another replica, or before a restart: the store says so). The call goes back there, its
        prefix in that engine's cache, when it is in rotation and not saturated (`pick`'s escape); else it stays.
        `picked` keeps the call in its count of calls (a counter never goes down)."""
        engine = next((e for e in self.engines if e.url == url), None)
        if engine is None or engine is picked or not engine.in_rotation:
            return picked
        if engine.in_flight >= self.saturation and picked.in_flight < engine.in_flight:
            return picked
        picked.in_flight -= 1
        engine.in_flight += 1
        engine.calls += 1
        self._remember(rollout, engine)
        return engine

    def failover(self, rollout: Hashable | None, failed: Engine) -> Engine | None:
        """A call could not reach `failed`: it leaves rotation, and the call (counted in flight where it goes)
        goes to the least loaded other engine; None when there is none."""
        self.failed(failed)
        return self._move(rollout, failed, "unreachable")

    def lost_step(self, rollout: Hashable | None, engine: Engine, why: str) -> Engine | None:
        """`engine` answered that it does not hold a LoRA step the gateway routes to (it restarted since its last
        probe): quarantined, and the call goes to the least loaded other engine; None when there is none."""
        self.quarantine(engine, why)
        return self._move(rollout, engine, "quarantined")

    def _move(self, rollout: Hashable | None, left: Engine, why: str) -> Engine | None:
        """A call picked for `left` goes to the least loaded other engine in rotation (counted there); None when
        there is none."""
        other = self.least_loaded(exclude=left)
        if other is None:
            return None
        left.in_flight -= 1
        other.in_flight += 1
        other.calls += 1
        if rollout is not None:
            self._remember(rollout, other)
            self.moves[why] = self.moves.get(why, 0) + 1
        return other

    def done(self, engine: Engine) -> None:
        """A call picked for `engine` ended."""
        engine.in_flight -= 1

    def failed(self, engine: Engine) -> None:
        """A call could not reach `engine` (refused, reset, cut mid-answer): out of rotation until its probe
        answers. The last engine of a single-engine pool stays: there is nowhere else to send a call."""
        if engine.healthy and len(self.engines) > 1:
            engine.healthy = False
            log.warning("engine %s is out of rotation: a call could not reach it", engine.url)

    def quarantine(self, engine: Engine, why: str) -> None:
        """`engine` does not hold a LoRA step the gateway routes to: out of rotation until `watch`'s `prepare`
        loads every such step there. The only engine of a pool is never quarantined (a step it cannot load is
        published to none instead: gateway/adapters.py)."""
        if len(self.engines) > 1:
            if engine.quarantined is None:
                log.warning("engine %s is quarantined (out of rotation): %s", engine.url, why)
            engine.quarantined = why

    def probed(self, engine: Engine, ok: bool) -> None:
        """The outcome of `engine`'s health probe (for an engine coming back, after `prepare`, if any)."""
        if ok and not engine.healthy:
            engine.healthy = True
            log.warning("engine %s is back in rotation: its health probe answers", engine.url)
        elif not ok and engine.healthy and len(self.engines) > 1:
            engine.healthy = False
            log.warning("engine %s is out of rotation: its health probe fails", engine.url)

    async def watch(
        self,
        probe: Callable[[str], Awaitable[bool]],
        every: float,
        prepare: Callable[[Engine], Awaitable[str | None]] | None = None,
    ) -> None:
        """Probe every engine each `every` seconds, for as long as the gateway runs (cancelled at its stop). Each
        engine that answers is then given to `prepare`, which says why it cannot take calls (None: it can): one in
        rotation that lost a LoRA step (it restarted between two probes) is quarantined; one out of rotation (back
        from a restart with nothing loaded, or quarantined) takes no call before `prepare` has loaded what it must
        hold, and stays quarantined, tried again each round, until it has."""
        while True:
            results = await asyncio.gather(*(probe(e.url) for e in self.engines), return_exceptions=True)
            for engine, answered in zip(self.engines, results, strict=True):
                ok = answered is True
                if ok and prepare is not None and len(self.engines) > 1:
                    try:
                        why = await prepare(engine)
                    except Exception as exc:  # a store hiccup, say: the engine stays out, tried next round
                        why = f"its adapters could not be loaded: {exc!r}"
                    if why is not None:
                        engine.healthy = True  # it answers; the quarantine keeps it out of rotation
                        self.quarantine(engine, why)
                        continue
                    if engine.quarantined is not None:
                        log.warning("engine %s is back in rotation: it holds every served step", engine.url)
                        engine.quarantined = None
                self.probed(engine, ok)
            await asyncio.sleep(every)

    def _remember(self, rollout: Hashable, engine: Engine) -> None:
        self._sticky[rollout] = engine
        self._sticky.move_to_end(rollout)
        if len(self._sticky) > self._limit:
            self._sticky.popitem(last=False)
