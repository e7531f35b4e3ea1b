"""Two supervised gateways (`artgw serve --base-model`) on one machine: each starts vLLM on an engine port of its
own, serves and records its own model, and a taken engine port is a clear error at once, never a silent share of
another gateway's engine. Then each ends as a gateway can: one giving up on an engine that died
(`--engine-max-restarts 0`: it says why and exits 1, its engine's tree ended), one killed outright (SIGKILL: its
engine dies with it, by the kernel's parent-death signal). Killing the engine under a gateway, and its restart,
is test_engine_restart's."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import ARTGW, GatewayProcess, free_port, is_vllm_server, poll, start_gateway, stop_group, wait_http

pytestmark = pytest.mark.engine

IN_USE = "is already in use (another vLLM or gateway?): pass another --engine-port, or 0 for a free one"


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def engine_port_of(gateway: GatewayProcess) -> int:
    """The port of the vLLM server in the gateway's process tree (its `--port`); vLLM's engine core listens on
    other ports of its own, so the listeners alone do not say which one serves HTTP."""
    ports = set()
    for proc in tree(gateway.proc.pid):
        try:
            command = proc.cmdline()
        except psutil.NoSuchProcess:
            continue
        if is_vllm_server(command):
            ports.add(int(command[command.index("--port") + 1]))
    assert len(ports) == 1, f"expected one vLLM server under the gateway, found ports {ports}"
    return ports.pop()


def listeners(port: int) -> set[int | None]:
    return {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


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


def test_two_gateways_with_default_engine_ports_each_serve_and_record_their_own_model(
    tiny_model: Path, tmp_path: Path
) -> None:
    names = {"a": "tiny-a", "b": "tiny-b"}  # the served base name is the model dir's name
    models = {}
    for key, name in names.items():
        models[key] = tmp_path / "models" / name
        shutil.copytree(tiny_model, models[key])

    # Both at the same time, neither with --engine-port.
    gateways: dict[str, GatewayProcess] = {}

    def start(key: str) -> None:
        limit = ("--engine-max-restarts", "0") if key == "a" else ()  # A gives up on its engine's first death
        gateways[key] = start_gateway(
            tmp_path / key, "--base-model", str(models[key]), "--model-name", f"agent-{key}", *limit, wait=False
        )

    threads = [threading.Thread(target=start, args=(key,)) for key in names]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(gateways) == set(names)
    processes: list[psutil.Process] = []
    try:
        for gateway in gateways.values():
            try:
                wait_http(f"{gateway.url}/readyz", 600, gateway.proc)
            except Exception:
                print(gateway.log()[-5000:])
                raise
        print(f"both gateways ready in {time.monotonic() - started:.1f}s")
        for key, gateway in gateways.items():  # what `serve` prints once it serves
            ready = rf"ART Gateway ready: base_url=http://127\.0\.0\.1:\d+/v1\s+models=agent-{key},my-agent\s+auth=off"
            assert re.search(ready, gateway.log()), gateway.log()[-3000:]

        engine_ports = {key: engine_port_of(g) for key, g in gateways.items()}
        assert engine_ports["a"] != engine_ports["b"]
        for key, gateway in gateways.items():
            processes += tree(gateway.proc.pid)
            own = {p.pid for p in tree(gateway.proc.pid)}
            # The engine's listener is a descendant of this gateway, and nothing else listens there.
            assert listeners(engine_ports[key]) and listeners(engine_ports[key]) <= own, (key, own)
            # The engine itself serves this gateway's base model, and the gateway lists it.
            engine_models = httpx.get(f"http://127.0.0.1:{engine_ports[key]}/v1/models", timeout=10).json()
            assert [m["id"] for m in engine_models["data"]] == [names[key]]
            listed = {m["id"] for m in httpx.get(f"{gateway.base_url}/models", timeout=10).json()["data"]}
            assert {f"agent-{key}", names[key]} <= listed
            other = "b" if key == "a" else "a"
            assert not listed & {f"agent-{other}", names[other]}

        for key, gateway in gateways.items():
            rollout_id = f"ports-{key}-{uuid.uuid4().hex[:8]}"
            answer = httpx.post(
                f"{gateway.base_url}/chat/completions",
                json={"model": f"agent-{key}", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                headers={"X-ART-Rollout-Id": rollout_id},
                timeout=120,
            )
            assert answer.status_code == 200, answer.text
            assert answer.headers["X-ART-Rollout-Id"] == rollout_id
            record = poll(
                lambda g=gateway, r=rollout_id: _rollout(g, r), 30, f"the record of {rollout_id} on gateway {key}"
            )
            assert record["model"] == f"agent-{key}"
            assert [c["status"] for c in record["calls"]] == ["ok"]
            assert len(record["sequences"]) == 1 and sum(record["sequences"][0]["sampled_mask"]) >= 1
            # Recorded only where it was served: the other gateway has no such rollout.
            elsewhere = gateways["b" if key == "a" else "a"]
            assert (
                httpx.get(
                    f"{elsewhere.base_url}/art/rollouts/{rollout_id}", timeout=30, headers=elsewhere.admin
                ).status_code
                == 404
            )

        # A third gateway pointed at gateway A's engine port is refused at once, before it starts vLLM.
        serve_fails_at_once(tmp_path, models["b"], engine_ports["a"])
        for gateway in gateways.values():  # and disturbed nobody
            assert httpx.get(f"{gateway.url}/readyz", timeout=5).status_code == 200

        # A's engine dies, and A may not restart it (--engine-max-restarts 0): it says why and exits 1, leaving
        # nothing behind (a SIGTERM's clean exit 0 is test_engine_restart's).
        a = gateways["a"]
        stopped = _tree_or_empty(a.proc.pid)
        (server,) = [p for p in stopped if is_vllm_server(_cmdline(p))]
        server.send_signal(signal.SIGKILL)
        assert a.proc.wait(120) == 1, a.log()[-3000:]
        assert "it was restarted 0 times in 600s; giving up" in a.log(), a.log()[-3000:]
        _, alive = psutil.wait_procs(stopped, timeout=60)
        assert not alive, f"left behind by the gateway that gave up: {alive}"
        # B is killed outright, with no chance to clean up: its engine must not outlive it.
        engine = [p for p in _tree_or_empty(gateways["b"].proc.pid) if p.pid != gateways["b"].proc.pid]
        assert engine, "no engine under gateway B"
        gateways["b"].proc.send_signal(signal.SIGKILL)
        gateways["b"].proc.wait(30)
        _, alive = psutil.wait_procs(engine, timeout=60)
        assert not alive, f"left behind by the killed gateway: {alive}"
    finally:
        for gateway in gateways.values():
            processes += [p for p in _tree_or_empty(gateway.proc.pid) if p not in processes]
            gateway.stop()
    _, alive = psutil.wait_procs(processes, timeout=60)
    assert not alive, f"left behind: {alive}"


def test_a_taken_engine_port_is_a_clear_error_at_once(tiny_model: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        serve_fails_at_once(tmp_path, tiny_model, taken.getsockname()[1])


def _rollout(gateway: GatewayProcess, rollout_id: str) -> dict | None:
    answer = httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", timeout=30, headers=gateway.admin)
    return answer.json() if answer.status_code == 200 else None


def _tree_or_empty(pid: int) -> list[psutil.Process]:
    try:
        return tree(pid)
    except psutil.NoSuchProcess:
        return []


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""
