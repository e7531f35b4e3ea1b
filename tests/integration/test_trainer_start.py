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
    that has run out of memory, as on a machine without swap, without starving the machine). Gone afterwards
    whatever happened: its processes killed (unparked first: no limit), moved out, the group removed."""
    if not os.access(MEMORY_CGROUPS / "cgroup.procs", os.W_OK):
        pytest.skip("needs cgroup v1's memory controller, writable (root; CI here runs as root)")
    group = MEMORY_CGROUPS / f"artgw-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.oom_control").write_text("1")  # the OOM killer off: parked
        yield group
    finally:
        (group / "memory.limit_in_bytes").write_text("-1")
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for pid in (group / "cgroup.procs").read_text().split():  # one still exiting: out, so the group can go
            with contextlib.suppress(OSError):
                (MEMORY_CGROUPS / "cgroup.procs").write_text(pid)
        group.rmdir()


def states(group: Path) -> str:
    """Where the group's processes are (for a test that failed): state, kernel stack, locked memory."""
    out = [(group / "memory.oom_control").read_text()]
    for pid in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):
            proc = Path("/proc") / pid
            status = [line for line in (proc / "status").read_text().splitlines() if line.startswith(("State", "Vm"))]
            out += [f"{pid} {(proc / 'cmdline').read_bytes()[:200]!r}", *status, (proc / "stack").read_text()]
    return "\n".join(out)


# Loaded by the trainer's interpreter (on its PYTHONPATH; the watcher's, `-I -S`, loads none): at its first import of
# torch, once the watcher is on, the test has set the limit and says go, it takes anonymous memory without end. With
# no swap, anonymous pages cannot be reclaimed: the group reaches its limit for sure and parks the trainer there,
# whatever the page cache holds (a start importing torch under a limit could thrash on its code pages instead).
MEMORY_HOG = """
import os, sys, time

class Hog:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            while not os.path.exists(os.environ["ARTGW_TEST_GO"]):
                time.sleep(0.01)
            held = []
            while True:
                held.append(b"x" * (1 << 20))  # written: every page of it charged to the group

sys.meta_path.insert(0, Hog())
"""


def test_a_start_stalled_on_memory_stops_with_one_line(memory_cgroup: Path, tmp_path: Path) -> None:
    # In the cgroup from its first page on, with no limit until its watcher is on (what the interpreter and the
    # CLI's imports take varies); then 64 MiB more than it holds, which the hook's memory outgrows: parked there,
    # before it reads the store or asks the gateway (neither exists).
    hook, go = tmp_path / "hook", tmp_path / "go"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(MEMORY_HOG)
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    command = [ARTGW, "train", "--model", "my-agent", "--base-model", str(tmp_path), "--data-dir", str(tmp_path)]
    command += ["--gateway", "http://127.0.0.1:9", "--start-memory-stall-seconds", "5"]
    procs = memory_cgroup / "cgroup.procs"
    trainer = subprocess.Popen(
        ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *command],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **TRAINER_ENV, "PYTHONPATH": path, "ARTGW_TEST_GO": str(go)},
        start_new_session=True,
    )
    try:
        poll(lambda: trainer.poll() is not None or watcher_on(trainer.pid), 120, "the start watcher on", every=0.01)
        limit = int((memory_cgroup / "memory.usage_in_bytes").read_text()) + (64 << 20)
        (memory_cgroup / "memory.limit_in_bytes").write_text(str(limit))
        go.touch()
        try:
            output, _ = trainer.communicate(timeout=120)  # generous (24 times the bound): parked, it waits forever
        except subprocess.TimeoutExpired:
            where = states(memory_cgroup)
            os.killpg(trainer.pid, signal.SIGKILL)
            output, _ = trainer.communicate()
            raise AssertionError(f"sat silent past 120 s: {output.decode()[-2000:]}\n{where}") from None
        # the watcher went with it: nothing left in the group
        poll(lambda: not procs.read_text().strip(), 60, "the trainer's processes gone")
    finally:  # never a silent test: whatever failed, nothing of it is left running (the fixture removes the group)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(trainer.pid, signal.SIGKILL)
        if trainer.returncode is None:
            trainer.communicate()
    lines = output.decode(errors="replace").splitlines()
    stalled = [line for line in lines if "waiting for memory" in line]
    assert len(stalled) == 1, lines[-20:]
    assert stalled[0].startswith("artgw train: stalled "), stalled
    assert f"its memory cgroup's limit {limit >> 20} MiB" in stalled[0], stalled
    assert trainer.returncode == -signal.SIGKILL, lines[-20:]
