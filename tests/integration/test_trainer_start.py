"""`artgw train` that is slow to start says where it is (#39): a trainer once sat silent at start for minutes in
the suite, and nothing it printed said where. `--startup-dump-seconds S` (default 180) has it print every
thread's stack to its log when its first line has not come within S seconds, and its first line disarms that.

A real `artgw train` against a gateway in front of the stand-in engine (tests/stub_engine.py), with S small enough
that any start passes it (the imports of torch alone take longer): the stacks are in the log before the first
line, once, and the trainer then goes on and stops cleanly. With the dump off (0), none.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import GatewayProcess, TrainerProcess, gateway_on_stub, poll

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
