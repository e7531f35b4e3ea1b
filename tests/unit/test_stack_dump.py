"""`kill -USR1` on any `artgw` process prints every thread's stack, from the moment the package is imported (#39):
a trainer once sat silent at start and the signal, which only `main()` handled then, ended it instead of saying
where it was. Importing `artgw` (what the console script does first) must register the dump before anything
heavy is imported."""

from __future__ import annotations

import subprocess
import sys

# A process that has imported only the package, then signals itself: it lives on, with its stack on stderr.
SCRIPT = """
import os, signal, sys
import artgw
assert "gateway" not in sys.modules and "msgspec" not in sys.modules, "artgw's package import loaded more"
os.kill(os.getpid(), signal.SIGUSR1)
print("still running")
"""


def test_importing_the_package_makes_sigusr1_print_the_stack_and_not_end_the_process() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "still running"
    assert "most recent call first" in done.stderr and 'File "<string>"' in done.stderr, done.stderr
