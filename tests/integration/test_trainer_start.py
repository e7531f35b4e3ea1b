"""`artgw train` that is slow to start says where it is (#39): a trainer once sat silent at start for minutes in
the suite, and nothing it printed said where. `--startup-dump-seconds S` (default 180) has it print every
thread's stack to its log when its first line has not come within S seconds, and its first line disarms that.

A real `artgw train` against a gateway in front of the stand-in engine (tests/stub_engine.py), with S small enough
that any start passes it (the imports of torch alone take longer): the stacks are in the log before the first
line, once, and the trainer then goes on and stops cleanly. With the dump off (0), none.

Out of memory with no swap, a start is not always killed: it thrashes, or (a memory cgroup with its OOM killer
off) is parked at its limit, silent for as long as that lasts: the suite's stuck trainer, one thread in state R,
wchan 0 (trainer/startwatch.py). Such a start stops within `--start-memory-stall-seconds` with one line that says so,
and a failed exit status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import ARTGW, ROOT, TRAINER_ENV, GatewayProcess, TrainerProcess, gateway_on_stub, poll

MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory")  # cgroup v1's memory controller

FIRST_LINE = "artgw train base="  # trainer/train.py's first line


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with gateway_on_stub(tmp_path_factory.mktemp("start")) as gateway:
        yield gateway


def started(trainer: TrainerProcess) -> str:
    """The trainer's log once its first line is there (it failed the test if it exited first)."""
    poll(lambda: FIRST_LINE in trainer.log(), 600, "the trainer's first line", alive=[trainer])
    return trainer.log()


def test_a_start_slower_than_the_bound_prints_every_threads_stack_once(
    gateway: GatewayProcess, tiny_model: Path
) -> None:
    trainer = TrainerProcess("trainer-slow-start", gateway, tiny_model, "--startup-dump-seconds", "0.2", fresh=True)
    try:
        log = started(trainer)
    finally:
        code = trainer.stop()
    before, _, _ = log.partition(FIRST_LINE)
    assert "artgw train: no first line after 0.2 s; every thread's stack:" in before, log[-3000:]
    assert "most recent call first" in before and 'File "' in before, log[-3000:]
    assert log.count("no first line after") == 1 and log.count("Current thread") == 1, log[-3000:]
    assert code == 0, trainer.log()[-3000:]


def test_no_stack_with_the_dump_off(gateway: GatewayProcess, tiny_model: Path) -> None:
    trainer = TrainerProcess("trainer-no-dump", gateway, tiny_model, "--startup-dump-seconds", "0", fresh=True)
    try:
        log = started(trainer)
    finally:
        code = trainer.stop()
    assert "no first line after" not in log and "most recent call first" not in log, log[-3000:]
    assert code == 0, trainer.log()[-3000:]


def watcher_on(pid: int) -> bool:
    """The process's start watcher (trainer/startwatch.py) is on: its pages locked in memory (the start waits for
    that, root as the suite runs; its files, the cgroup's among them, opened before)."""
    for child in psutil.Process(pid).children():
        with contextlib.suppress(psutil.Error, OSError):
            if any(word.endswith("startwatch.py") for word in child.cmdline()):
                status = Path(f"/proc/{child.pid}/status").read_text()
                return any(line.split()[1:2] != ["0"] for line in status.splitlines() if line.startswith("VmLck:"))
    return False


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A memory cgroup (v1) whose OOM killer is off: at its limit its processes are parked, never killed (a start
    that has run out of memory, as on a machine without swap, without starving the machine)."""
    if not os.access(MEMORY_CGROUPS / "cgroup.procs", os.W_OK):
        pytest.skip("needs cgroup v1's memory controller, writable (root; CI here runs as root)")
    group = MEMORY_CGROUPS / f"artgw-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.oom_control").write_text("1")  # the OOM killer off: parked
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        poll(lambda: not (group / "cgroup.procs").read_text().strip(), 60, "the cgroup's processes to end")
        group.rmdir()


def test_a_start_stalled_on_memory_stops_with_one_line(memory_cgroup: Path, tmp_path: Path) -> None:
    # In the cgroup from its first page on, with no limit until its watcher is on (what the interpreter and the
    # CLI's imports take varies with what the machine's page cache holds); then 64 MiB more than it holds, which
    # importing torch outgrows: parked there, before it reads the store or asks the gateway (neither exists).
    command = [ARTGW, "train", "--model", "my-agent", "--base-model", str(tmp_path), "--data-dir", str(tmp_path)]
    command += ["--gateway", "http://127.0.0.1:9", "--start-memory-stall-seconds", "5"]
    procs = memory_cgroup / "cgroup.procs"
    trainer = subprocess.Popen(
        ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *command],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **TRAINER_ENV},
        start_new_session=True,
    )
    poll(lambda: watcher_on(trainer.pid), 120, "the trainer's start watcher on", every=0.01)
    limit = int((memory_cgroup / "memory.usage_in_bytes").read_text()) + (64 << 20)
    (memory_cgroup / "memory.limit_in_bytes").write_text(str(limit))
    try:
        output, _ = trainer.communicate(timeout=300)  # generous: parked, the code before this had it wait forever
    except subprocess.TimeoutExpired:
        os.killpg(trainer.pid, signal.SIGKILL)
        output, _ = trainer.communicate()
        raise AssertionError(f"the trainer sat silent past 300 s; its output: {output.decode()[-2000:]}") from None
    lines = output.decode(errors="replace").splitlines()
    stalled = [line for line in lines if "waiting for memory" in line]
    assert len(stalled) == 1, lines[-20:]
    assert stalled[0].startswith("artgw train: stalled "), stalled
    assert f"its memory cgroup's limit {limit >> 20} MiB" in stalled[0], stalled
    assert trainer.returncode != 0, lines[-20:]
