"""`artgw serve --base-model M --engines 2`: the gateway starts and supervises two real vLLM engines and spreads
calls over them as over `--upstream` engines (engine/pool.py), a rollout on one engine and one sequence, a step
published to both, a rollout whose engine died continued on the other; the dead one is restarted by its supervisor,
and is back in rotation holding the served step before it takes a call (gateway/adapters.py's `restore_engine` at its
restart, `prepare_engine` at the pool's probe). The supervisors' restarts without vLLM, and what each engine is
given of the machine, are tests/unit (test_engine_ownership.py, test_engine_placement.py).

Beside it, started at the same moment, a second supervised gateway with one engine of another model: neither passes
`--engine-port`, and each engine gets a port of its own, serves and records its own gateway's model, never the
other's; a third gateway pointed at a taken engine port is a clear error at once, never a silent share of another
gateway's engine. Then each ends as a gateway can: the second giving up on an engine that died
(`--engine-max-restarts 0`: it says why and exits 1, its engine's tree ended), the first killed outright (SIGKILL:
its engines, the restarted one too, die with it, by the kernel's parent-death signal). A SIGTERM's clean stop is
test_engine_restart's (and the supervisors' stop of several engines tests/unit's). One test, so that the engines
the cases share start once (each vLLM start here is ~20 s of CPU)."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from engine.placement import this_machines_environments
from tests.conftest import (
    ARTGW,
    GatewayProcess,
    free_port,
    is_vllm_server,
    make_adapter,
    metric,
    poll,
    start_gateway,
    stop_group,
    wait_http,
)

pytestmark = pytest.mark.engine

IN_USE = "is already in use (another vLLM or gateway?): pass another --engine-port, or 0 for a free one"


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


def tree(pid: int) -> list[psutil.Process]:
    """The process and its descendants; empty once it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def engine_ports_of(gateway: GatewayProcess) -> set[int]:
    """The ports of the vLLM servers in the gateway's process tree (their `--port`); vLLM's engine core listens on
    other ports of its own, so the listeners alone do not say which one serves HTTP."""
    ports = set()
    for proc in tree(gateway.proc.pid):
        try:
            command = proc.cmdline()
        except psutil.NoSuchProcess:
            continue
        if is_vllm_server(command):
            ports.add(int(command[command.index("--port") + 1]))
    return ports


