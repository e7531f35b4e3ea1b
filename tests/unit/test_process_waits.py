"""`process_waits`, what a test reports of a process that printed nothing (#39): a trainer once sat silent at start,
state R with wchan 0, and neither dumped its stack nor ended on SIGUSR1. Such a thread is in user space or looping
in the kernel, and a signal it never acts on stays pending: the report shows each thread's system call, kernel
stack and pending signals, which tell those apart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.conftest import poll, process_waits

# SIGUSR1 blocked, then asleep in the kernel: the signal sent to it stays pending.
SLEEPER = """
import signal, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
print("ready", flush=True)
time.sleep(60)
"""


def test_a_silent_process_is_reported_with_its_kernel_stack_and_the_signal_it_never_took() -> None:
    with subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            os.kill(proc.pid, signal.SIGUSR1)
            # once it is in its sleep (between "ready" and the sleep it is still running: a busy machine shows it)
            asleep = f"{proc.pid} S (sleeping)"
            report = poll(
                lambda: (
                    (r := process_waits(proc.pid, native=False))
                    and "ShdPnd=0000000000000200" in r
                    and asleep in r
                    and r
                ),
                30,
                "the sleeper asleep with SIGUSR1 pending",
            )
            assert "SigBlk=0000000000000200" in report, report  # the mask that keeps SIGUSR1 pending
            if os.geteuid() == 0:  # /proc/PID/stack is root's to read
                assert "nanosleep" in report, report  # the kernel function its one thread sleeps in
        finally:
            proc.kill()


def test_a_thread_spinning_in_user_space_shows_no_system_call() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", "print('ready', flush=True)\nwhile True: pass"], stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            report = poll(lambda: (r := process_waits(proc.pid, native=False)) and "syscall=running" in r and r, 30, "")
            assert f"{proc.pid} R (running)" in report, report
        finally:
            proc.kill()
