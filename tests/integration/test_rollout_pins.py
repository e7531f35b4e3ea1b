"""A rollout stays on one policy (#25): its calls to `NAME` go to the step that served its first call while that
step is loaded, whatever was promoted since (and `NAME@latest` there too, whatever was committed since); an
explicit `NAME@K` still wins; an active rollout keeps its step loaded, for `--rollout-pin-seconds` after its
last call; a restarted gateway finds a rollout's step in the store.

Each gateway runs in this process (tests/inprocess.py) on a `ManualClock`, in front of the stand-in engine (its
LoRA API takes any adapter directory); the step that served each call is read back from the store.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.rollouts import RolloutOwners
from gateway.settings import Settings
from store import create_engine, migrate
from store.records import RolloutKey
from tests.conftest import start_stub, stop_group
from tests.inprocess import InProcessGateway, ManualClock, serve_in_process
from tests.recorded import answered_call

MODEL = "my-agent"
PIN_SECONDS = 60.0


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    url, proc = start_stub()
    yield url
    stop_group(proc)


def settings(tmp_path: Path, stub_url: str) -> Settings:
    return Settings(upstream=(stub_url,), data_dir=tmp_path / "data", auth="off", rollout_pin_seconds=PIN_SECONDS)


def load(gateway: InProcessGateway, tmp_path: Path, step: int) -> None:
    """Commit `step` as a trainer does (promotion `always`: it is served at once)."""
    path = tmp_path / "checkpoints" / str(step)
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    answer = httpx.post(
        f"{gateway.base_url}/art/models/{MODEL}/adapters",
        json={"step": step, "path": str(path)},
        headers=gateway.admin,
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["served_step"] == step


def call(gateway: InProcessGateway, rollout_id: str, model: str = MODEL) -> int:
    """One chat call in `rollout_id`: the step that served it, as recorded."""
    return int(answered_call(gateway, rollout_id, model)["step"])


def status(gateway: InProcessGateway) -> dict:
    return httpx.get(f"{gateway.base_url}/art/models/{MODEL}", headers=gateway.admin, timeout=30).json()


def test_a_rollout_stays_on_the_step_of_its_first_call(tmp_path: Path, stub_url: str) -> None:
    clock = ManualClock()
    with serve_in_process(settings(tmp_path, stub_url), clock) as gateway:
        assert call(gateway, "on-base") == 0  # no adapter yet: the base weights
        load(gateway, tmp_path, 1)
        assert [call(gateway, r) for r in ("on-base", "on-one")] == [0, 1]
        load(gateway, tmp_path, 2)
        # Each rollout stays where it began; a new one gets the promoted step; `NAME@K` is what it says.
        assert [call(gateway, r) for r in ("on-base", "on-one", "fresh")] == [0, 1, 2]
        assert call(gateway, "on-one", f"{MODEL}@2") == 2
        assert call(gateway, "on-one") == 1
        assert call(gateway, "training", f"{MODEL}@latest") == 2  # a training rollout, on the newest step
        assert status(gateway)["pinned_rollouts"] == {"0": 1, "1": 1, "2": 2}

        # Three newer steps: without its rollout, step 1 (the oldest, not promoted) would be unloaded.
        for step in (3, 4, 5):
            load(gateway, tmp_path, step)
        assert status(gateway)["loaded_steps"] == [1, 2, 3, 4, 5]
        assert call(gateway, "on-one") == 1
        assert call(gateway, "training", f"{MODEL}@latest") == 2  # `@latest` too stays on the rollout's step
        assert call(gateway, "training-2", f"{MODEL}@latest") == 5

        # A minute without a call: the rollouts hold their steps no more, and the next commit unloads them.
        clock.advance(PIN_SECONDS + 1)
        load(gateway, tmp_path, 6)
        now = status(gateway)
        assert (now["loaded_steps"], now["pinned_rollouts"]) == ([3, 4, 5, 6], {}), now
        assert call(gateway, "on-one") == 6  # its step is gone: the promoted one
        assert call(gateway, "on-base") == 0  # the base weights never go
        assert call(gateway, "late") == 6

    # Restarted on its data dir, the gateway knows no rollout: it finds each one's first step in the store.
    with serve_in_process(settings(tmp_path, stub_url), ManualClock()) as gateway:
        load(gateway, tmp_path, 7)
        assert 6 in status(gateway)["loaded_steps"]
        assert [call(gateway, r) for r in ("late", "after-restart")] == [6, 7]
        assert status(gateway)["pinned_rollouts"] == {"6": 1, "7": 1}


async def claim(owners: RolloutOwners, rollout: RolloutKey) -> None:
    """A call of MODEL served by step 1 joins `rollout` (once the store has said whose it is, if new here)."""
    pending = owners.claim(rollout, MODEL, 1)
    if pending is not None:
        await pending


async def test_the_pins_are_kept_for_the_newest_rollouts_only(tmp_path: Path) -> None:
    """The gateway's memory is bounded (README): RSS grows with fresh rollout ids until its three per-rollout
    tables fill. The writer's cache and the continuations have byte budgets with tests of their own
    (tests/unit/test_store_codec.py, tests/unit/test_continuation.py); this is the third, the pins: however many
    rollouts call, it keeps the newest `size` (an unbounded table would hold all ten here)."""
    store = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'store.db'}")
    try:
        await migrate(store)
        owners = RolloutOwners(store, size=3)
        for i in range(10):
            await claim(owners, RolloutKey("key_a", f"r{i}"))
        assert owners.held_steps(MODEL) == {1: 3}  # every one called just now: only the newest three are kept
        await claim(owners, RolloutKey("key_a", "r9"))  # one of them again: still three
        assert owners.held_steps(MODEL) == {1: 3}
    finally:
        await store.dispose()
