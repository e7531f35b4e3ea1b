"""Faults are reported as what they are (#11): a store that is locked or down is a prompt 503
`store_unavailable` with `Retry-After` on the store-backed endpoints, while inference keeps serving, /metrics
keeps answering (with `artgw_store_up`) and /readyz reports the store in its body; a rollout answered but
not yet in the store says so; a failed adapter commit leaves nothing loaded; the engine's own 4xx are the
client's errors.

The gateway runs against the stand-in engine (tests/stub_engine.py). The SQLite store is locked the way any
other process can lock it: a connection holding `BEGIN EXCLUSIVE` (in WAL mode that blocks writers, not
readers). A store that is down is a PostgreSQL URL nothing listens on.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from litestar import Litestar, get
from litestar.testing import TestClient
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, OperationalError

from engine.pool import EnginePool
from gateway.errors import exception_handlers
from gateway.metrics import GatewayMetrics, StoreSnapshot
from gateway.services import Services
from store import create_engine
from tests.conftest import TcpProxy, free_port, metric, poll, start_stub, stop_group

CHAT: dict[str, Any] = {"model": "my-agent", "messages": [{"role": "user", "content": "hi"}]}
STORE_UNAVAILABLE = {
    "error": {
        "message": "The store is unavailable (down or locked); retry shortly.",
        "type": "server_error",
        "param": None,
        "code": "store_unavailable",
    }
}


@pytest.fixture
def stub_url() -> Iterator[str]:
    url, proc = start_stub()
    yield url
    stop_group(proc)


def chat(gateway: Any, rollout_id: str, **extra: Any) -> httpx.Response:
    headers = {"X-ART-Rollout-Id": rollout_id}
    return httpx.post(f"{gateway.base_url}/chat/completions", json={**CHAT, **extra}, headers=headers, timeout=30)


def rollout(gateway: Any, rollout_id: str, timeout: float = 60) -> httpx.Response:
    return httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", timeout=timeout, headers=gateway.admin)


def adapter_dir(tmp_path: Path) -> Path:
    path = tmp_path / "adapter-step-1"
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    return path


# ---------------------------------------------------------------- a locked SQLite store


def test_locked_store_is_a_prompt_503_while_inference_and_reads_go_on(gateway_factory, stub_url, tmp_path) -> None:
    gateway = gateway_factory("--upstream", stub_url, "--store-wait", "1")
    for rollout_id in ("before", "before-2"):
        assert chat(gateway, rollout_id).status_code == 200
        assert rollout(gateway, rollout_id).status_code == 200  # read-your-writes: waits until it is stored
    lock = sqlite3.connect(gateway.db_path, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        # A write waits out the store's busy timeout (--store-wait, 1 s here), not SQLite's own, then says what
        # happened (within the client's 12 s, else httpx raises ReadTimeout).
        rewards = [{"rollout_id": "before", "reward": 1.0}, {"rollout_id": "before-2", "reward": 0.0}]
        group = {"model": "my-agent", "group_id": "g-locked", "rollouts": rewards}
        r = httpx.post(f"{gateway.base_url}/art/groups", json=group, timeout=12, headers=gateway.admin)
        assert (r.status_code, r.json(), r.headers["retry-after"]) == (503, STORE_UNAVAILABLE, "2")

        # Inference keeps serving; its record waits for the store, and a read of it says so.
        assert chat(gateway, "during").status_code == 200
        r = rollout(gateway, "during")
        assert (r.status_code, r.json()) == (
            404,
            {
                "error": {
                    "message": "Rollout `during` is still being written to the store; retry shortly.",
                    "type": "not_found_error",
                    "param": None,
                    "code": "rollout_pending",
                }
            },
        )
        assert rollout(gateway, "before").status_code == 200  # WAL: readers are not blocked by the lock

        # /metrics and /readyz answer; reads still work, so the store is up for them.
        assert metric(gateway.url, "artgw_store_up", exported=True) == 1
        r = httpx.get(f"{gateway.url}/readyz", timeout=30)
        assert (r.status_code, r.json()) == (
            200,
            {"status": "ready", "engine": "ready", "store": "ok", "journal": "ok"},
        )

        # An adapter the engine loaded but the store could not commit is unloaded again.
        spec = {"step": 1, "path": str(adapter_dir(tmp_path))}
        r = httpx.post(f"{gateway.base_url}/art/models/my-agent/adapters", json=spec, headers=gateway.admin, timeout=60)
        assert (r.status_code, r.json()) == (503, STORE_UNAVAILABLE)
        assert httpx.get(f"{stub_url}/loras").json() == {
            "loaded": [],
            "calls": ["load my-agent@1", "unload my-agent@1"],
        }
        assert httpx.get(f"{gateway.base_url}/models").json()["data"][0]["id"] == "my-agent"
        assert "my-agent@1" not in {m["id"] for m in httpx.get(f"{gateway.base_url}/models").json()["data"]}
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    # The store is back: the call recorded meanwhile is there, and the same writes now go through.
    r = rollout(gateway, "during")
    assert r.status_code == 200 and [c["status"] for c in r.json()["calls"]] == ["ok"]
    r = httpx.post(f"{gateway.base_url}/art/groups", json=group, timeout=60, headers=gateway.admin)
    assert r.status_code == 201, r.text


def test_unknown_rollout_is_a_plain_404(gateway_factory, stub_url) -> None:
    gateway = gateway_factory("--upstream", stub_url)
    r = rollout(gateway, "never-sent")
    assert (r.status_code, r.json()) == (
        404,
        {
            "error": {
                "message": "No rollout `never-sent` has been recorded.",
                "type": "not_found_error",
                "param": None,
                "code": "rollout_not_found",
            }
        },
    )


# ---------------------------------------------------------------- the engine's own 4xx


def test_engine_4xx_passes_through_and_counts_as_a_client_error(gateway_factory, stub_url) -> None:
    gateway = gateway_factory("--upstream", stub_url)
    r = chat(gateway, "negative-temperature", temperature=-1)
    assert (r.status_code, r.json()) == (
        400,
        {
            "error": {
                "message": "temperature must be non-negative, got -1.",
                "type": "invalid_request_error",
                "param": "temperature",
                "code": None,
            }
        },
    )
    (call,) = rollout(gateway, "negative-temperature").json()["calls"]
    assert call["status"] == "client_error"
    assert metric(gateway.url, "artgw_requests_total", model="my-agent", status="client_error") == 1
    assert metric(gateway.url, "artgw_requests_total", model="my-agent", status="upstream_error") == 0


# ---------------------------------------------------------------- PostgreSQL going down and coming back


@pytest.mark.postgres
def test_postgres_down_is_a_prompt_503_metrics_and_readyz_answer_and_it_recovers(
    gateway_factory, stub_url, pg_database_url: str
) -> None:
    url = make_url(pg_database_url)
    proxy = TcpProxy((url.host or "127.0.0.1", url.port or 5432))
    proxy.up()
    db = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    gateway = gateway_factory("--upstream", stub_url, "--db", db)
    try:
        assert chat(gateway, "pg-before").status_code == 200
        assert rollout(gateway, "pg-before").status_code == 200
        proxy.down()
        # Prompt: each answer within the client's 5 s (else httpx raises ReadTimeout), not a hang.
        r = rollout(gateway, "pg-before", timeout=5)
        assert r.status_code == 503, r.text
        assert (r.json(), r.headers["retry-after"]) == (STORE_UNAVAILABLE, "2")
        r = httpx.get(f"{gateway.base_url}/art/groups", timeout=5, headers=gateway.admin)
        assert (r.status_code, r.json()) == (503, STORE_UNAVAILABLE)
        assert metric(gateway.url, "artgw_store_up", exported=True) == 0
        r = httpx.get(f"{gateway.url}/readyz", timeout=30)
        assert (r.status_code, r.json()) == (
            200,
            {"status": "ready", "engine": "ready", "store": "unavailable", "journal": "ok"},
        )
        assert chat(gateway, "pg-during").status_code == 200  # inference keeps serving
    finally:
        proxy.up()
    poll(lambda: rollout(gateway, "pg-during").status_code == 200, 60, "the call recorded while PostgreSQL was down")
    assert metric(gateway.url, "artgw_store_up") == 1


# ---------------------------------------------------------------- a store that is down (in process)


def _down_store_url() -> str:
    return f"postgresql+asyncpg://artgw@127.0.0.1:{free_port()}/artgw"  # nothing listens there


async def test_metrics_answer_with_the_last_figures_and_store_up_0_when_the_store_is_down(tmp_path) -> None:
    metrics = GatewayMetrics()
    recorder = SimpleNamespace(depth=lambda: 3, written=7, retries=1, spilled=0)
    up = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'none.sqlite'}")  # no schema: reads fail too
    down = create_engine(_down_store_url())
    try:
        metrics._snapshot = StoreSnapshot(groups={("my-agent", "ready"): 2})
        # Prompt: within 5 s (else wait_for raises TimeoutError), not the driver's connect retries.
        text = (await asyncio.wait_for(metrics.scrape(down, recorder, {"my-agent": (0, 0)}), 5)).decode()
        assert "artgw_store_up 0.0" in text
        assert 'artgw_groups{model="my-agent",state="ready"} 2.0' in text  # the last good figures
        assert "artgw_recorder_queue_depth 3.0" in text  # what needs no store is current
        await metrics.scrape(up, recorder, {})
        assert "artgw_store_up 0.0" in metrics.render().decode()
    finally:
        await up.dispose()
        await down.dispose()


async def test_readyz_reports_the_store_and_stays_with_the_engine() -> None:
    engine = create_engine(_down_store_url())
    services = object.__new__(Services)  # only what readiness reads
    services.engine = SimpleNamespace(state="starting")  # type: ignore[assignment]
    services.engines = EnginePool(["http://127.0.0.1:1"], saturation=1)
    services.store = SimpleNamespace(engine=engine)  # type: ignore[assignment]
    services.recorder = SimpleNamespace(journal_failure=None)  # type: ignore[assignment]
    try:
        assert await services.readiness() == (
            False,
            {"status": "not ready", "engine": "starting", "store": "unavailable", "journal": "ok"},
        )
    finally:
        await engine.dispose()


def test_store_errors_map_to_503_with_retry_after_and_bugs_to_500() -> None:
    @get("/locked")
    async def locked() -> None:
        raise OperationalError("INSERT ...", {}, sqlite3.OperationalError("database is locked"))

    @get("/refused")
    async def refused() -> None:
        async with create_engine(_down_store_url()).connect():
            pass

    @get("/bug")
    async def bug() -> None:
        raise IntegrityError("INSERT ...", {}, sqlite3.IntegrityError("UNIQUE constraint failed"))

    app = Litestar([locked, refused, bug], exception_handlers=exception_handlers)  # type: ignore[arg-type]
    with TestClient(app) as client:
        for path in ("/locked", "/refused"):
            r = client.get(path)
            assert (r.status_code, r.json(), r.headers["retry-after"]) == (503, STORE_UNAVAILABLE, "2")
        r = client.get("/bug")
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
