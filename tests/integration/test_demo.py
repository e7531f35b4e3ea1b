"""`artgw demo --quick` as a user runs it: it completes, writes its table and PNG, and leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import ARTGW, poll

pytestmark = pytest.mark.engine

MARKER = "ARTGW_DEMO_TEST_RUN"  # inherited by everything the demo starts: how leftovers are found


def marked(token: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) == token:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_quick_demo_completes_writes_outputs_and_leaves_no_process(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    out, data = tmp_path / "out", tmp_path / "data"
    log_path = tmp_path / "demo.log"
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            # --quick, with 2 of its 8 steps of half its groups and a quarter of its held-out scenarios: what this
            # test asserts (it completes, serves a trained step, writes its outputs, leaves no process) takes no
            # more; that the steps learn is test_trainer_e2e's (the same task, trainer and gateway).
            [
                ARTGW,
                "demo",
                "--quick",
                *("--steps", "2", "--groups-per-step", "4", "--eval-scenarios", "8"),
                "--out",
                str(out),
                "--data-dir",
                str(data),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, MARKER: token, "COLUMNS": "100"},
            start_new_session=True,
        )
    seen: dict[int, float] = {}  # every process the demo started (pid -> create time), sampled while it runs

    def finished() -> bool:
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(child.pid, child.create_time())
        except psutil.NoSuchProcess:
            pass
        return proc.poll() is not None

    try:
        poll(finished, 840, "the demo to finish (under the suite's --timeout=900)", every=1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            for p in marked(token):
                p.kill()
    seconds = time.monotonic() - started
    output = log_path.read_text(errors="replace")
    print(f"\n--- artgw demo --quick ({seconds:.0f}s) ---\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]

    # Its outputs.
    table = (out / "table.txt").read_text()
    assert "before RL" in table and "mean reward" in table and "tool argument correct" in table
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    assert results["ok"] is True
    assert results["served_step"] >= 1
    assert len(results["steps"]) == results["config"]["steps"]
    assert results["before"]["errors"] == 0 and results["after"]["errors"] == 0
    assert all(0.0 <= results[when]["tool_argument"] <= 1.0 for when in ("before", "after"))  # the tool-call metric

    # No process left: neither one it was seen to start nor anything carrying its environment.
    assert len(seen) >= 3, seen  # gateway, vLLM (and its engine core), trainer
    # A process the demo stopped on its way out may take a moment to be reaped (longer on a busy machine: the bound
    # is generous, what counts is that none stays).
    leftovers: list[int] = []

    def none_left() -> bool:
        leftovers[:] = [p for p, created in seen.items() if still_running(p, created)] + [p.pid for p in marked(token)]
        return not leftovers

    try:
        poll(none_left, 30, "every process of the demo to be gone")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: still running {leftovers}") from None


def still_running(pid: int, created: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
