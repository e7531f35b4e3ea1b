"""`artgw serve --base-model M --engines 2`: the gateway starts and supervises two real vLLM engines and spreads
calls over them as over `--upstream` engines (engine/pool.py); one killed is restarted by its supervisor, and is
back in rotation holding the served step before it takes a call (gateway/adapters.py's `restore_engine` at its
restart, `prepare_engine` at the pool's probe). The supervisors' restarts without vLLM, and what each engine is
given of the machine, are tests/unit (test_engine_ownership.py, test_engine_placement.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import psutil
import pytest

from engine.placement import engine_environments, visible_gpus
from tests.conftest import GatewayProcess, is_vllm_server, make_adapter, poll, start_gateway, wait_http

pytestmark = pytest.mark.engine


def call(gateway: GatewayProcess, rollout_id: str) -> None:
    """One call of the rollout to `my-agent` (its served step), answered."""
    body = {"model": "my-agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answer = httpx.post(
        f"{gateway.base_url}/chat/completions", json=body, headers={"X-ART-Rollout-Id": rollout_id}, timeout=120
    )
    assert answer.status_code == 200, answer.text


def engines_of(gateway: GatewayProcess, rollout_id: str) -> list[str]:
    """The engine of each recorded call of the rollout, as its API says (test_engines.py checks it is the store's)."""
    answer = httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", headers=gateway.admin, timeout=60)
    assert answer.status_code == 200, answer.text
    return [c["engine"] for c in answer.json()["calls"]]


def api_server(engine_url: str) -> psutil.Process | None:
    """The vLLM API server listening at `engine_url` (the supervised child), or None while there is none."""
    port = engine_url.rsplit(":", 1)[1]
    for proc in psutil.process_iter(["cmdline"]):
        words = proc.info["cmdline"] or []
        if is_vllm_server(words) and words[words.index("--port") + 1] == port:
            return proc
    return None


def environment(engine_url: str) -> dict[str, str]:
    server = api_server(engine_url)
    assert server is not None, f"no vLLM listens at {engine_url}"
    return server.environ()


def test_two_supervised_engines_share_the_rollouts_and_one_killed_comes_back_with_the_served_step(
    tmp_path: Path, tiny_model: Path
) -> None:
    gateway = start_gateway(
        tmp_path,
        *("--base-model", str(tiny_model), "--engines", "2", "--max-model-len", "512"),
        *("--engine-health-interval", "0.5"),
        wait=False,
    )

    def engines() -> str:
        return str(httpx.get(f"{gateway.url}/readyz", timeout=10).json().get("engines"))

    try:
        wait_http(f"{gateway.url}/readyz", 600, gateway.proc)
        poll(lambda: engines().startswith("2 of 2 in rotation"), 60, "both engines in rotation", alive=[gateway.proc])
        for rollout in ("a", "a", "a", "b", "b"):  # a new rollout goes to the engine sent fewer calls
            call(gateway, rollout)
        (first,), (second,) = set(engines_of(gateway, "a")), set(engines_of(gateway, "b"))
        assert first != second and all(url.startswith("http://127.0.0.1:") for url in (first, second))
        adapter = make_adapter(tiny_model, tmp_path / "step-1", seed=1)
        committed = httpx.post(
            f"{gateway.base_url}/art/models/my-agent/adapters",
            json={"step": 1, "path": str(adapter)},
            headers=gateway.admin,
            timeout=300,
        )
        assert committed.status_code == 200 and committed.json()["served_step"] == 1, committed.text

        # Each its share of the machine (here the cores, one each), and a log of its own.
        shares = engine_environments(2, gpus=visible_gpus(), cpus=sorted(os.sched_getaffinity(0)))
        given = [{k: environment(url).get(k) for k in shares[0]} for url in (first, second)]
        assert sorted(map(str, given)) == sorted(map(str, shares))
        assert (gateway.data_dir / "engine.log").is_file() and (gateway.data_dir / "engine-1.log").is_file()

        killed = api_server(second)
        assert killed is not None, f"no vLLM listens at {second}"
        killed.send_signal(signal.SIGKILL)
        # Its supervisor starts a new one on its port; the pool takes it back once it holds the served step.
        poll(
            lambda: (new := api_server(second)) is not None and new.pid != killed.pid,
            120,
            "the killed engine to be started again",
            alive=[gateway.proc],
        )
        poll(lambda: engines().startswith("2 of 2 in rotation"), 600, "it back in rotation", alive=[gateway.proc])
        held = {m["id"] for m in httpx.get(f"{second}/v1/models", timeout=30).json()["data"]}
        assert "my-agent@1" in held, held
        # A new rollout goes to it (sent fewer calls), on the served step, which it holds: answered there (an engine
        # lacking it would answer 404 and the call would go to the other). Rollout b's next call is back there too.
        call(gateway, "c")
        call(gateway, "b")
        assert (engines_of(gateway, "c"), engines_of(gateway, "b")) == ([second], [second] * 3)
    finally:
        assert gateway.stop() == 0, gateway.log()[-5000:]
    assert api_server(first) is None and api_server(second) is None  # stopped with the gateway
