"""What the trainer tests check of a gateway after training: each group trained exactly once by a committed step of
its own, the store and the disk agreeing (test_trainer_crash, test_trainer_distributed, test_trainer_models); and
waiting for a round of groups to be trained and served (test_trainer_e2e, test_real_model)."""

from __future__ import annotations

import json
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import GatewayProcess, poll, poll_quietly, process_waits, query_store

MODEL = "my-agent"


def status(gateway: GatewayProcess, model: str = MODEL) -> dict[str, Any]:
    answer = httpx.get(f"{gateway.base_url}/art/models/{model}", headers=gateway.admin, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def group_states(gateway: GatewayProcess) -> dict[str, str]:
    return dict(query_store(gateway.db_path, "SELECT id, state FROM groups WHERE model = ?", MODEL))


def checkpoint(gateway: GatewayProcess, step: int, model: str = MODEL) -> Path:
    return gateway.data_dir / "checkpoints" / model / str(step)


def assert_exactly_once(gateway: GatewayProcess, group_ids: list[str], model: str = MODEL) -> list[dict[str, Any]]:
    """Every group of `model` trained by exactly one committed step of its own; steps 1..k; step k served; disk
    matches the store. Returns the steps."""
    seen = status(gateway, model)
    assert seen["groups"] == {"trained": len(group_ids)}, seen["groups"]
    steps = sorted(seen["steps"], key=lambda s: s["step"])
    assert all(s["status"] in ("loaded", "unloaded") for s in steps), steps  # nothing failed, nothing pending
    numbers = [s["step"] for s in steps]
    assert numbers == list(range(1, len(steps) + 1)), numbers
    assert seen["served_step"] == len(steps) == max(seen["loaded_steps"])
    assert len(steps) >= len(group_ids) // 2  # 2 groups per step at most

    # The union of the committed steps' groups is every group of the model, none in two steps.
    counted = Counter(g for s in steps for g in s["metrics"]["group_ids"])
    assert set(counted) == set(group_ids) and set(counted.values()) == {1}, counted
    for s in steps:
        assert s["group_count"] == len(s["metrics"]["group_ids"]) >= 1

    # The store says the same, group by group, and holds no lease any more.
    db = gateway.db_path
    by_step = {g: s["step"] for s in steps for g in s["metrics"]["group_ids"]}
    rows = query_store(db, "SELECT id, state, trained_step, lease_owner FROM groups WHERE model = ?", model)
    assert sorted(rows) == sorted((g, "trained", by_step[g], None) for g in group_ids)
    stored = query_store(
        db, "SELECT step, status, group_count, metrics FROM adapters WHERE model = ? ORDER BY step", model
    )
    assert [(n, st, c) for n, st, c, _ in stored] == [(s["step"], s["status"], s["group_count"]) for s in steps]
    assert [json.loads(m)["group_ids"] for *_, m in stored] == [s["metrics"]["group_ids"] for s in steps]

    # On disk: exactly the committed steps, each the checkpoint of the groups its step committed.
    root = gateway.data_dir / "checkpoints" / model
    assert sorted(p.name for p in root.iterdir()) == sorted(str(n) for n in numbers)  # no stray or .tmp dirs
    for s in steps:
        saved = json.loads((checkpoint(gateway, s["step"], model) / "step.json").read_text())
        assert (saved["model"], saved["step"]) == (model, s["step"])
        assert saved["metrics"]["group_ids"] == s["metrics"]["group_ids"]

    # And the model is served by its newest step.
    answer = httpx.post(
        f"{gateway.base_url}/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers=gateway.admin,
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return steps


def wait_trained(gateway: GatewayProcess, group_ids: list[str], trainer: subprocess.Popen[bytes]) -> int:
    """Wait until the trainer consumed the groups and the gateway serves the step that trained them."""
    states: list[str] = []

    def trained_and_served() -> tuple[int] | None:
        # Asked before the reads: the trainer exits by itself after its last step (--max-steps), and what a
        # trainer that had already exited left in the store is final; asked after, it could exit in between.
        exited = trainer.poll()
        groups = [
            httpx.get(f"{gateway.base_url}/art/groups/{g}", timeout=10, headers=gateway.admin).json() for g in group_ids
        ]
        states[:] = [g["state"] for g in groups]
        if all(state == "trained" for state in states):
            served = status(gateway)["served_step"]
            if served >= max(g["trained_step"] for g in groups):
                return (int(served),)
        assert exited is None, f"the trainer exited ({exited}) before training the groups"
        return None

    try:
        (served,) = poll(trained_and_served, 300, "the groups to be trained and their step served", every=0.3)
    except AssertionError as exc:
        if trainer.poll() is None:
            # where each thread waits in the kernel (and its native stack), then every thread's Python stack into
            # its log (importing the `artgw` package registers faulthandler on SIGUSR1, before any dependency)
            kernel = process_waits(trainer.pid)
            trainer.send_signal(signal.SIGUSR1)
            log = gateway.data_dir / "trainer.log"
            if not poll_quietly(lambda: "most recent call first" in log.read_text(errors="replace"), 10):
                # Ended by the signal (-10): it was not yet running Python (the handler comes with the package).
                # Alive: the signal was never acted on (blocked, or a thread looping in the kernel: see its stack).
                fate = trainer.poll()
                after = "alive" if fate is None else f"ended ({fate})"
                raise AssertionError(
                    f"{exc}; group states {states}; no stack dump, the trainer {after} after SIGUSR1; "
                    f"its threads before it: {kernel}; after: {process_waits(trainer.pid) if fate is None else '-'}"
                ) from None
            raise AssertionError(f"{exc}; group states {states}; the trainer's threads: {kernel}") from None
        raise AssertionError(f"{exc}; group states {states}") from None
    return served
