"""trainer/stopping.py: the trainer's stop, set by SIGINT/SIGTERM, never blocks its own handler.

The hang it fixes: `artgw train --nproc-per-node 2`, stopped with SIGTERM to its process group, sat for good (the
distributed trainer's test, SIGKILLed after 180 s). Rank 0 gets two SIGTERMs close together, the group's and the
one the launcher forwards; the first woke its threading.Event wait, which took the Event's lock again just as the
second arrived, and the handler's Event.set() waited on that lock, held by its own thread. Here a process waits
on the stop over and over while signals keep coming, so that many land in that moment: with a threading.Event the
process hangs (or overflows its stack, handler inside handler), with SignalStop it ends by itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from tests.conftest import ROOT
from trainer.stopping import SignalStop

WAITING = """
import sys, time
from trainer.stopping import stop_on_signals

stop = stop_on_signals()
print("ready", flush=True)
end, waits = time.monotonic() + float(sys.argv[1]), 0
while time.monotonic() < end:  # on past the stop: every wait is a moment for a signal to land in
    stop.wait(0.0001)
    waits += 1
print(f"{waits} waits, stopped: {stop.is_set()}", flush=True)
"""


def test_signals_landing_on_every_wait_never_block_the_handler() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", WAITING, "3"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        sent = 0
        while proc.poll() is None and sent < 1000:  # ~1 s of SIGTERMs, 1 ms apart, SIGINTs among them
            os.kill(proc.pid, signal.SIGINT if sent % 10 == 9 else signal.SIGTERM)
            sent += 1
            time.sleep(0.001)
        # Bounds a hang, no speed: the waits end 3 s after the start whatever the signals did.
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert sent == 1000 and out.rstrip().endswith("stopped: True"), out


def test_a_stop_set_by_another_thread_ends_a_wait_and_stays_set() -> None:
    stop = SignalStop()
    assert not stop.is_set() and stop.wait(0.01) is False
    threading.Timer(0.1, stop.set).start()
    assert stop.wait(60) is True  # woken by the set, not the bound
    assert stop.is_set() and stop.wait(0) is True
    stop.set()  # again: still set
    assert stop.wait() is True
