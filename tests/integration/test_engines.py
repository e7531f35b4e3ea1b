"""Several engines behind one gateway (engine/pool.py, #45): a rollout's calls all reach the engine of its first
call, new rollouts go to the engine with the fewest calls in flight, an engine that dies is out of rotation at
once and its rollouts go on on another with no answered call lost, and it is back in rotation when it answers
again. Every call's record names its engine.

Against stand-in engines (tests/stub_engine.py), several at once; two real vLLM engines (a rollout one sequence on
one, a step published to both, a rollout whose engine died spliced on the other) are
tests/integration/test_supervised_engines.py's, started by the gateway (`--engines 2`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import (
    ARTGW,
    hold_stub,
    metric,
    poll,
    query_store,
    start_gateway,
    start_stub,
    stop_group,
)

CHAT: dict[str, Any] = {"model": "my-agent", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def stubs() -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """Stand-in engines a test starts (`stubs.append(start_stub(...))`), all stopped at its end."""
    started: list[tuple[str, subprocess.Popen[bytes]]] = []
    yield started
    for _, proc in started:
        stop_group(proc)


def chat(gateway: Any, rollout_id: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        f"{gateway.base_url}/chat/completions",
        json={**CHAT, **extra},
        headers={"X-ART-Rollout-Id": rollout_id},
        timeout=60,
    )


def engines_of(gateway: Any, rollout_id: str) -> list[str]:
    """The engine of each recorded call of the rollout, in order, as the store has it and the rollout's API shows
    it (read once the rollout is stored)."""
    answer = httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", headers=gateway.admin, timeout=60)
    assert answer.status_code == 200, answer.text
    rows = query_store(gateway.db_path, "SELECT engine FROM calls WHERE rollout_id = ? ORDER BY started_at", rollout_id)
    stored = [row[0] for row in rows]
    assert [call["engine"] for call in answer.json()["calls"]] == stored
    return stored


def test_a_rollouts_calls_reach_one_engine_and_new_rollouts_go_to_the_least_loaded(tmp_path: Path, stubs) -> None:
    # The first engine holds its calls until released, the second answers at once: a call in flight on the first
    # makes it the busier.
    stubs.append(slow := start_stub())
    stubs.append(fast := start_stub())
    gateway = start_gateway(tmp_path, "--upstream", f"{slow[0]},{fast[0]}")
    try:
        answered: list[httpx.Response] = []
        hold_stub(slow[0], True)
        first = threading.Thread(target=lambda: answered.append(chat(gateway, "slow-1")))
        first.start()  # a new rollout, both engines idle: the first engine
        poll(lambda: metric(gateway.url, "artgw_engine_in_flight", engine=slow[0]) == 1, 30, "the call in flight")
        # While it is in flight, new rollouts go to the idle engine (though it has served more calls), and each
        # rollout's later calls follow it there.
        for n in range(3):
            for _ in range(3):
                assert chat(gateway, f"fast-{n}").status_code == 200
        assert first.is_alive(), "the slow engine's call ended before the others were sent: no load to see"
        hold_stub(slow[0], False)
        first.join()
        assert answered[0].status_code == 200
        assert chat(gateway, "slow-1").status_code == 200  # its rollout's engine, though it is the slower

        assert engines_of(gateway, "slow-1") == [slow[0]] * 2
        for n in range(3):
            assert engines_of(gateway, f"fast-{n}") == [fast[0]] * 3
        # Nothing in flight anywhere: a new rollout goes to the engine that was sent fewer calls.
        assert chat(gateway, "next").status_code == 200
        assert engines_of(gateway, "next") == [slow[0]]
        assert metric(gateway.url, "artgw_engine_calls_total", engine=fast[0]) == 9
        assert metric(gateway.url, "artgw_engine_healthy", engine=slow[0], exported=True) == 1
    finally:
        gateway.stop()


def test_an_engine_killed_mid_run_is_out_of_rotation_and_back_when_it_answers(tmp_path: Path, stubs) -> None:
    # Both engines hold their calls until released: the dying one dies with two in flight.
    stubs.append(dying := start_stub())
    stubs.append(other := start_stub())
    port = int(dying[0].rsplit(":", 1)[1])
    gateway = start_gateway(tmp_path, "--upstream", dying[0], "--upstream", other[0], "--engine-health-interval", "0.5")
    try:
        for url, _ in (dying, other):
            hold_stub(url, True)
        rollouts = ["r0", "r1", "r2", "r3"]
        threads, answers = [], {}
        for rollout_id in rollouts:  # each rollout's first call, two on each engine
            thread = threading.Thread(target=lambda r=rollout_id: answers.__setitem__(r, chat(gateway, r)))
            thread.start()
            threads.append(thread)
            poll(lambda: metric(gateway.url, "artgw_engine_calls_total") == len(threads), 30, "the call sent")
        poll(lambda: metric(gateway.url, "artgw_engine_in_flight", engine=dying[0]) == 2, 30, "two calls in flight")
        os.killpg(dying[1].pid, signal.SIGKILL)  # mid-run: two calls in flight on it
        dying[1].wait()
        hold_stub(other[0], False)
        for thread in threads:
            thread.join()
        # The calls it was working on were cut before any answer: sent again to the other engine, and answered.
        assert {r: a.status_code for r, a in answers.items()} == dict.fromkeys(rollouts, 200)
        assert metric(gateway.url, "artgw_engine_healthy", engine=dying[0]) == 0
        for rollout_id in rollouts:  # every rollout goes on, on the engine left
            assert chat(gateway, rollout_id).status_code == 200
        for rollout_id in rollouts:
            assert engines_of(gateway, rollout_id) == [other[0]] * 2, rollout_id
        assert metric(gateway.url, "artgw_engine_moves_total", reason="unreachable") == 2
        # Every answered call is recorded, once.
        recorded = query_store(gateway.db_path, "SELECT status, count(*) FROM calls GROUP BY status")
        assert recorded == [("ok", 8)]

        stubs.append(start_stub(port=port))  # it restarts: back in rotation once its probe answers
        poll(lambda: metric(gateway.url, "artgw_engine_healthy", engine=dying[0]) == 1, 30, "the engine back")
        assert chat(gateway, "after").status_code == 200  # a new rollout: the engine with fewer calls
        assert engines_of(gateway, "after") == [dying[0]]
        assert chat(gateway, "r0").status_code == 200  # a moved rollout stays where it went
        assert engines_of(gateway, "r0") == [other[0]] * 3
    finally:
        gateway.stop()


def test_an_engine_that_dies_mid_stream_is_out_of_rotation_and_its_rollout_goes_on(tmp_path: Path, stubs) -> None:
    stubs.append(dying := start_stub("--die-mid-stream"))
    stubs.append(other := start_stub())
    gateway = start_gateway(tmp_path, "--upstream", dying[0], "--upstream", other[0])
    try:
        with httpx.stream(
            "POST",
            f"{gateway.base_url}/chat/completions",
            json={**CHAT, "stream": True},
            headers={"X-ART-Rollout-Id": "cut"},
            timeout=60,
        ) as answer:
            events = answer.read().decode()
        assert "The engine connection was lost mid-stream." in events  # what the client saw, not acknowledged
        assert metric(gateway.url, "artgw_engine_healthy", engine=dying[0]) == 0
        assert chat(gateway, "cut").status_code == 200  # the rollout goes on, on the other engine
        assert engines_of(gateway, "cut") == [dying[0], other[0]]
        statuses = query_store(gateway.db_path, "SELECT status FROM calls WHERE rollout_id = 'cut' ORDER BY started_at")
        assert statuses == [("upstream_error",), ("ok",)]
        assert metric(gateway.url, "artgw_engine_moves_total", reason="unhealthy") == 1
    finally:
        gateway.stop()


def test_readiness_and_status_say_which_engines_are_in_rotation(tmp_path: Path, stubs) -> None:
    stubs.append(first := start_stub())
    stubs.append(second := start_stub())
    gateway = start_gateway(
        tmp_path, "--upstream", first[0], "--upstream", second[0], "--engine-health-interval", "0.5"
    )

    def engines() -> str:
        return str(httpx.get(f"{gateway.url}/readyz", timeout=10).json().get("engines"))

    try:
        assert engines().startswith("2 of 2 in rotation: ")
        stop_group(second[1])
        poll(lambda: engines().startswith("1 of 2 in rotation"), 30, "the stopped engine out of rotation")
        assert f"{second[0]} out of rotation" in engines() and f"{first[0]} in rotation" in engines()
        assert httpx.get(f"{gateway.url}/readyz", timeout=10).status_code == 200  # one engine serves
        assert chat(gateway, "after-stop").status_code == 200
        assert engines_of(gateway, "after-stop") == [first[0]]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ARTGW_")}
        status = subprocess.run(
            [ARTGW, "status", "--gateway", gateway.url, "--data-dir", str(gateway.data_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert status.returncode == 0, status.stderr
        assert f"engines: 1 of 2 in rotation: {first[0]} in rotation" in status.stdout, status.stdout
    finally:
        gateway.stop()


def stored(gateway: Any, rollout_id: str, calls: int) -> None:
    """Wait until the store holds the rollout's `calls` calls (a replica records its calls a moment after answering)."""
    sql = "SELECT count(*) FROM calls WHERE rollout_id = ?"
    poll(lambda: query_store(gateway.db_path, sql, rollout_id) == [(calls,)], 30, f"{rollout_id}'s calls stored")


