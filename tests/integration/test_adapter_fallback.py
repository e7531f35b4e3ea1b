"""A served step whose checkpoint no longer loads never takes its model offline (#24).

`artgw serve` in front of the stand-in engine, steps 1 and 2 of `my-agent` loaded as a trainer commits them
(real safetensors files), then step 2's weights cut short and the gateway restarted on its data dir: step 2 is
marked broken (its status in the store, a `load_failed` event saying why, `artgw_adapter_broken_steps`), and
`my-agent` serves step 1, the newest promoted step that loads. A damaged adapter is refused when it is
committed, and a broken step cannot be promoted.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.conftest import metric
from tests.load_helpers import Gateway

MODEL = "my-agent"


def adapter(root: Path, step: int) -> Path:
    # torch (~1.5 s of CPU) when a test makes an adapter, not at collection by every worker
    import torch
    from safetensors.torch import save_file

    path = root / f"step-{step}"
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    save_file({"base_model.model.lora_A.weight": torch.full((8, 64), float(step))}, path / "adapter_model.safetensors")
    return path


def cut_short(path: Path) -> None:
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def load(gateway: Gateway, step: int, path: Path) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/art/models/{MODEL}/adapters",
        json={"step": step, "path": str(path)},
        headers=gateway.admin,
        timeout=60,
    )


def status(gateway: Gateway) -> dict:
    return httpx.get(f"{gateway.url}/v1/art/models/{MODEL}", headers=gateway.admin, timeout=30).json()


def test_a_broken_served_step_falls_back_to_the_one_before(tmp_path: Path, upstream: str) -> None:
    gateway = Gateway(tmp_path / "data", upstream, log_path=tmp_path / "gateway.log")
    steps = {step: adapter(tmp_path / "checkpoints", step) for step in (1, 2, 3)}
    try:
        gateway.start()
        for step in (1, 2):
            assert load(gateway, step, steps[step]).status_code == 200
        assert status(gateway)["served_step"] == 2

        # A damaged adapter is refused when it is committed: the engine never sees it.
        cut_short(steps[3])
        refused = load(gateway, 3, steps[3])
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "path", refused.text
        assert "is cut short" in refused.json()["error"]["message"]

        # Step 2, served, is damaged on disk; the gateway restarts (as after an engine restart, it loads again).
        cut_short(steps[2])
        gateway.stop()
        gateway.start()
        now = status(gateway)
        assert (now["served_step"], now["latest_step"], now["loaded_steps"]) == (1, 2, [1]), now
        (row,) = [s for s in now["steps"] if s["step"] == 2]
        assert row["status"] == "broken"
        event = next(e for e in now["adapter_events"] if e["step"] == 2)
        assert event["event"] == "load_failed" and "adapter_model.safetensors is cut short" in event["detail"]
        assert metric(gateway.url, "artgw_adapter_broken_steps", exported=True, model=MODEL) == 1
        assert metric(gateway.url, "artgw_adapter_step", model=MODEL) == 1

        # `my-agent` answers, from step 1; `my-agent@2` is a model that does not exist, in the gateway's words.
        answer = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-ART-Rollout-Id": "after-the-fall"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        recorded = httpx.get(f"{gateway.url}/v1/art/rollouts/after-the-fall", timeout=30, headers=gateway.admin).json()
        assert [c["step"] for c in recorded["calls"]] == [1]
        pinned = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={"model": f"{MODEL}@2", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert pinned.status_code == 404 and pinned.json()["error"]["code"] == "model_not_found", pinned.text
        # A broken step cannot be promoted.
        promoted = httpx.post(
            f"{gateway.url}/v1/art/models/{MODEL}/promote",
            json={"step": 2, "reason": "try"},
            headers=gateway.admin,
            timeout=30,
        )
        assert promoted.status_code == 409 and promoted.json()["error"]["code"] == "adapter_broken", promoted.text
    finally:
        gateway.stop()
