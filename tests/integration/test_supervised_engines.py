"""`artgw serve --base-model M --engines 2`: the gateway starts and supervises two real vLLM engines and spreads
calls over them as over `--upstream` engines (engine/pool.py), a rollout on one engine and one sequence, a step
published to both, a rollout whose engine died continued on the other; the dead one is restarted by its supervisor,
and is back in rotation holding the served step before it takes a call (gateway/adapters.py's `restore_engine` at its
restart, `prepare_engine` at the pool's probe). The supervisors' restarts without vLLM, and what each engine is
given of the machine, are tests/unit (test_engine_ownership.py, test_engine_placement.py)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from engine.placement import this_machines_environments
from tests.conftest import GatewayProcess, is_vllm_server, make_adapter, metric, poll, start_gateway, wait_http

pytestmark = pytest.mark.engine


def call(gateway: GatewayProcess, rollout_id: str, **extra: Any) -> dict[str, Any]:
    """One call of the rollout to `my-agent` (its served step), answered: its answer."""
    body = {"model": "my-agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    answer = httpx.post(
        f"{gateway.base_url}/chat/completions", json=body, headers={"X-ART-Rollout-Id": rollout_id}, timeout=120
    )
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


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


def held(engine_url: str) -> set[str]:
    """The models the engine lists: its base and the LoRA steps it holds."""
    return {m["id"] for m in httpx.get(f"{engine_url}/v1/models", timeout=30).json()["data"]}


def serves_step_1(engine_url: str) -> bool:
    body = {"model": "my-agent@1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    return httpx.post(f"{engine_url}/v1/chat/completions", json=body, timeout=120).status_code == 200


def environment(engine_url: str) -> dict[str, str]:
    server = api_server(engine_url)
    assert server is not None, f"no vLLM listens at {engine_url}"
    return server.environ()


def test_two_supervised_engines_keep_a_rollout_one_sequence_and_one_killed_comes_back_with_the_served_step(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A multi-call rollout's calls reach one engine, spliced there from the model's own tokens; new rollouts go to
    the other; a step committed meanwhile reaches both (each lists it and serves it) while the rollout stays on its
    first step; when its engine dies, the next call goes to the other and is spliced there (one sequence); the dead
    engine's supervisor starts it again, and it is back in rotation holding the served step before it takes a
    call."""
    gateway = start_gateway(
        tmp_path,
        *("--base-model", str(tiny_model), "--engines", "2", "--max-model-len", "512"),
        *("--engine-health-interval", "0.5"),
        wait=False,
    )

    def engines() -> str:
        return str(httpx.get(f"{gateway.url}/readyz", timeout=10).json().get("engines"))

    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count with me: one"}]

    def turn(then: str) -> None:
        answer = call(gateway, "counting", messages=messages, max_tokens=4, temperature=0)
        messages.extend([answer["choices"][0]["message"], {"role": "user", "content": then}])

    try:
        wait_http(f"{gateway.url}/readyz", 600, gateway.proc)
        poll(lambda: engines().startswith("2 of 2 in rotation"), 60, "both engines in rotation", alive=[gateway.proc])
        call(gateway, "warm")  # another rollout first: one engine
        for then in ("two", "three", "four"):  # a new rollout goes to the engine sent fewer calls: the other
            turn(then)
        (first,), (second,) = set(engines_of(gateway, "warm")), set(engines_of(gateway, "counting"))
        assert first != second and all(url.startswith("http://127.0.0.1:") for url in (first, second))
        assert len(engines_of(gateway, "counting")) == 3

        # Each its share of the machine (here the cores, one each), and a log of its own.
        shares = this_machines_environments(2)
        given = [{k: environment(url).get(k) for k in shares[0]} for url in (first, second)]
        assert sorted(map(str, given)) == sorted(map(str, shares))
        assert (gateway.data_dir / "engine.log").is_file() and (gateway.data_dir / "engine-1.log").is_file()

        adapter = make_adapter(tiny_model, tmp_path / "step-1", seed=1)
        committed = httpx.post(
            f"{gateway.base_url}/art/models/my-agent/adapters",
            json={"step": 1, "path": str(adapter)},
            headers=gateway.admin,
            timeout=300,
        )
        assert committed.status_code == 200 and committed.json()["served_step"] == 1, committed.text
        for url in (first, second):  # published to both: each lists it and serves it
            assert "my-agent@1" in held(url) and serves_step_1(url), url

        killed = api_server(second)  # the rollout's engine dies: its next call goes to the other
        assert killed is not None, f"no vLLM listens at {second}"
        killed.send_signal(signal.SIGKILL)
        turn("five")
        assert engines_of(gateway, "counting") == [second] * 3 + [first]
        rollout = httpx.get(f"{gateway.base_url}/art/rollouts/counting", headers=gateway.admin, timeout=60).json()
        assert [s["split_cause"] for s in rollout["sequences"]] == [None], rollout["sequences"]
        assert len(rollout["sequences"][0]["call_ids"]) == 4
        assert metric(gateway.url, "artgw_continued_calls_total", how="spliced") == 3

        # Its supervisor starts a new one on its port; the pool takes it back once it holds the served step.
        poll(
            lambda: (new := api_server(second)) is not None and new.pid != killed.pid,
            120,
            "the killed engine to be started again",
            alive=[gateway.proc],
        )
        poll(lambda: engines().startswith("2 of 2 in rotation"), 600, "it back in rotation", alive=[gateway.proc])
        assert "my-agent@1" in held(second) and serves_step_1(second)
    finally:
        assert gateway.stop() == 0, gateway.log()[-5000:]
    assert api_server(first) is None and api_server(second) is None  # stopped with the gateway
