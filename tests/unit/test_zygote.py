"""The tests' fork servers (tests/zygote.py) hand out processes that behave as `subprocess.Popen`'s: in particular
a process that has ended stays a zombie until its caller has read its exit status, so `stop_group`'s
`poll()` then `killpg` finds it even when it ended between the two (a server that reaped it at once made that
killpg fail with ProcessLookupError, now and then, and could signal a new process given the same pid)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.conftest import ARTGW, GATEWAYS, poll


def state(pid: int) -> str | None:
    """The process's state letter (R, S, Z, ...), None once it is reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return None


def test_a_forked_process_that_ended_stays_for_killpg_until_its_status_is_read(tmp_path: Path) -> None:
    with (tmp_path / "help.log").open("wb") as log:
        proc = GATEWAYS.spawn([ARTGW, "serve", "--help"], stdout=log.fileno(), env=dict(os.environ))
    poll(lambda: state(proc.pid) in ("Z", None), 60, "the forked command to end", every=0.05)
    time.sleep(0.5)  # ten turns of the server's loop, which reaped what ended on the next one
    assert state(proc.pid) == "Z"  # ended, not reaped: its caller has not asked
    os.killpg(proc.pid, signal.SIGTERM)  # as stop_group does after a poll() that saw it running
    assert proc.wait(60) == 0
    poll(lambda: state(proc.pid) is None, 60, "the server to reap it once its status was read", every=0.05)
    assert "usage: artgw serve" in (tmp_path / "help.log").read_text()
