"""A LoRA step is published to every engine, or to none (#45, gateway/adapters.py `_publish`): a commit or a
promotion loads the step on every engine in rotation and checks that each lists it at `/v1/models` before any call
is routed to it; an engine that does not load it is quarantined (out of rotation, on /readyz and /metrics) while
the engines that hold it serve it, until a retry loads it there; a step no engine loads is published to none; an
engine that comes back gets every served and pinned step before it takes a call, and a pinned rollout finishes on
its step on whichever engine it lands; an engine in rotation that lost a step (restarted between two probes) is
quarantined until it holds it again, and a call that reaches it before the probe notices is answered all the same
(on another engine, or on it once it holds every served step again).

Two stand-in engines (tests/stub_engine.py: their LoRA API takes any adapter directory, lists what it holds at
`/v1/models`, answers 404 for a LoRA it does not hold, as vLLM does, and refuses or delays loads on cue) behind a
gateway in this process (tests/inprocess.py).
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import Settings
from tests.conftest import metric, poll, start_stub, stop_group, wait_http
from tests.inprocess import InProcessGateway, ManualClock, serve_in_process
from tests.recorded import answered_call, rollout

MODEL = "my-agent"


@pytest.fixture
def engines() -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """Two stand-in engines; a test may add one it restarts (all stopped at its end)."""
    started = [start_stub(), start_stub()]
    yield started
    for _, proc in started:
        stop_group(proc)


@contextmanager
def serve(tmp_path: Path, urls: list[str], probe_every: float = 0.2) -> Iterator[InProcessGateway]:
    """A gateway in front of the engines at `urls`, ready (the engines' adapters loaded), probing them each
    `probe_every` seconds."""
    settings = Settings(
        upstream=tuple(urls), data_dir=tmp_path / "data", auth="off", engine_health_interval=probe_every
    )
    with serve_in_process(settings, ManualClock()) as gateway:
        wait_http(f"{gateway.url}/readyz", 60)
        yield gateway


def commit(gateway: InProcessGateway, tmp_path: Path, step: int) -> httpx.Response:
    """Commit `step` as a trainer does (promotion `always`: served at once once published)."""
    path = tmp_path / "checkpoints" / str(step)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    spec = {"step": step, "path": str(path)}
    return httpx.post(f"{gateway.base_url}/art/models/{MODEL}/adapters", json=spec, headers=gateway.admin, timeout=60)


def call(gateway: InProcessGateway, rollout_id: str) -> tuple[int, str]:
    """One chat call of `rollout_id` to `NAME`, answered: (the step that served it, its engine), as recorded."""
    last = answered_call(gateway, rollout_id, MODEL)
    return int(last["step"]), str(last["engine"])


def held(url: str) -> list[str]:
    """The LoRA adapters a stand-in engine holds."""
    return list(httpx.get(f"{url}/loras", timeout=10).json()["loaded"])


def loads(url: str, **how: Any) -> None:
    """Tell a stand-in engine to refuse its loads (`refuse`), or to take `delay` seconds over each."""
    assert httpx.put(f"{url}/loads", json=how, timeout=10).status_code == 200


def readiness_engines(gateway: InProcessGateway) -> str:
    return str(httpx.get(f"{gateway.url}/readyz", timeout=10).json()["engines"])


def status_engines(gateway: InProcessGateway, capsys: pytest.CaptureFixture[str]) -> str:
    """The `engines:` line `artgw status` prints (its command run in this process: no interpreter to start)."""
    from artgw import cli

    assert cli.main(["status", "--gateway", gateway.url, "--data-dir", str(gateway.data_dir)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("engines: ")]
    return line


def test_a_step_reaches_every_engine_before_any_new_rollout_gets_it(tmp_path: Path, engines) -> None:
    (first, _), (second, _) = engines
    loads(second, delay=1.5)  # the second engine takes a while over its load: new rollouts arrive meanwhile
    with serve(tmp_path, [first, second]) as gateway:
        committed: list[httpx.Response] = []
        committing = threading.Thread(target=lambda: committed.append(commit(gateway, tmp_path, 1)))
        committing.start()
        early, n = 0, 0
        while committing.is_alive():  # new rollouts while the step is being published
            step, _ = call(gateway, f"during-{n}")
            n += 1
            if f"{MODEL}@1" not in held(second):  # answered before the second engine held it: not routed to it
                assert step == 0, f"rollout during-{n - 1} got the step before every engine held it"
                early += 1
        committing.join()
        assert committed[0].status_code == 200, committed[0].text
        assert early > 0, "no call was answered while the step was being published"
        assert held(first) == held(second) == [f"{MODEL}@1"]
        # Published: every new rollout gets it, on whichever engine it lands (each engine gets one).
        after = [call(gateway, f"after-{n}") for n in range(2)]
        assert sorted(after) == sorted([(1, first), (1, second)]), after


def test_an_engine_that_cannot_load_a_step_is_quarantined_while_the_other_serves_it(
    tmp_path: Path, engines, capsys: pytest.CaptureFixture[str]
) -> None:
    (first, _), (second, _) = engines
    with serve(tmp_path, [first, second]) as gateway:
        # Neither engine loads it: published to none, no engine quarantined, `NAME` stays on the base weights.
        loads(first, refuse=True)
        loads(second, refuse=True)
        refused = commit(gateway, tmp_path, 1)
        assert refused.status_code == 502 and refused.json()["error"]["code"] == "adapter_load_failed", refused.text
        assert readiness_engines(gateway).startswith("2 of 2 in rotation")
        assert call(gateway, "before")[0] == 0

        loads(first, refuse=False)  # the second still refuses: quarantined, the first holds and serves the step
        assert commit(gateway, tmp_path, 2).json()["served_step"] == 2
        assert metric(gateway.url, "artgw_engine_quarantined", engine=second) == 1
        assert metric(gateway.url, "artgw_engine_quarantined", engine=first, exported=True) == 0
        assert f"{second} quarantined: did not load {MODEL}@2" in readiness_engines(gateway)
        assert readiness_engines(gateway).startswith("1 of 2 in rotation")
        status = status_engines(gateway, capsys)  # what an operator sees: which engine, and the step it did not load
        assert status.startswith(f"engines: 1 of 2 in rotation: {first} in rotation"), status
        assert f"{second} quarantined: did not load {MODEL}@2" in status, status
        assert [call(gateway, f"new-{n}") for n in range(3)] == [(2, first)] * 3  # never the engine without it
        assert call(gateway, "before") == (0, first)  # a rollout of the base weights goes on, on an engine in rotation

        loads(second, refuse=False)  # a retry (each health probe) loads it there: back in rotation
        poll(lambda: metric(gateway.url, "artgw_engine_quarantined", engine=second) == 0, 30, "the quarantine lifted")
        assert held(second) == [f"{MODEL}@2"]
        assert readiness_engines(gateway).startswith("2 of 2 in rotation")
        assert "quarantined" not in status_engines(gateway, capsys)
        assert call(gateway, "back") == (2, second)  # the engine sent fewer calls


def test_an_engine_that_comes_back_gets_every_served_and_pinned_step_before_a_call(tmp_path: Path, engines) -> None:
    (first, first_proc), (second, _) = engines
    port = int(first.rsplit(":", 1)[1])
    with serve(tmp_path, [first, second]) as gateway:
        assert commit(gateway, tmp_path, 1).status_code == 200
        assert call(gateway, "pinned") == (1, first)  # a rollout on step 1, on the first engine
        assert commit(gateway, tmp_path, 2).status_code == 200  # new rollouts get step 2; `pinned` stays on 1
        stop_group(first_proc)  # its engine dies: the rollout finishes on its step, on the other engine
        poll(lambda: metric(gateway.url, "artgw_engine_healthy", engine=first) == 0, 30, "the engine out of rotation")
        assert call(gateway, "pinned") == (1, second)

        engines.append(start_stub(port=port))  # it restarts, holding nothing
        poll(lambda: metric(gateway.url, "artgw_engine_healthy", engine=first) == 1, 30, "the engine back")
        assert held(first) == [f"{MODEL}@1", f"{MODEL}@2"]  # loaded before it was back in rotation
        assert call(gateway, "fresh") == (2, first)  # the engine sent fewer calls

        # An engine in rotation that lost a step, as one that restarted between two probes has: quarantined at
        # the next probe, given the step again, back in rotation.
        lost = httpx.post(f"{second}/v1/unload_lora_adapter", json={"lora_name": f"{MODEL}@1"}, timeout=10)
        assert lost.status_code == 200
        poll(lambda: f"{MODEL}@1" in held(second), 30, "the lost step loaded again")
        poll(lambda: metric(gateway.url, "artgw_engine_quarantined", engine=second) == 0, 30, "back in rotation")
        assert call(gateway, "pinned") == (1, second)


def restart(engines: list[tuple[str, subprocess.Popen[bytes]]], index: int) -> None:
    """Stop the stand-in engine `engines[index]` and start it again on its port, holding no adapter (as a vLLM
    that restarted): its replacement is stopped at the test's end."""
    url, proc = engines[index]
    stop_group(proc)
    engines.append(start_stub(port=int(url.rsplit(":", 1)[1])))


def test_a_call_reaching_an_engine_that_restarted_before_its_probe_goes_to_one_that_holds_its_step(
    tmp_path: Path, engines
) -> None:
    (first, _), (second, _) = engines
    # One probe at the start, then none: the restart below is not noticed before the call reaches the engine.
    with serve(tmp_path, [first, second], probe_every=3600) as gateway:
        assert commit(gateway, tmp_path, 1).status_code == 200
        assert call(gateway, "r") == (1, first)
        restart(engines, 0)
        assert held(first) == []
        # Its rollout's next call reaches the engine that lost the step: answered by the other, which holds it,
        # and the engine is out of rotation until a probe has loaded every served step there.
        assert call(gateway, "r") == (1, second)
        assert metric(gateway.url, "artgw_engine_quarantined", engine=first) == 1
        assert metric(gateway.url, "artgw_engine_moves_total", reason="quarantined") == 1
        assert call(gateway, "new") == (1, second)
        statuses = [c["status"] for c in rollout(gateway, "r")["calls"]]
        assert statuses == ["ok", "ok"]  # nothing failed, nothing recorded twice


def test_a_call_reaching_the_only_engine_after_it_restarted_is_answered_once_its_steps_are_loaded_again(
    tmp_path: Path, engines
) -> None:
    (only, _), _ = engines
    with serve(tmp_path, [only]) as gateway:  # one engine: no probe (nowhere else to send a call)
        assert commit(gateway, tmp_path, 1).status_code == 200
        assert commit(gateway, tmp_path, 2).status_code == 200
        assert call(gateway, "r") == (2, only)
        restart(engines, 0)
        assert held(only) == []
        assert call(gateway, "r") == (2, only)  # the engine was given every served step, then the call again
        assert sorted(held(only)) == [f"{MODEL}@1", f"{MODEL}@2"]
        assert [c["status"] for c in rollout(gateway, "r")["calls"]] == ["ok", "ok"]
