"""The canary: `artgw serve --promotion gated --canary 0.3` and no eval set, in front of the stand-in engine.

Steps are real LoRA adapters (PEFT, random weights, on the tiny model) loaded as a trainer loads them (the real
engine serving hot-loaded steps is test_trainer_e2e's). The rewards are the test's own (`POST /v1/art/rewards`
and groups), so what is decided is known in advance:

- a candidate gets 30% of the rollouts asking for `my-agent`, every call of a rollout on one step, and each
  reward counts for the step that served its rollout; rewarded better, it is promoted;
- once promoted, its live reward falling below the step before it rolls it back automatically;
- a worse candidate is dropped: `my-agent` keeps serving what it served.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import GatewayProcess, gateway_on_stub, make_adapter, metric, poll

MODEL = "my-agent"
SHARE = 0.3
MIN_REWARDS = 60
ROLLOUTS = 400


@pytest.fixture(scope="module")
def canary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    # The stand-in engine loads adapters as vLLM's runtime LoRA API does; what it answers is not judged here.
    with gateway_on_stub(
        tmp_path_factory.mktemp("canary"),
        *("--promotion", "gated", "--canary", str(SHARE)),
        *("--canary-min-rewards", str(MIN_REWARDS), "--gate-margin", "0.05"),
    ) as gateway:
        yield gateway


def status(gateway: GatewayProcess) -> dict[str, Any]:
    answer = httpx.get(f"{gateway.base_url}/art/models/{MODEL}", timeout=10, headers=gateway.admin)
    answer.raise_for_status()
    return answer.json()


def load_step(gateway: GatewayProcess, step: int, path: Path) -> None:
    answer = httpx.post(
        f"{gateway.base_url}/art/models/{MODEL}/adapters",
        json={"step": step, "path": str(path)},
        headers=gateway.admin,
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    poll(lambda: status(gateway)["canary_step"] == step, 60, f"step {step}'s canary to start")


async def run_rollouts(gateway: GatewayProcess, ids: list[str], calls: int) -> None:
    """`calls` calls of `my-agent` per rollout id, 16 rollouts at a time."""
    slots = asyncio.Semaphore(16)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120) as client:

        async def one(rollout_id: str) -> None:
            async with slots:
                for _ in range(calls):
                    answer = await client.post("/chat/completions", json=body, headers={"X-ART-Rollout-Id": rollout_id})
                    assert answer.status_code == 200, answer.text

        await asyncio.gather(*(one(i) for i in ids))


def served_steps(gateway: GatewayProcess, ids: list[str]) -> dict[str, list[int]]:
    """The step of every recorded call of each rollout."""
    return {
        i: [
            c["step"]
            for c in httpx.get(f"{gateway.base_url}/art/rollouts/{i}", timeout=10, headers=gateway.admin).json()[
                "calls"
            ]
        ]
        for i in ids
    }


def reward(gateway: GatewayProcess, rollout_id: str, value: float) -> None:
    answer = httpx.post(
        f"{gateway.base_url}/art/rewards",
        json={"rollout_id": rollout_id, "reward": value},
        timeout=30,
        headers=gateway.admin,
    )
    assert answer.status_code == 201, answer.text


def canary_row(model_status: dict[str, Any], step: int) -> dict[str, Any]:
    (row,) = [e for e in model_status["evaluations"] if e["step"] == step and e["eval_set"] == "live-canary"]
    return row


def test_canary_promotes_rolls_back_and_drops(canary: GatewayProcess, tiny_model: Path, tmp_path: Path) -> None:
    assert (status(canary)["served_step"], status(canary)["canary_share"]) == (0, SHARE)

    # -- step 1: 30% of the rollouts, every call of a rollout on one step
    load_step(canary, 1, make_adapter(tiny_model, tmp_path / "step-1", seed=1))
    ids = [f"c1-{i}" for i in range(ROLLOUTS)]
    asyncio.run(run_rollouts(canary, ids, calls=2))
    steps = served_steps(canary, ids)
    assert all(len(s) == 2 and s[0] == s[1] for s in steps.values()), "a rollout's calls on two steps"
    on_canary = [i for i, s in steps.items() if s[0] == 1]
    on_promoted = [i for i, s in steps.items() if s[0] == 0]
    assert len(on_canary) + len(on_promoted) == ROLLOUTS
    share = len(on_canary) / ROLLOUTS
    print(f"canary share {share:.3f} of {ROLLOUTS} rollouts (configured {SHARE})")
    assert abs(share - SHARE) <= 0.05

    # Rewards: the candidate's arm first (all of them), then the promoted arm's until the canary is decided.
    candidate_rewards = [1.0 if k % 4 else 0.6 for k in range(len(on_canary))]
    for rollout_id, value in zip(on_canary, candidate_rewards, strict=True):
        reward(canary, rollout_id, value)
    assert status(canary)["canary_step"] == 1  # the promoted arm has no rewards yet: nothing decided
    arm = {"model": MODEL, "arm": "candidate"}
    assert metric(canary.url, "artgw_canary_share", exported=True, model=MODEL) == SHARE
    assert metric(canary.url, "artgw_canary_rewarded_rollouts", exported=True, **arm) == len(on_canary)
    assert metric(canary.url, "artgw_canary_reward_mean", **arm) == pytest.approx(statistics.fmean(candidate_rewards))
    assert metric(canary.url, "artgw_canary_rewarded_rollouts", model=MODEL, arm="promoted") == 0
    for rollout_id in on_promoted:
        reward(canary, rollout_id, 0.2)
    decided = poll(lambda: (s := status(canary))["served_step"] == 1 and s, 30, "step 1 to be promoted")
    row = canary_row(decided, 1)
    assert row["status"] == "passed" and row["baseline_step"] == 0, row
    assert row["mean"] == pytest.approx(statistics.fmean(candidate_rewards))  # each reward on its own arm
    assert row["baseline_mean"] == pytest.approx(0.2)
    assert decided["canary_step"] is None
    assert (decided["promotions"][0]["actor"], decided["promotions"][0]["action"]) == ("canary", "promote")

    # -- step 1 does worse live than step 0 did: rolled back on its own
    later = [f"c1-live-{i}" for i in range(MIN_REWARDS)]
    asyncio.run(run_rollouts(canary, later, calls=1))
    assert {s[0] for s in served_steps(canary, later).values()} == {1}
    for rollout_id in later:
        reward(canary, rollout_id, 0.0)
    back = poll(lambda: (s := status(canary))["served_step"] == 0 and s, 30, "step 1 to be rolled back")
    rollback = back["promotions"][0]
    assert (rollback["action"], rollback["actor"], rollback["step"], rollback["previous_step"]) == (
        "rollback",
        "canary",
        0,
        1,
    )
    assert "live reward fell" in rollback["reason"]
    assert metric(canary.url, "artgw_promotions_total", model=MODEL, action="rollback", actor="canary") == 1
    assert metric(canary.url, "artgw_canary_share", model=MODEL) == 0

    # -- step 2, rewarded worse through groups: dropped, `my-agent` stays on step 0
    load_step(canary, 2, make_adapter(tiny_model, tmp_path / "step-2", seed=2))
    ids = [f"c2-{i}" for i in range(ROLLOUTS)]
    asyncio.run(run_rollouts(canary, ids, calls=1))
    steps = served_steps(canary, ids)
    arms = {step: [i for i, s in steps.items() if s[0] == step] for step in (0, 2)}
    for n, start in enumerate(range(0, min(len(arms[0]), len(arms[2])) - 1, 2)):
        rollouts = [{"rollout_id": arms[2][start + k], "reward": 0.0} for k in range(2)]
        rollouts += [{"rollout_id": arms[0][start + k], "reward": 1.0} for k in range(2)]
        body = {"model": MODEL, "group_id": f"c2-group-{n}", "rollouts": rollouts}
        assert (
            httpx.post(f"{canary.base_url}/art/groups", json=body, timeout=30, headers=canary.admin).status_code == 201
        )
    dropped = poll(lambda: (s := status(canary))["canary_step"] is None and s, 30, "step 2's canary to end")
    row = canary_row(dropped, 2)
    assert row["status"] == "failed" and (row["mean"], row["baseline_mean"]) == (0.0, 1.0), row
    assert (dropped["served_step"], dropped["latest_step"]) == (0, 2)
    assert [(e["event"], e["step"]) for e in dropped["adapter_events"]] == [("loaded", 2), ("loaded", 1)]

    # A reward is given once; an eval or unknown rollout is refused.
    same = httpx.post(
        f"{canary.base_url}/art/rewards",
        json={"rollout_id": "c1-live-0", "reward": 0.0},
        timeout=30,
        headers=canary.admin,
    )
    assert same.status_code == 200, same.text
    other = httpx.post(
        f"{canary.base_url}/art/rewards",
        json={"rollout_id": "c1-live-0", "reward": 1.0},
        timeout=30,
        headers=canary.admin,
    )
    assert other.status_code == 409 and other.json()["error"]["code"] == "reward_conflict", other.text
    unknown = httpx.post(
        f"{canary.base_url}/art/rewards", json={"rollout_id": "nope", "reward": 1.0}, timeout=30, headers=canary.admin
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "rollout_not_found", unknown.text
    bad = httpx.post(
        f"{canary.base_url}/art/rewards",
        json={"rollout_id": "c2-0", "reward": "high"},
        timeout=30,
        headers=canary.admin,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reward", bad.text
