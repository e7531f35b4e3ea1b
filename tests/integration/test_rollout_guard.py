"""The rollouts' guard off the answer's path (#44): the first call of a rollout this gateway has not seen goes to
the engine while the store says whose the rollout is, and the guard stays exact: a call of another model naming a
taken rollout id is refused (409 `rollout_id_taken`, nothing recorded), also when another replica on the same
store took it, and of two first calls of two models racing for one new id, exactly one is answered.

PostgreSQL stores behind a TCP relay (tests/conftest.py `TcpProxy`) that can hold the store's answers, and the
stand-in engine (tests/stub_engine.py), which counts the inference requests it received.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from gateway.settings import Settings
from store.calls import stray_rollout_id
from tests.conftest import GatewayProcess, TcpProxy, poll, start_stub, started_together, stop_group
from tests.inprocess import InProcessGateway, ManualClock, serve_in_process
from tests.key_helpers import USER, serve

pytestmark = [pytest.mark.postgres]

ROLLOUT = "X-ART-Rollout-Id"


@pytest.fixture
def stub_url() -> Iterator[str]:
    url, proc = start_stub()
    yield url
    stop_group(proc)


def engine_requests(stub_url: str) -> int:
    return int(httpx.get(f"{stub_url}/stats", timeout=10).json().get("requests", 0))


def chat(base_url: str, rollout_id: str, model: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": model, "messages": USER, "max_tokens": 4}
    return httpx.post(
        f"{base_url}/chat/completions", json=body, headers={ROLLOUT: rollout_id, **(headers or {})}, timeout=60
    )


def test_a_new_rollouts_first_call_reaches_the_engine_while_the_store_is_still_answering(
    stub_url: str, pg_database_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the first call of a rollout id the gateway had not seen waited for the store's answer (whose
    rollout it is) before the engine saw it: with the store holding its answer, the engine got the call only
    once the look-up had given up (`model unknown`). Now the engine works on it while the store answers, and
    the answer goes out once the store has said the rollout is free. The look-up's time-out runs on the test's
    clock, which stands still: the store's answer is what ends the wait."""
    url = make_url(pg_database_url)
    proxy = TcpProxy((url.host or "127.0.0.1", url.port or 5432))
    proxy.up()
    db = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    settings = Settings(upstream=(stub_url,), data_dir=tmp_path / "data", auth="off", db=db)
    rollout_id = f"fresh-{uuid.uuid4().hex[:8]}"
    try:
        with serve_in_process(settings, ManualClock()) as gateway, ThreadPoolExecutor(1) as pool:
            assert chat(gateway.base_url, "warm-up", "my-agent").status_code == 200
            before = engine_requests(stub_url)
            caplog.set_level(logging.WARNING, "artgw.gateway")
            proxy.pause()
            try:
                answer = pool.submit(chat, gateway.base_url, rollout_id, "my-agent")
                poll(lambda: engine_requests(stub_url) > before, 30, "the engine to get the call")
                assert not answer.done()  # its answer waits for the store's word
            finally:
                proxy.resume()
            assert answer.result().status_code == 200, answer.result().text
            assert "model unknown" not in caplog.text  # the store answered: the guard's decision is the store's
            rollout = poll(lambda: recorded(gateway, rollout_id), 30, "the call's record")
            assert (rollout["model"], len(rollout["calls"])) == ("my-agent", 1), rollout
    finally:
        proxy.resume()
        proxy.down()


def recorded(gateway: GatewayProcess | InProcessGateway, rollout_id: str) -> dict[str, Any] | None:
    """The rollout as the store has it, once its calls on their way are in; None: none recorded."""
    got = httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", headers=gateway.admin, timeout=30)
    return got.json() if got.status_code == 200 else None


@pytest.fixture
def replicas(pg_database_url: str, stub_url: str, tmp_path: Path) -> Iterator[list[GatewayProcess]]:
    with started_together([serve(tmp_path, stub_url, "--db", pg_database_url, wait=False) for _ in range(2)]) as both:
        yield both


def test_a_rollout_taken_on_one_replica_is_refused_to_another_model_on_the_other(
    replicas: list[GatewayProcess],
) -> None:
    one, two = replicas
    rollout_id = f"taken-{uuid.uuid4().hex[:8]}"
    assert chat(one.base_url, rollout_id, "a").status_code == 200
    poll(
        lambda: (
            httpx.get(f"{two.base_url}/art/rollouts/{rollout_id}", headers=two.admin, timeout=30).status_code == 200
        ),
        30,
        "the first call in the store",
    )
    # Replica two has never seen the rollout: the store says it is `a`'s, so `b`'s call is refused, unrecorded.
    refused = chat(two.base_url, rollout_id, "b")
    assert (refused.status_code, refused.json()["error"]["code"]) == (409, "rollout_id_taken"), refused.text
    assert refused.json()["error"]["param"] == ROLLOUT
    assert chat(two.base_url, rollout_id, "a").status_code == 200  # its own model joins it there
    assert chat(one.base_url, rollout_id, "b").status_code == 409  # and where it began
    poll(
        lambda: len(httpx.get(f"{one.base_url}/art/rollouts/{rollout_id}", headers=one.admin).json()["calls"]) == 2,
        30,
        "the second call of `a` in the store",
    )
    rollout = recorded(one, rollout_id)
    assert rollout is not None and (rollout["model"], len(rollout["calls"])) == ("a", 2)
    assert recorded(one, stray_rollout_id(rollout_id, "b")) is None  # nothing of `b`'s, not even kept apart


def test_two_models_racing_for_one_new_rollout_id_one_is_answered(replicas: list[GatewayProcess]) -> None:
    """The first calls of `a` and `b` naming one new id at once, on one replica: both go to the engine while the
    store says the id is free; exactly one is answered and the other refused, and only the answered one is
    recorded."""
    gateway = replicas[0]
    for _ in range(5):
        rollout_id = f"race-{uuid.uuid4().hex[:8]}"
        start = threading.Barrier(2)

        def call(model: str, rollout_id: str = rollout_id, start: threading.Barrier = start) -> httpx.Response:
            start.wait()
            return chat(gateway.base_url, rollout_id, model)

        with ThreadPoolExecutor(2) as pool:
            answers = dict(zip(("a", "b"), pool.map(call, ("a", "b")), strict=True))
        statuses = sorted(r.status_code for r in answers.values())
        assert statuses == [200, 409], {m: r.text for m, r in answers.items()}
        winner, loser = sorted(answers, key=lambda m: answers[m].status_code)
        rollout = poll(lambda rollout_id=rollout_id: recorded(gateway, rollout_id), 30, "the answered call's record")
        assert (rollout["model"], len(rollout["calls"])) == (winner, 1)
        assert recorded(gateway, stray_rollout_id(rollout_id, loser)) is None
