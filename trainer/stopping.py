"""How `artgw train` is told to stop: SIGINT or SIGTERM sets a `SignalStop`, which the loop checks between steps and
waits on between polls (trainer/lineage.py).

Not a threading.Event: its set() takes the lock its wait() holds for a moment on the main thread, and a signal
handler runs on the main thread between two of its bytecodes. A signal landing in that moment blocks the handler on
a lock its own thread holds, forever. Two SIGTERMs close together make that likely, not rare: the first wakes the
wait, which takes the lock again just as the second arrives; `artgw train --nproc-per-node N` sends its ranks
exactly that (the stop forwarded by the launcher, trainer/distributed.py, after the one a process group gets), and
rank 0 sat in its wait for good (tests/unit/test_stopping.py). Here set() writes a byte to a pipe and wait() selects
on it: nothing a handler can block on.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from typing import Protocol


class Stop(Protocol):
    """What the training loop reads of a stop (a threading.Event too, where no signal sets it)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class SignalStop:
    """A stop that a signal handler (or any thread) may set; set once, it stays set."""

    def __init__(self) -> None:
        self._set = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)

    def set(self) -> None:
        self._set = True
        with contextlib.suppress(BlockingIOError):  # a pipe that full has woken every wait already
            os.write(self._write, b"\0")

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Until set or `timeout` seconds; whether set. A signal whose handler sets it ends the wait at once (select
        is resumed after the handler and finds the byte)."""
        if not self._set:
            select.select([self._read], [], [], timeout)
        return self._set


def stop_on_signals() -> SignalStop:
    """A stop that SIGINT and SIGTERM set (the main thread's handlers, from now on)."""
    stop = SignalStop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    return stop
