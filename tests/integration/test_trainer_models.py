"""One trainer, two trainable models on one base (issue #13): real vLLM, the gateway and `artgw train` as
processes, the unmodified OpenAI SDK, keys as a deployment uses them (`--auth required`, the admin key).

A gateway serves `a` and `b` (and the default `my-agent`, which nobody trains) on the session's tiny model;
4 groups of 3 SDK-recorded rollouts each for `a` and for `b`, rewards posted to /v1/art/groups. One
`artgw train --model a --model b` (2 groups a step) is SIGKILLed mid-step, between a's checkpoint and its
commit (`--pause-before-commit`); a second one, given no --base-model (it asks the gateway), trains the rest.
Then, per model: every group `trained` exactly once by a committed step of its own model, steps 1..k with no
gap, checkpoints under CHECKPOINTS/<model>/ only for those steps; each status lists only its own steps; and
calls to `a@1`, `b@1` and `b` are recorded with their own model and step.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import GatewayProcess, TrainerProcess, poll, query_store, start_gateway, stop_group
from tests.trainer_checks import assert_exactly_once, checkpoint, status

pytestmark = pytest.mark.engine

MODELS = ("a", "b")
GROUPS = 4  # per model: 2 steps of 2 groups each
PER_GROUP = 3
REWARDS = (1.0, 0.0, 0.5)  # rotated per group: every group has signal, so every claim makes a step


def sdk(gateway: GatewayProcess) -> openai.OpenAI:
    """The unmodified OpenAI SDK, its api_key the admin key (it has every scope, every model)."""
    return openai.OpenAI(base_url=gateway.base_url, api_key=gateway.admin_key, max_retries=0, timeout=120)


def chat(gateway: GatewayProcess, model: str, rollout_id: str, text: str) -> None:
    client = sdk(gateway)
    try:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=16,
            temperature=1.0,
            extra_headers={"X-ART-Rollout-Id": rollout_id},
        )
    finally:
        client.close()


def make_groups(gateway: GatewayProcess, model: str) -> list[str]:
    rollout_ids = [f"{model}-{i}-{uuid.uuid4().hex[:8]}" for i in range(GROUPS * PER_GROUP)]
    with ThreadPoolExecutor(4) as pool:
        list(
            pool.map(
                lambda i: chat(gateway, model, rollout_ids[i], f"Task {i // PER_GROUP}: say something."),
                range(len(rollout_ids)),
            )
        )
    group_ids = []
    for g in range(GROUPS):
        members = rollout_ids[g * PER_GROUP : (g + 1) * PER_GROUP]
        rewards = REWARDS[g % PER_GROUP :] + REWARDS[: g % PER_GROUP]
        answer = httpx.post(
            f"{gateway.base_url}/art/groups",
            json={
                "model": model,
                "group_id": f"{model}-g{g}-{uuid.uuid4().hex[:6]}",
                "rollouts": [{"rollout_id": r, "reward": w} for r, w in zip(members, rewards, strict=True)],
            },
            headers=gateway.admin,
            timeout=30,
        )
        assert answer.status_code == 201, answer.text
        assert answer.json()["state"] == "ready"
        group_ids.append(answer.json()["id"])
    return group_ids


def group_states(gateway: GatewayProcess) -> dict[str, tuple[str, str]]:
    """Every group: id -> (model, state)."""
    return {g: (m, s) for g, m, s in query_store(gateway.db_path, "SELECT id, model, state FROM groups")}


def recorded(gateway: GatewayProcess, model_id: str) -> tuple[str | None, int | None]:
    """Call `model_id` through the SDK as a rollout of its own; (model, step) the gateway recorded for it."""
    rollout_id = f"probe-{model_id.replace('@', '-at-')}-{uuid.uuid4().hex[:8]}"
    chat(gateway, model_id, rollout_id, "hi")
    answer = httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", headers=gateway.admin, timeout=30)
    assert answer.status_code == 200, answer.text
    rollout = answer.json()
    (call,) = rollout["calls"]
    return rollout["model"], call["step"]


@pytest.fixture
def gateway(vllm_url: str, tmp_path: Path) -> Iterator[GatewayProcess]:
    gateway = start_gateway(
        tmp_path, "--upstream", vllm_url, "--model-name", "a", "--model-name", "b", "--auth", "required"
    )
    yield gateway
    gateway.stop()


def test_one_trainer_trains_two_models_each_exactly_once_across_a_kill(
    gateway: GatewayProcess, tiny_model: Path
) -> None:
    groups = {model: make_groups(gateway, model) for model in MODELS}

    # ---- the first trainer: killed between a's first checkpoint and its commit
    first = TrainerProcess("trainer-killed", gateway, tiny_model, "--pause-before-commit", "600", models=MODELS)
    try:
        ckpt = checkpoint(gateway, 1, "a")  # `a` is polled first: its batch is ready first
        poll(lambda: (ckpt / "step.json").is_file(), 150, "a's first checkpoint", alive=[first])
        first.kill()
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == -signal.SIGKILL
    killed_groups = json.loads((ckpt / "step.json").read_text())["metrics"]["group_ids"]
    assert len(killed_groups) == 2 and set(killed_groups) <= set(groups["a"])
    states = group_states(gateway)
    assert {states[g] for g in killed_groups} == {("a", "training")}
    assert "trained" not in {state for _, state in states.values()}
    assert all(status(gateway, model)["steps"] == [] for model in MODELS)
    (ckpt / "KILLED_ATTEMPT").write_text("left by the killed trainer; a resumed trainer must not serve this")

    # ---- the second trainer, without --base-model: it asks the gateway, trains both models to the end
    resumed = TrainerProcess("trainer-resumed", gateway, None, models=MODELS)
    try:
        poll(
            lambda: {state for model, state in group_states(gateway).values() if model in MODELS} == {"trained"},
            240,
            "the resumed trainer to train every group of a and b",
            every=0.5,
            alive=[resumed],
        )
    finally:
        stop_group(resumed.proc, grace=60)
    assert resumed.returncode == 0, resumed.log()
    log = " ".join(resumed.log().split())
    assert "a: discarded uncommitted checkpoints [1]" in log, log
    assert "b: discarded" not in log
    assert f"base={tiny_model}" in log  # what the gateway said its engine loaded
    assert not (ckpt / "KILLED_ATTEMPT").exists()  # a's step 1 on disk is the resumed trainer's

    # ---- per model: exactly once, contiguous steps, only its own steps in its status
    steps = {model: [s["step"] for s in assert_exactly_once(gateway, groups[model], model)] for model in MODELS}
    assert set(killed_groups) <= set(groups["a"])  # trained again, once, by a's own steps (checked above)
    untouched = status(gateway, "my-agent")
    assert (untouched["steps"], untouched["served_step"], untouched["groups"]) == ([], 0, {})
    assert not (gateway.data_dir / "checkpoints" / "my-agent").exists()

    # ---- each serves only its own adapters: a@1 is a's step 1; b's calls record b's steps
    assert recorded(gateway, "a@1") == ("a", 1)
    assert recorded(gateway, "b@1") == ("b", 1)
    assert recorded(gateway, "b") == ("b", steps["b"][-1])
    assert recorded(gateway, "a") == ("a", steps["a"][-1])
    served = {
        m["id"] for m in httpx.get(f"{gateway.base_url}/models", headers=gateway.admin, timeout=10).json()["data"]
    }
    assert {f"{model}@{steps[model][-1]}" for model in MODELS} <= served
