"""A trainer killed mid-step loses no group and trains none twice (real vLLM, gateway and trainer processes).

Each scenario: a gateway in front of the session's vLLM, 6 groups of 3 recorded rollouts with caller rewards,
an `artgw train` (2 groups a step, 4 s leases) SIGKILLed mid-step, then a second trainer that finishes every
group. Exactly once means: every group ends `trained`; the committed steps are 1..k with no gap; their
`group_ids` partition the 6 groups; the gateway serves step k; and what the killed attempt left on disk never
became a step (its checkpoint was discarded and written afresh by the step that did commit).

1. Killed between checkpoint and commit: `--pause-before-commit` holds the first trainer after it wrote
   CHECKPOINTS/my-agent/1/ and before it asked the gateway to serve it.
2. Killed while training, before any checkpoint: the first trainer is killed as soon as its claim shows in the
   store (its groups turn `training`); the claim commits before the step's data is even loaded.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import GatewayProcess, TrainerProcess, poll, query_store, start_gateway
from tests.trainer_checks import assert_exactly_once, checkpoint, group_states, status

pytestmark = pytest.mark.engine

MODEL = "my-agent"
GROUPS = 6
PER_GROUP = 3
REWARDS = (1.0, 0.0, 0.5)  # rotated per group: every group has signal


# -----------------------------------------------------------------------------
# helpers


def record_rollouts(gateway: GatewayProcess, count: int) -> list[str]:
    def one(i: int) -> str:
        rid = f"crash-{i}-{uuid.uuid4().hex[:8]}"
        answer = httpx.post(
            f"{gateway.base_url}/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Task {i // PER_GROUP}: say something."}],
                "max_tokens": 24,
                "temperature": 1.0,
            },
            headers={"X-ART-Rollout-Id": rid},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        return rid

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(count)))


def make_groups(gateway: GatewayProcess) -> list[str]:
    rollout_ids = record_rollouts(gateway, GROUPS * PER_GROUP)
    group_ids = []
    for g in range(GROUPS):
        members = rollout_ids[g * PER_GROUP : (g + 1) * PER_GROUP]
        rewards = REWARDS[g % PER_GROUP :] + REWARDS[: g % PER_GROUP]
        answer = httpx.post(
            f"{gateway.base_url}/art/groups",
            json={
                "model": MODEL,
                "group_id": f"g{g}-{uuid.uuid4().hex[:6]}",
                "rollouts": [{"rollout_id": r, "reward": w} for r, w in zip(members, rewards, strict=True)],
            },
            timeout=30,
            headers=gateway.admin,
        )
        assert answer.status_code == 201, answer.text
        assert answer.json()["state"] == "ready"
        group_ids.append(answer.json()["id"])
    return group_ids


def finish(gateway: GatewayProcess, base_model: Path, group_ids: list[str]) -> TrainerProcess:
    """A fresh trainer (no pause) until every group is trained; then SIGTERM, which it must obey cleanly."""
    trainer = TrainerProcess("trainer-resumed", gateway, base_model)
    try:
        poll(
            lambda: set(group_states(gateway).values()) == {"trained"},
            150,
            "the resumed trainer to train every group",
            every=0.5,
            alive=[trainer],
        )
    finally:
        code = trainer.stop()
    assert code == 0, trainer.log()
    return trainer


@pytest.fixture
def gateway(vllm_url: str, tmp_path: Path) -> Iterator[GatewayProcess]:
    gateway = start_gateway(tmp_path, "--upstream", vllm_url)
    yield gateway
    gateway.stop()


# -----------------------------------------------------------------------------
# the scenarios


def test_killed_between_checkpoint_and_commit(gateway: GatewayProcess, tiny_model: Path) -> None:
    group_ids = make_groups(gateway)
    first = TrainerProcess("trainer-killed", gateway, tiny_model, "--pause-before-commit", "600")
    try:
        ckpt = checkpoint(gateway, 1)
        poll(lambda: (ckpt / "step.json").is_file(), 150, "the first checkpoint", alive=[first])
        first.kill()
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == -signal.SIGKILL

    # The kill landed where it should: step 1 written, not committed; its groups claimed, not trained.
    killed_groups = json.loads((ckpt / "step.json").read_text())["metrics"]["group_ids"]
    assert len(killed_groups) == 2
    assert status(gateway)["steps"] == [] and status(gateway)["served_step"] == 0
    states = group_states(gateway)
    assert {states[g] for g in killed_groups} == {"training"}
    assert "trained" not in states.values()
    (ckpt / "KILLED_ATTEMPT").write_text("left by the killed trainer; a resumed trainer must not serve this")

    resumed = finish(gateway, tiny_model, group_ids)

    assert "discarded uncommitted checkpoints [1]" in " ".join(resumed.log().split()), resumed.log()
    assert not (ckpt / "KILLED_ATTEMPT").exists()  # step 1 on disk is the resumed trainer's, not the killed one's
    steps = assert_exactly_once(gateway, group_ids)
    # The killed attempt's groups were trained again, once, by the resumed trainer.
    assert set(killed_groups) <= {g for s in steps for g in s["metrics"]["group_ids"]}


def test_killed_while_training_before_checkpoint(gateway: GatewayProcess, tiny_model: Path) -> None:
    group_ids = make_groups(gateway)
    db = gateway.db_path
    # The pause only matters if the kill came late: then the step still never commits.
    first = TrainerProcess("trainer-killed", gateway, tiny_model, "--pause-before-commit", "600")
    try:
        claimed = poll(
            lambda: query_store(db, "SELECT id FROM groups WHERE state = 'training' AND lease_owner IS NOT NULL"),
            150,
            "the first trainer's claim",
            every=0.02,
            alive=[first],
        )
        first.kill()
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == -signal.SIGKILL
    ckpt_root = gateway.data_dir / "checkpoints" / MODEL
    left = sorted(p.name for p in ckpt_root.iterdir()) if ckpt_root.exists() else []
    print(f"\nkilled right after claiming {len(claimed)} groups; checkpoints on disk at the kill: {left}")

    assert status(gateway)["steps"] == [] and status(gateway)["served_step"] == 0
    states = group_states(gateway)
    assert {states[g] for (g,) in claimed} == {"training"}
    assert "trained" not in states.values()
    if left:  # the step got further than the claim before the kill: its leftovers must not survive
        for name in left:
            (ckpt_root / name / "KILLED_ATTEMPT").write_text("left by the killed trainer")

    finish(gateway, tiny_model, group_ids)

    assert not list(ckpt_root.glob("*/KILLED_ATTEMPT"))
    assert_exactly_once(gateway, group_ids)
