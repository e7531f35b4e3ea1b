"""`artgw train --wandb-project` (issue 16): a real trainer's W&B run, offline, read back with W&B's own reader.

A gateway serves `a` and `b` in front of the stand-in engine (tests/stub_engine.py, whose LoRA API is enough to
commit adapters); the store holds 4 groups of 3 one-call rollouts for `a` and 2 for `b`, written directly with
random token ids, with caller rewards. One `artgw train --model a --model b --wandb-project ...` (2 groups a
step: 2 steps of `a`, 1 of `b`) runs with WANDB_MODE=offline and W&B's directories in the test's tmp, and is
stopped with SIGTERM once every group is trained. `wandb leet inspect --json` (W&B's reader of a run's .wandb
transaction log) gives the run's records back, and they must show:

- the run: the project and name given, the TrainConfig as its config, no admin key anywhere in the file;
- each model's metrics under its own prefix with its own step as the x-axis, every number equal to the step's
  metrics the gateway stored (GET /v1/art/models/NAME: steps[].metrics);
- each committed step's adapter as a "lora" artifact named after the model, aliased step-K, whose files are the
  checkpoint's (same names and MD5s) without the optimizer state;
- a clean finish on SIGTERM (an exit record with code 0).

And a run W&B refuses (online, no API key) stops `artgw train` with one line, before any step.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import (
    ARTGW,
    GatewayProcess,
    TrainerProcess,
    free_port,
    make_call,
    poll,
    query_store,
    start_gateway,
    start_stub,
    stop_group,
    write_records,
)

GROUPS = {"a": 4, "b": 2}  # 2 groups a step: 2 steps of a, 1 of b
PER_GROUP = 3
REWARDS = (1.0, 0.0, 0.5)  # rotated per group: every group has signal, so every claim makes a step
PROJECT = "artgw-test"
RUN_NAME = "wandb-test"
WANDB = str(Path(sys.executable).with_name("wandb"))


def record_groups(gateway: GatewayProcess) -> None:
    """Each model's groups: the calls written to the store directly, the groups posted to the gateway."""
    rng = random.Random(16)
    records, members = [], {model: [] for model in GROUPS}
    for model, groups in GROUPS.items():
        for i in range(groups * PER_GROUP):
            prompt = [rng.randrange(10, 1000) for _ in range(rng.randrange(6, 30))]
            sampled = [rng.randrange(10, 1000) for _ in range(rng.randrange(3, 20))]
            logprobs = [-rng.uniform(0.1, 3.0) for _ in sampled]
            reply = ({"role": "assistant", "content": f"answer {i}"}, sampled, logprobs)
            rollout_id = f"{model}-rollout-{i}"
            records.append(
                make_call(f"{model}-call-{i}", float(i), None, prompt, reply, rollout_id=rollout_id, model=model)
            )
            members[model].append(rollout_id)

    write_records(gateway.db_path, records)
    for model, groups in GROUPS.items():
        for g in range(groups):
            rewards = REWARDS[g % PER_GROUP :] + REWARDS[: g % PER_GROUP]
            rollouts = members[model][g * PER_GROUP : (g + 1) * PER_GROUP]
            answer = httpx.post(
                f"{gateway.base_url}/art/groups",
                json={
                    "model": model,
                    "group_id": f"{model}-g{g}",
                    "rollouts": [{"rollout_id": r, "reward": w} for r, w in zip(rollouts, rewards, strict=True)],
                },
                timeout=30,
                headers=gateway.admin,
            )
            assert answer.status_code == 201, answer.text
            assert answer.json()["state"] == "ready"