def test_a_rollouts_call_on_another_replica_goes_to_the_engine_of_its_last_call(tmp_path: Path, stubs) -> None:
    stubs.append(first := start_stub())
    stubs.append(second := start_stub())
    upstreams = ("--upstream", f"{first[0]},{second[0]}")
    one = start_gateway(tmp_path, *upstreams)
    # A second replica on the same store (SQLite here; PostgreSQL in a deployment: the same reads).
    two = start_gateway(tmp_path, *upstreams, "--db", f"sqlite+aiosqlite:///{one.db_path}")
    try:
        assert chat(two, "elsewhere").status_code == 200  # the second replica has sent a call to the first engine
        answered = chat(one, "r")  # a new rollout on the first replica: its first engine, both idle
        assert answered.status_code == 200
        stored(one, "r", 1)
        reply = {"role": "assistant", "content": answered.json()["choices"][0]["message"]["content"]}
        # Its next call through the other replica, which never saw the rollout and would send a new one to the
        # engine it sent fewer calls: it reads the rollout's last call from the store, and follows its engine.
        assert chat(two, "r", messages=[*CHAT["messages"], reply, {"role": "user", "content": "go"}]).status_code == 200
        stored(one, "r", 2)
        assert engines_of(one, "r") == [first[0]] * 2
        assert metric(two.url, "artgw_continuation_reads_total", found="found") == 1
        assert chat(two, "new").status_code == 200  # a new rollout still goes to the least loaded
        stored(one, "new", 1)
        assert engines_of(one, "new") == [second[0]]
    finally:
        two.stop()
        one.stop()


