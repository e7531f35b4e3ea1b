"""`artgw serve --base-model`: the gateway starts, watches, restarts and stops its own vLLM."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import psutil
import pytest

from tests.conftest import free_port, poll, wait_http

pytestmark = pytest.mark.engine


def engine_processes(port: int) -> list[psutil.Process]:
    """Every process of the engine on `port`: the API server and its engine-core children."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "vllm.entrypoints.openai.api_server" in cmdline and f"--port {port}" in cmdline:
            found.append(proc)
            try:
                found.extend(proc.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
    return found


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def test_supervised_engine_lifecycle(tiny_model, gateway_factory) -> None:
    engine_port = free_port()
    started = time.monotonic()
    gateway = gateway_factory("--base-model", str(tiny_model), "--engine-port", str(engine_port), wait=False)
    wait_http(f"{gateway.url}/readyz", 600, gateway.proc)
    ready_seconds = time.monotonic() - started
    print(f"artgw serve → ready in {ready_seconds:.1f}s")
    ready = r"ART Gateway ready: base_url=http://127\.0\.0\.1:\d+/v1\s+models=my-agent\s+auth=off"
    assert re.search(ready, gateway.log())

    # A generous timeout: a fresh vLLM's first generation, with another engine busy on these 2 cores, has
    # taken over httpx's default 5 s (this test asserts what happens, not how fast).
    r = httpx.post(
        f"{gateway.base_url}/chat/completions",
        json={"model": "my-agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=120,
    )
    assert r.status_code == 200

    gw = psutil.Process(gateway.proc.pid)
    engine = engine_processes(engine_port)
    assert engine, "no engine process found"
    print(
        f"RSS gateway {gw.memory_info().rss / 2**20:.0f} MiB, "
        f"engine {sum(p.memory_info().rss for p in engine) / 2**20:.0f} MiB"
    )

    # The engine dies: the gateway answers 503 while it restarts it, then serves again.
    engine[0].send_signal(signal.SIGKILL)
    poll(lambda: httpx.get(f"{gateway.url}/readyz").json()["engine"] == "restarting", 20, "the engine to be restarting")
    wait_http(f"{gateway.url}/readyz", 600, gateway.proc)
    assert (
        httpx.post(
            f"{gateway.base_url}/chat/completions",
            json={"model": "my-agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=120,
        ).status_code
        == 200
    )

    # SIGTERM: the gateway stops the engine and exits cleanly, leaving no process behind.
    engine = engine_processes(engine_port)
    assert engine
    gateway.proc.send_signal(signal.SIGTERM)
    assert gateway.proc.wait(60) == 0
    assert not wait_gone(engine, 30)


def test_gateway_killed_outright_leaves_no_engine_behind(tiny_model, gateway_factory) -> None:
    engine_port = free_port()
    gateway = gateway_factory("--base-model", str(tiny_model), "--engine-port", str(engine_port), wait=False)
    wait_http(f"{gateway.url}/readyz", 600, gateway.proc)
    engine = engine_processes(engine_port)
    assert engine
    os.kill(gateway.proc.pid, signal.SIGKILL)  # no chance to clean up: the kernel's parent-death signal must
    assert not wait_gone(engine, 60)
