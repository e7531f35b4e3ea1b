"""`artgw train` that is slow to start says where it is (#39): a trainer once sat silent at start for minutes in
the suite, and nothing it printed said where. `--startup-dump-seconds S` (default 180) has it print every
thread's stack to its log when its first line has not come within S seconds, and its first line disarms that.

A real `artgw train` against a gateway in front of the stand-in engine (tests/stub_engine.py), with S small enough
that any start passes it (the imports of torch alone take longer): the stacks are in the log before the first
line, once, and the trainer then goes on and stops cleanly. With the dump off (0), none.

Out of memory with no swap, a start is not always killed: it thrashes, or (a memory cgroup with its OOM killer
off) is parked at its limit, silent for as long as that lasts: the suite's stuck trainer, one thread in state R,
wchan 0 (artgw/startwatch.py). Such a start stops within `--start-memory-stall-seconds` with one line that says so,
and a failed exit status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

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
    assert "Timeout (0:00:00.200000)!" in before, log[-3000:]
    assert "most recent call first" in before and 'File "' in before, log[-3000:]
    assert log.count("Timeout (") == 1, log[-3000:]
    assert code == 0, trainer.log()[-3000:]


def test_no_stack_with_the_dump_off(gateway: GatewayProcess, tiny_model: Path) -> None:
    trainer = TrainerProcess("trainer-no-dump", gateway, tiny_model, "--startup-dump-seconds", "0", fresh=True)
    try:
        log = started(trainer)
    finally:
        code = trainer.stop()
    assert "Timeout (" not in log and "most recent call first" not in log, log[-3000:]
    assert code == 0, trainer.log()[-3000:]


@pytest.fixture
def parked_at_160_mib() -> Iterator[Path]:
    """A memory cgroup (v1) that parks its processes at 160 MiB, below what importing torch takes, and never kills
    them: a start that has run out of memory, as on a machine without swap, without starving the machine."""
    if not os.access(MEMORY_CGROUPS / "cgroup.procs", os.W_OK):
        pytest.skip("needs cgroup v1's memory controller, writable (root; CI here runs as root)")
    group = MEMORY_CGROUPS / f"artgw-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(160 << 20))
        (group / "memory.oom_control").write_text("1")  # the OOM killer off: parked
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        poll(lambda: not (group / "cgroup.procs").read_text().strip(), 60, "the cgroup's processes to end")
        group.rmdir()


def test_a_start_stalled_on_memory_stops_with_one_line(parked_at_160_mib: Path, tmp_path: Path) -> None:
    # Parked while it imports torch, before it reads the store or asks the gateway: neither needs to exist.
    command = [ARTGW, "train", "--model", "my-agent", "--base-model", str(tmp_path), "--data-dir", str(tmp_path)]
    command += ["--gateway", "http://127.0.0.1:9", "--start-memory-stall-seconds", "5"]
    procs = parked_at_160_mib / "cgroup.procs"
    trainer = subprocess.Popen(
        ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *command],  # in the cgroup from its first page on
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **TRAINER_ENV},
        start_new_session=True,
    )
    try:
        output, _ = trainer.communicate(timeout=300)  # generous: parked, the code before this had it wait forever
    except subprocess.TimeoutExpired:
        os.killpg(trainer.pid, signal.SIGKILL)
        output, _ = trainer.communicate()
        raise AssertionError(f"the trainer sat silent past 300 s; its output: {output.decode()[-2000:]}") from None
    lines = output.decode(errors="replace").splitlines()
    stalled = [line for line in lines if "waiting for memory" in line]
    assert len(stalled) == 1, lines[-20:]
    assert stalled[0].startswith("artgw train: stalled ") and "its memory cgroup's limit 160 MiB" in stalled[0], stalled
    assert trainer.returncode != 0, lines[-20:]