def test_after_a_gateway_restart_a_rollouts_call_goes_to_the_engine_of_its_last_call(tmp_path: Path, stubs) -> None:
    stubs.append(first := start_stub())
    stubs.append(second := start_stub())
    upstreams = ("--upstream", f"{first[0]},{second[0]}")
    before = start_gateway(tmp_path, *upstreams)
    try:
        assert chat(before, "warm").status_code == 200  # both idle: the first engine
        answered = chat(before, "r")  # both idle again, the first sent one call more: the second
        assert answered.status_code == 200
        stored(before, "r", 1)
        assert engines_of(before, "r") == [second[0]]
    finally:
        before.stop()
    # The same data dir (store, admin key) on a new port: a process that has sent no call to either engine, so a
    # rollout it has not seen would go to the first; the rollout's next call reads its last call from the store and
    # follows its engine.
    restarted = start_gateway(tmp_path, *upstreams, "--data-dir", str(before.data_dir))
    after = dataclasses.replace(restarted, data_dir=before.data_dir)
    try:
        reply = {"role": "assistant", "content": answered.json()["choices"][0]["message"]["content"]}
        then = [*CHAT["messages"], reply, {"role": "user", "content": "go"}]
        assert chat(after, "r", messages=then).status_code == 200
        stored(after, "r", 2)
        assert engines_of(after, "r") == [second[0]] * 2
        assert metric(after.url, "artgw_continuation_reads_total", found="found") == 1
        assert chat(after, "new").status_code == 200  # and a new rollout goes to the least loaded: the first
        stored(after, "new", 1)
        assert engines_of(after, "new") == [first[0]]
    finally:
        after.stop()