def listeners(port: int) -> set[int | None]:
    return {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def listed(gateway: GatewayProcess) -> set[str]:
    return {m["id"] for m in httpx.get(f"{gateway.base_url}/models", timeout=10).json()["data"]}


def rollout(gateway: GatewayProcess, rollout_id: str) -> dict[str, Any] | None:
    answer = httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", timeout=30, headers=gateway.admin)
    return answer.json() if answer.status_code == 200 else None


def serve_fails_at_once(tmp_path: Path, base_model: Path, engine_port: int) -> str:
    """Run `artgw serve` on a taken engine port: it must exit non-zero without starting vLLM; returns its output."""
    data_dir = tmp_path / f"refused-{engine_port}"
    command = [ARTGW, "serve", "--port", str(free_port()), "--data-dir", str(data_dir), "--model-name", "agent-x"]
    command += ["--base-model", str(base_model), "--engine-port", str(engine_port)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=90)
    finally:
        stop_group(proc)
    text = output.decode(errors="replace")
    assert proc.returncode != 0, text
    assert f"engine port {engine_port} on 127.0.0.1 {IN_USE}" in text, text
    assert not (data_dir / "engine.log").exists(), "it spawned an engine"
    return text


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def test_two_supervised_engines_keep_a_rollout_one_sequence_and_one_killed_comes_back_with_the_served_step(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Gateway A (`--engines 2`) and gateway B (one engine, another model, `--engine-max-restarts 0`) start at once
    on default engine ports: each engine on a port of its own, serving and recording its own gateway's model; a
    third gateway on A's engine port is refused. B's engine dies: B gives up (exit 1, nothing left).

    On A, a multi-call rollout's calls reach one engine, spliced there from the model's own tokens; new rollouts go
    to the other; a step committed meanwhile reaches both (each lists it and serves it) while the rollout stays on
    its first step; when its engine dies, the next call goes to the other and is spliced there (one sequence); the
    dead engine's supervisor starts it again, and it is back in rotation holding the served step before it takes a
    call. A is then killed outright: its engines die with it."""
    model_b = tmp_path / "models" / "tiny-b"  # the served base name is the model dir's name
    shutil.copytree(tiny_model, model_b)
    starts = {
        "a": (tmp_path / "a", "--base-model", str(tiny_model), "--engines", "2", "--max-model-len", "512"),
        "b": (tmp_path / "b", "--base-model", str(model_b), "--model-name", "agent-b", "--engine-max-restarts", "0"),
    }
    gateways: dict[str, GatewayProcess] = {}

    def start(key: str) -> None:  # both at the same time, neither with --engine-port
        directory, *args = starts[key]
        gateways[key] = start_gateway(Path(directory), *args, "--engine-health-interval", "0.5", wait=False)

    threads = [threading.Thread(target=start, args=(key,)) for key in starts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(gateways) == set(starts)
    gateway, other = gateways["a"], gateways["b"]

    def engines() -> str:
        return str(httpx.get(f"{gateway.url}/readyz", timeout=10).json().get("engines"))

    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count with me: one"}]

    def turn(then: str) -> None:
        answer = call(gateway, "counting", messages=messages, max_tokens=4, temperature=0)
        messages.extend([answer["choices"][0]["message"], {"role": "user", "content": then}])

    processes: list[psutil.Process] = []
    try:
        for each in gateways.values():
            try:
                wait_http(f"{each.url}/readyz", 600, each.proc)
            except Exception:
                print(each.log()[-5000:])
                raise
        poll(lambda: engines().startswith("2 of 2 in rotation"), 60, "both engines in rotation", alive=[gateway.proc])
        # what `serve` prints once it serves
        ready = r"ART Gateway ready: base_url=http://127\.0\.0\.1:\d+/v1\s+models=agent-b,my-agent\s+auth=off"
        assert re.search(ready, other.log()), other.log()[-3000:]

        # Three engines, three ports; each engine's listener a descendant of its own gateway, nothing else there;
        # each engine serves its own gateway's base model, and each gateway lists only its own.
        ports = {key: engine_ports_of(each) for key, each in gateways.items()}
        assert len(ports["a"]) == 2 and len(ports["b"]) == 1 and not ports["a"] & ports["b"], ports
        bases = {"a": tiny_model.name, "b": model_b.name}
        for key, each in gateways.items():
            processes += tree(each.proc.pid)
            own = {p.pid for p in tree(each.proc.pid)}
            for port in ports[key]:
                assert listeners(port) and listeners(port) <= own, (key, port, own)
                assert held(f"http://127.0.0.1:{port}") == {bases[key]}
        assert {"my-agent", bases["a"]} <= listed(gateway) and not listed(gateway) & {"agent-b", bases["b"]}
        assert {"my-agent", "agent-b", bases["b"]} <= listed(other) and bases["a"] not in listed(other)

        # Each records its own calls, and only its own: the other has no such rollout.
        call(gateway, "warm")  # another rollout first: one engine
        rollout_b = f"ports-b-{uuid.uuid4().hex[:8]}"
        answer = httpx.post(
            f"{other.base_url}/chat/completions",
            json={"model": "agent-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            headers={"X-ART-Rollout-Id": rollout_b},
            timeout=120,
        )
        assert answer.status_code == 200 and answer.headers["X-ART-Rollout-Id"] == rollout_b, answer.text
        record = poll(lambda: rollout(other, rollout_b), 30, f"the record of {rollout_b}")
        assert record["model"] == "agent-b" and [c["status"] for c in record["calls"]] == ["ok"]
        assert len(record["sequences"]) == 1 and sum(record["sequences"][0]["sampled_mask"]) >= 1
        assert rollout(gateway, rollout_b) is None
        assert poll(lambda: rollout(gateway, "warm"), 30, "the record of warm") and rollout(other, "warm") is None

        # A third gateway pointed at one of A's engine ports is refused at once, before it starts vLLM, and
        # disturbs nobody.
        serve_fails_at_once(tmp_path, model_b, min(ports["a"]))
        for each in gateways.values():
            assert httpx.get(f"{each.url}/readyz", timeout=5).status_code == 200

        # B's engine dies, and B may not restart it (--engine-max-restarts 0): it says why and exits 1, leaving
        # nothing behind.
        stopped = tree(other.proc.pid)
        (server,) = [p for p in stopped if is_vllm_server(_cmdline(p))]
        server.send_signal(signal.SIGKILL)
        assert other.proc.wait(120) == 1, other.log()[-3000:]
        assert "it was restarted 0 times in 600s; giving up" in other.log(), other.log()[-3000:]
        _, alive = psutil.wait_procs(stopped, timeout=60)
        assert not alive, f"left behind by the gateway that gave up: {alive}"

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
        sequences = httpx.get(f"{gateway.base_url}/art/rollouts/counting", headers=gateway.admin, timeout=60).json()
        assert [s["split_cause"] for s in sequences["sequences"]] == [None], sequences["sequences"]
        assert len(sequences["sequences"][0]["call_ids"]) == 4
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

        # A is killed outright, with no chance to clean up: its engines, the restarted one too, must not outlive it.
        engine = [p for p in tree(gateway.proc.pid) if p.pid != gateway.proc.pid]
        processes += [p for p in engine if p not in processes]
        assert len([p for p in engine if is_vllm_server(_cmdline(p))]) == 2, engine
        gateway.proc.send_signal(signal.SIGKILL)
        gateway.proc.wait(30)
        _, alive = psutil.wait_procs(engine, timeout=60)
        assert not alive, f"left behind by the killed gateway: {alive}"
    finally:
        for each in gateways.values():
            processes += [p for p in tree(each.proc.pid) if p not in processes]
            each.stop()
    _, alive = psutil.wait_procs(processes, timeout=60)
    assert not alive, f"left behind: {alive}"
    assert api_server(first) is None and api_server(second) is None


def test_a_taken_engine_port_is_a_clear_error_at_once(tiny_model: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        serve_fails_at_once(tmp_path, tiny_model, taken.getsockname()[1])
