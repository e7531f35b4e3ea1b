"""Start `artgw train` many times, each bounded, and dump any start that does not reach its first line (#39: a
trainer sat silent at start in 2 of 6 fresh-clone runs of session 23, never since).

Each start runs against a store made here and a gateway address nobody listens on, with a base model that does
not exist: it imports what it imports, builds its config, opens the store, prints its first line
(`artgw train base=...`) and stops on the base model. A start is done at that line or at its exit; one that has
neither after --bound seconds is reported (each thread's state, system call, kernel stack and CPU time from
/proc, and py-spy's Python and native stacks where py-spy is on PATH), then killed. Heavy: run it under the
machine's lock, with a CPU-bound process beside it to load the machine as a suite does, e.g.

    python3 -c 'while 1: pass' & flock /tmp/artgw-engine.lock .venv/bin/python bench/start_loop.py --mode fork \\
        --starts 200; kill %1

--mode exec: a fresh interpreter each (`subprocess.Popen`, as tests/conftest.py's `start_trainer(fresh=True)`),
each with its own PYTHONHASHSEED (the start's number: a start that hangs can be replayed with the same hash
order); fork: forked from tests/zygote.py's trainer fork server, as the tests start trainers; compile: exec after
removing the checkout's __pycache__ directories (a fresh clone's first imports compile).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import zygote  # noqa: E402
from tests.conftest import ARTGW, TRAINER_ENV, process_waits  # noqa: E402

FIRST_LINE = b"artgw train base="


def start(mode: str, number: int, data: Path, log: Path, server: zygote.Server | None) -> Any:
    command = [ARTGW, "train", "--model", "my-agent", "--base-model", str(data / "no-model"), "--data-dir", str(data)]
    command += ["--gateway", "http://127.0.0.1:9", "--groups-per-step", "8", "--seed", "0"]
    env = {**os.environ, **TRAINER_ENV}
    with log.open("wb") as out:
        if server is not None:
            return server.spawn(command, stdout=out.fileno(), env=env, cwd=str(ROOT))
        if mode == "compile":
            for cache in ROOT.rglob("__pycache__"):
                if ".venv" not in cache.parts and "node_modules" not in cache.parts:
                    shutil.rmtree(cache, ignore_errors=True)
        env["PYTHONHASHSEED"] = str(number)
        return subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def report(pid: int) -> str:
    lines = [process_waits(pid, native=False)]
    if shutil.which("py-spy"):
        for native in (["--native"], []):  # --native fails on some stacks: then the Python one alone
            with contextlib.suppress(subprocess.TimeoutExpired):
                spy = subprocess.run(
                    ["py-spy", "dump", *native, "--pid", str(pid)], capture_output=True, text=True, timeout=60
                )
                lines.append(spy.stdout + spy.stderr)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("exec", "fork", "compile"), default="exec")
    parser.add_argument("--starts", type=int, default=100)
    parser.add_argument("--first", type=int, default=0, help="the first start's number (its PYTHONHASHSEED)")
    parser.add_argument("--bound", type=float, default=60.0, help="seconds a start may take to its first line")
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="artgw-start-loop-"))
    subprocess.run([ARTGW, "migrate", "--data-dir", str(data)], check=True, capture_output=True)
    server = zygote.Server("train", TRAINER_ENV) if args.mode == "fork" else None
    times, hung = [], []
    for number in range(args.first, args.first + args.starts):
        log = data / f"start-{number}.log"
        began = time.monotonic()
        proc = start(args.mode, number, data, log, server)
        while proc.poll() is None and FIRST_LINE not in log.read_bytes() and time.monotonic() - began < args.bound:
            time.sleep(0.05)
        took = time.monotonic() - began
        if proc.poll() is None and FIRST_LINE not in log.read_bytes():
            hung.append(number)
            print(f"start {number}: no first line after {took:.0f} s (pid {proc.pid}):\n{report(proc.pid)}", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        times.append(took)
        print(f"start {number}: {took:.1f} s", flush=True)
    shutil.rmtree(data, ignore_errors=True)
    print(
        f"{len(times)} starts ({args.mode}): median {statistics.median(times):.1f} s, max {max(times):.1f} s; "
        f"no first line within {args.bound:.0f} s: {hung or 'none'}"
    )
    return 1 if hung else 0


if __name__ == "__main__":
    sys.exit(main())