def stored_steps(gateway: GatewayProcess, model: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{gateway.base_url}/art/models/{model}", headers=gateway.admin, timeout=30)
    assert answer.status_code == 200, answer.text
    return sorted(answer.json()["steps"], key=lambda s: s["step"])


def read_run(wandb_file: Path) -> list[dict[str, Any]]:
    """The run's records, as W&B's own reader of a .wandb file prints them."""
    result = subprocess.run(
        [WANDB, "leet", "inspect", "--json", str(wandb_file)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def md5_b64(path: Path) -> str:
    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


@pytest.fixture
def gateway(tmp_path: Path) -> Any:
    stub_url, stub = start_stub()
    gateway = start_gateway(tmp_path, "--upstream", stub_url, models=tuple(GROUPS))
    yield gateway
    gateway.stop()
    stop_group(stub)


def test_an_offline_run_holds_every_step_and_adapter(
    gateway: GatewayProcess, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # W&B's own variables, inherited by the trainer: offline, and every directory of W&B's in the test's tmp.
    wandb_home = tmp_path / "wandb-home"
    for variable in ("WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        where = wandb_home / variable.removeprefix("WANDB_").lower()
        where.mkdir(parents=True)
        monkeypatch.setenv(variable, str(where))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for variable in ("WANDB_NAME", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID"):
        monkeypatch.delenv(variable, raising=False)
    record_groups(gateway)

    trainer = TrainerProcess(
        "trainer-wandb",
        gateway,
        tiny_model,
        "--wandb-project",
        PROJECT,
        "--wandb-run-name",
        RUN_NAME,
        models=tuple(GROUPS),
    )
    try:
        poll(
            lambda: {state for (state,) in query_store(gateway.db_path, "SELECT state FROM groups")} == {"trained"},
            300,
            "the trainer to train every group",
            every=0.5,
            alive=[trainer],
        )
    finally:
        code = trainer.stop()  # SIGTERM: the loop ends, then the run finishes
    assert code == 0, trainer.log()

    (run_dir,) = (wandb_home / "dir" / "wandb").glob("offline-run-*")
    (wandb_file,) = run_dir.glob("run-*.wandb")
    assert gateway.admin_key.encode() not in wandb_file.read_bytes()
    records = read_run(wandb_file)
    of_type = lambda kind: [r[kind] for r in records if r["type"] == kind]  # noqa: E731

    # ---- the run and its config
    (run,) = of_type("run")
    assert (run["project"], run["display_name"]) == (PROJECT, RUN_NAME)
    config = run["config"]["update"]
    assert config["models"] == list(GROUPS)
    assert config["wandb_project"] == PROJECT
    assert config["admin_key"] is None
    assert config["groups_per_step"] == 2 and config["base_model"] == str(tiny_model)

    # ---- each model's curves over its own steps
    metrics = of_type("metric")
    for model in GROUPS:
        assert {"name": f"{model}/step", "options": {"defined": True}} in metrics, metrics
        assert any(m.get("glob_name") == f"{model}/*" and m.get("step_metric") == f"{model}/step" for m in metrics)
    rows = [h["item"] for h in of_type("history")]
    for model, groups in GROUPS.items():
        steps = stored_steps(gateway, model)
        assert [s["step"] for s in steps] == list(range(1, groups // 2 + 1))
        logged = [
            {k.removeprefix(f"{model}/"): v for k, v in row.items() if k.startswith(f"{model}/")}
            for row in rows
            if f"{model}/step" in row
        ]
        assert [row["step"] for row in logged] == [s["step"] for s in steps]
        for row, step in zip(logged, steps, strict=True):
            stored = {k: v for k, v in step["metrics"].items() if isinstance(v, int | float)}
            assert stored.keys() >= {"loss", "reward_mean", "kl", "clip_fraction", "trainable_tokens_per_second"}
            assert {k: v for k, v in row.items() if k != "step"} == stored, step["step"]
            assert row["loss"] == step["metrics"]["loss"] and row["reward_mean"] == step["metrics"]["reward_mean"]
    assert not any(any(k.startswith("a/") for k in r) and any(k.startswith("b/") for k in r) for r in rows)

    # ---- each committed step's adapter, the checkpoint's files but the optimizer state
    artifacts = {
        (artifact["name"], int(alias.removeprefix("step-"))): artifact
        for artifact in of_type("artifact")
        for alias in artifact["aliases"]
        if alias.startswith("step-")
    }
    assert sorted(artifacts) == [
        (model, step) for model, groups in GROUPS.items() for step in range(1, groups // 2 + 1)
    ]
    assert len(of_type("artifact")) == len(artifacts)
    for (model, step), artifact in artifacts.items():
        assert artifact["type"] == "lora" and artifact["project"] == PROJECT
        checkpoint = gateway.data_dir / "checkpoints" / model / str(step)
        files = {entry["path"]: entry for entry in artifact["manifest"]["contents"]}
        expected = sorted(p.name for p in checkpoint.iterdir() if p.name != "optimizer.pt")
        assert sorted(files) == expected and "adapter_model.safetensors" in files
        assert (checkpoint / "optimizer.pt").is_file()
        for name, entry in files.items():
            assert entry["digest"] == md5_b64(checkpoint / name), name
            assert Path(entry["local_path"]).resolve() == (checkpoint / name).resolve()  # where it lies: no copy
        assert json.loads(artifact["metadata"])["step"] == step

    # ---- finished cleanly on SIGTERM
    assert [exit["exit_code"] for exit in of_type("exit")] == [0]


def test_a_run_wandb_refuses_is_one_line_before_any_step(tmp_path: Path) -> None:
    # Online without an API key: W&B says so, and `artgw train` stops with its reason on one line. Every address
    # of W&B's points at a closed port on loopback: nothing leaves the machine.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ARTGW_", "WANDB_"))}
    env = {
        **clean,
        "HOME": str(tmp_path),
        "WANDB_MODE": "online",
        "WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
    }
    data_dir = str(tmp_path / "data")
    migrate = subprocess.run([ARTGW, "migrate", "--data-dir", data_dir], env=env, capture_output=True, timeout=120)
    assert migrate.returncode == 0, migrate.stderr
    result = subprocess.run(
        [ARTGW, "train", "--data-dir", data_dir, "--base-model", "unused", "--wandb-project", PROJECT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"artgw train: W&B run in project '{PROJECT}' not started: "), result.stderr
    assert "API key" in line
    assert not (tmp_path / "data" / "checkpoints").exists()
