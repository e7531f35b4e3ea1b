"""Where `artgw train` resumes when a committed checkpoint is damaged (#24): from the newest committed step whose
checkpoint loads, or the base weights, with one line saying so; never a traceback; and the groups of the steps it
resumes past are trained again (#40). Real checkpoints of the tiny model (PEFT, as the trainer saves them),
committed in a real store (SQLite and PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
import torch
from sqlalchemy.ext.asyncio import AsyncEngine

from store.adapters import AdapterRow, commit_step, committed_steps
from store.tables import groups
from trainer.checkpoints import restore, resume_point
from trainer.config import TrainConfig
from trainer.console import console
from trainer.lineage import resume_lineages
from trainer.model import load_policy, make_optimizer
from trainer.store_view import TrainerStore


@pytest.fixture
def config(tiny_model: Path) -> TrainConfig:
    return TrainConfig(base_model=str(tiny_model), db="sqlite+aiosqlite:///unused")


async def committed_damaged(engine: AsyncEngine, config: TrainConfig, root: Path) -> Path:
    """Step 1 committed, its optimizer state damaged: the checkpoint's path."""
    path = save_step(config, root, 1)
    await commit(engine, 1, path)
    (path / "optimizer.pt").write_bytes(b"not a pickle")
    return path


def save_step(config: TrainConfig, root: Path, step: int) -> Path:
    """A checkpoint as the trainer leaves one: the adapter and its optimizer state."""
    torch.manual_seed(step)
    model = load_policy(config, torch.device("cpu"), None)
    path = root / f"step-{step}"
    model.save_pretrained(path)
    torch.save(make_optimizer(model, config).state_dict(), path / "optimizer.pt")
    return path


async def resume(engine: AsyncEngine) -> tuple[int, AdapterRow | None]:
    async with engine.connect() as conn:
        return resume_point("m", await committed_steps(conn, "m"))


async def commit(engine: AsyncEngine, step: int, path: Path) -> None:
    async with engine.begin() as conn:
        await commit_step(conn, model="m", step=step, path=str(path), metrics=None, group_ids=[], lease_owner="")


def damaged(path: Path, how: str) -> None:
    weights = path / "adapter_model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "bad header":
        weights.write_bytes(b"\xff" * 64)
    else:  # the directory's config gone (a half-copied checkpoint)
        (path / "adapter_config.json").unlink()


@pytest.mark.parametrize("how", ["truncated", "bad header", "no config"])
async def test_a_damaged_newest_checkpoint_resumes_from_the_one_before(
    engine: AsyncEngine, config: TrainConfig, tmp_path: Path, how: str
) -> None:
    steps = {step: save_step(config, tmp_path, step) for step in (1, 2, 3)}
    for step, path in steps.items():
        await commit(engine, step, path)
    damaged(steps[3], how)
    with console.capture() as said:
        newest, committed = await resume(engine)
    assert newest == 3  # the next step is 4: step 3's number stays taken
    assert committed is not None and committed.step == 2
    (line,) = said.get().strip().splitlines()
    assert line.startswith(f"m: step 3's checkpoint {steps[3]} does not load (")
    # It restores: step 2's weights, as saved.
    policy, _ = restore(config, torch.device("cpu"), committed)
    saved = load_policy(config, torch.device("cpu"), steps[2])
    for (name, mine), (_, theirs) in zip(policy.model.named_parameters(), saved.named_parameters(), strict=True):
        assert torch.equal(mine, theirs), name


async def test_with_no_checkpoint_that_loads_it_resumes_from_the_base(
    engine: AsyncEngine, config: TrainConfig, tmp_path: Path
) -> None:
    damaged(await committed_damaged(engine, config, tmp_path), "truncated")
    with console.capture() as said:
        newest, committed = await resume(engine)
    assert (newest, committed) == (1, None)
    assert said.get().strip().splitlines()[-1] == "m: no committed checkpoint loads; resuming from the base weights"


async def test_a_damaged_optimizer_state_starts_fresh_with_a_warning(
    engine: AsyncEngine, config: TrainConfig, tmp_path: Path
) -> None:
    await committed_damaged(engine, config, tmp_path)
    _, committed = await resume(engine)
    assert committed is not None and committed.step == 1  # the adapter loads: it is the resume point
    with console.capture() as said:
        _, optimizer = restore(config, torch.device("cpu"), committed)
    assert "optimizer.pt does not load" in said.get() and "optimizer state fresh" in said.get()
    assert optimizer.state_dict()["state"] == {}


@pytest.mark.parametrize("lost", [1, 2])
async def test_the_groups_of_a_lost_step_are_trained_again(
    engine: AsyncEngine, store_url: str, tiny_model: Path, tmp_path: Path, lost: int
) -> None:
    """#40: a newest checkpoint truncated, the trainer resumed from the step before it while that step's groups
    stayed `trained`: their update silently gone from the lineage. Now they are `ready` again, and one line says
    so; the groups of the steps that still load (and of another model) stay trained."""
    config = TrainConfig(base_model=str(tiny_model), db=store_url, checkpoints=tmp_path / "ckpt", models=("m",))
    steps = {step: save_step(config, tmp_path, step) for step in (1, 2, 3)}
    for step, path in steps.items():
        await commit(engine, step, path)
    trained = [("g1", "m", 1), ("g2", "m", 2), ("g3a", "m", 3), ("g3b", "m", 3), ("other", "o", 3)]
    async with engine.begin() as conn:
        await conn.execute(
            sa.insert(groups),
            [
                {"id": i, "model": m, "state": "trained", "trained_step": s, "request_hash": i, "created_at": 1.0}
                | {"updated_at": 1.0}
                for i, m, s in trained
            ],
        )
    for step in range(4 - lost, 4):
        damaged(steps[step], "truncated")
    with TrainerStore.open(store_url) as store, console.capture() as said:
        (lineage,) = resume_lineages(config, store, torch.device("cpu"))
    assert lineage.step == 3 and lineage.committed is not None and lineage.committed.step == 3 - lost
    async with engine.connect() as conn:
        states = {i: state for i, state in await conn.execute(sa.select(groups.c.id, groups.c.state))}
    again = {"g2", "g3a", "g3b"} if lost == 2 else {"g3a", "g3b"}
    assert states == {i: "ready" if i in again else "trained" for i, _, _ in trained}
    (line,) = [x for x in said.get().splitlines() if "ready again" in x]
    what = "steps 2-3 lost with their checkpoints" if lost == 2 else "step 3 lost with its checkpoint"
    assert line == f"m: {what}: {len(again)} groups they trained are ready again, for step 4"
    # Resumed again: nothing more to give back, and nothing said of it.
    with TrainerStore.open(store_url) as store, console.capture() as said:
        resume_lineages(config, store, torch.device("cpu"))
    assert "ready again" not in said.get()
