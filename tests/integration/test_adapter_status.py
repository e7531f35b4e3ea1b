"""A model's status never shows the store ahead of what the gateway serves.

`AdapterService` commits a step or a promotion to the store and then points the registry at it. A status read
between the two once showed a promotion row for step 1 with `served_step` still 0 (a CI run of
test_promotion). Here status reads run on the event loop the whole time steps commit and promotions move
back and forth, on a real store (SQLite and PostgreSQL) and the stand-in engine's LoRA API; every read
must agree with itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from engine.pool import EnginePool
from gateway.adapters import AdapterRegistry, AdapterService
from gateway.auth import ADMIN
from gateway.promotion.decision import AdminAsked, decide
from store.api import AdapterLoad, ModelStatus
from store.models import add_models
from tests.conftest import start_stub, stop_group

MODEL = "agent"
STEPS = 4
MOVES = 40  # promotions between the committed steps


@pytest.fixture(scope="module")
def stub_engine() -> Iterator[str]:
    url, proc = start_stub()
    yield url
    stop_group(proc)


def disagreements(status: ModelStatus) -> list[str]:
    """What in one status read contradicts the rest of it."""
    found = []
    if status.promotions and status.promotions[0].step != status.served_step:
        found.append(f"newest promotion to step {status.promotions[0].step}, served_step {status.served_step}")
    committed = [row.step for row in status.steps if row.status != "failed"]
    if max(committed, default=0) != status.latest_step:
        found.append(f"newest committed step {max(committed, default=0)}, latest_step {status.latest_step}")
    return found


async def test_status_reads_agree_with_themselves_while_steps_commit_and_promotions_move(
    engine: AsyncEngine, stub_engine: str, tmp_path: Path
) -> None:
    async with engine.begin() as conn:
        await add_models(conn, [MODEL])
    registry = AdapterRegistry("base", [MODEL])
    async with httpx.AsyncClient(base_url=stub_engine) as client:
        adapters = AdapterService(
            registry, client, engine, EnginePool([stub_engine], saturation=1), keep=STEPS, promotion="gated"
        )
        reads: list[ModelStatus] = []
        writing = True

        async def read_all_the_while() -> None:
            while writing:
                reads.append(await adapters.status(MODEL, ADMIN))
                await asyncio.sleep(0)

        readers = [asyncio.create_task(read_all_the_while()) for _ in range(3)]
        try:
            for step in range(1, STEPS + 1):
                path = tmp_path / f"step-{step}"
                path.mkdir()
                (path / "adapter_config.json").write_text("{}")
                await adapters.load(MODEL, AdapterLoad(step=step, path=str(path)))
            for move in range(MOVES):
                step = move % (STEPS + 1)  # the base weights too
                await adapters.promote(MODEL, decide(AdminAsked("promote", step, f"move {move}")))
        finally:
            writing = False
            await asyncio.gather(*readers)

    print(f"{len(reads)} status reads during {STEPS} commits and {MOVES} promotions")
    final = await adapters.status(MODEL, ADMIN)
    assert final.served_step == (MOVES - 1) % (STEPS + 1) and final.latest_step == STEPS
    assert final.promotions[0].reason == f"move {MOVES - 1}"
    assert len(reads) > MOVES and len({r.served_step for r in reads}) > 1, "the reads must interleave the writes"
    bad = [(k, found) for k, status in enumerate(reads) if (found := disagreements(status))]
    assert not bad, f"{len(bad)} of {len(reads)} status reads contradicted themselves, e.g. {bad[:3]}"
