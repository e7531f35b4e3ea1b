"""A starting `artgw train` that stalls on memory says so and stops, rather than sitting silent (#39).

Out of memory with no swap (this project's machines have none), the kernel does not always kill: it evicts the
code pages a starting process runs (python's, torch's shared objects) and the process faults them back in, over
and over, in the kernel: one thread in state R or D, wchan 0, no user time, no output, for as long as the
pressure lasts; a memory cgroup whose OOM killer is off just parks it. Nothing in the process can report that
(its one thread is the stuck one, and holds the GIL), so a second interpreter watches it from outside: `arm`
starts it; `disarm` (the trainer: once its models are loaded) or the process's exit ends it. A second of the
process's start is "stalled on memory" when, over the last `seconds` (`stalled_on_memory`, judged on the whole
window: a thrash has bursts of user time, a second-by-second judgement reset on each), it made under 5 % user time and
in most of its seconds it was parked (its memory cgroup at its limit, the OOM killer off) or faulting pages back
in while memory pressure (PSI) grew. Then one line on stderr and SIGKILL: its exit status says it failed.

It also says where a slow start is: if the process has not printed its first line (`started`) within
`dump_seconds`, the watcher sends it SIGUSR1, whose handler (faulthandler's, registered when the `artgw` package is
imported) prints every thread's stack, once. From a signal handler on the process's own thread: faulthandler's
`dump_traceback_later`, a thread of the process reading the frames of a thread that runs on, can crash the
process it watches (SIGSEGV, seen in this project's tests).

The watcher runs as `python -P -s -S startwatch.py PID SECONDS DUMP_SECONDS PROG` and imports only the standard
library. Its stdin: a byte `started`; closed, the start is over (or the process exited).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

PERIOD = 1.0  # seconds between looks at the process
USER_SHARE = 0.05  # below this share of the window in user time, the process made no progress
TICKS = os.sysconf("SC_CLK_TCK")  # /proc/PID/stat's clock ticks a second
HEAP = 16 << 20  # bytes of heap the watcher has before the start goes on: many times what its loop allocates
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters
READY_WAIT = 10.0  # seconds a start waits for its watcher to be on (then goes on without waiting)
_armed: list[subprocess.Popen[bytes]] = []


def arm(prog: str, seconds: float, dump_seconds: float) -> None:
    """Watch this process until `disarm` or its exit: for a stall on memory of `seconds`, and for no first line
    (`started`) within `dump_seconds`; 0: not for that one."""
    if (seconds <= 0 and dump_seconds <= 0) or not Path(f"/proc/{os.getpid()}/stat").exists():  # no procfs
        return
    # Isolated as -I is (no script directory, site, user site, nor PYTHON* variable) but for one: every allocation
    # through malloc, whose heap `steady` makes large enough beforehand (pymalloc maps fresh arenas as it goes).
    command = [sys.executable, "-P", "-s", "-S", __file__, str(os.getpid()), str(seconds), str(dump_seconds), prog]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PYTHONMALLOC": "malloc"}
    watcher = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=environment)
    _armed.append(watcher)
    # On once its pages are in memory and locked, before this process's start takes the memory: a watcher still
    # starting when the memory runs out would be parked or thrash with it (the same memory cgroup), and say nothing.
    if watcher.stdout is not None and select.select([watcher.stdout], [], [], READY_WAIT)[0]:
        os.read(watcher.stdout.fileno(), 1)


def started() -> None:
    """The process printed its first line: no stack dump for a slow start."""
    for watcher in _armed:
        if watcher.stdin is not None:
            with contextlib.suppress(OSError):  # the watcher is gone (it acted, or was killed)
                watcher.stdin.write(b"s")
                watcher.stdin.flush()


def disarm() -> None:
    """The start is over: the watcher sees its stdin close and exits (the same as when this process exits)."""
    while _armed:
        watcher = _armed.pop()
        if watcher.stdin is not None:
            watcher.stdin.close()
        watcher.wait()


class Sample(NamedTuple):
    at: float
    user_ticks: int
    major_faults: int
    pressure_us: int  # memory stall time ("some"), the process's cgroup's where it has one, else the machine's
    parked: bool  # its memory cgroup at its limit with the OOM killer off


class Files:
    """What the watcher reads, opened once, while memory is still there: the watcher is in the process's memory
    cgroup, where opening a file (its kernel buffer) fails once the group is at its limit; reading an open one
    again from its start needs no new buffer."""

    def __init__(self, pid: int) -> None:
        self.stat = self._open(f"/proc/{pid}/stat")
        v1, v2 = memory_cgroup(pid)
        self.pressure = self._open(v2 / "memory.pressure" if v2 else "") or self._open("/proc/pressure/memory")
        self.oom = self._open(v1 / "memory.oom_control" if v1 else "")
        self.limit = self._open(v1 / "memory.limit_in_bytes" if v1 else v2 / "memory.max" if v2 else "")
        self.meminfo = self._open("/proc/meminfo")

    @staticmethod
    def _open(path: Path | str) -> int | None:
        try:
            return os.open(path, os.O_RDONLY) if path else None
        except OSError:
            return None

    @staticmethod
    def read(fd: int | None) -> str:
        try:
            return os.pread(fd, 1 << 16, 0).decode() if fd is not None else ""
        except OSError:  # ESRCH: the process is gone; ENOMEM: no memory for this read, try again next time
            return ""


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def memory_cgroup(pid: int) -> tuple[Path | None, Path | None]:
    """The process's memory cgroup directory: (cgroup v1's, cgroup v2's); None where it has none."""
    v1 = v2 = None
    for line in _read(Path(f"/proc/{pid}/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
        elif controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            candidate = Path("/sys/fs/cgroup") / path.lstrip("/")
            v2 = candidate if (candidate / "memory.max").exists() else None
    return v1, v2


def sample(files: Files) -> Sample | None:
    """None: nothing read this time (no memory for the read, or the process is gone)."""
    stat = files.read(files.stat)
    if not stat:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    some = next((line for line in files.read(files.pressure).splitlines() if line.startswith("some ")), "")
    parked = "under_oom 1" in files.read(files.oom)
    return Sample(time.monotonic(), int(fields[11]), int(fields[9]), int(some.rpartition("total=")[2] or 0), parked)


def stalled_on_memory(window: Sequence[Sample], seconds: float) -> bool:
    """The samples (oldest first) cover `seconds`, the process made under USER_SHARE of them in user time, and in
    most of their periods it was parked, or faulting while the memory pressure grew. On the window as a whole: a
    thrashing process gets bursts of user time between its faults, and a healthy start that waits (for the disk,
    the network, a busy machine) makes little user time but neither parks nor faults under pressure."""
    if len(window) < 2 or window[-1].at - window[0].at < seconds:
        return False
    first, last = window[0], window[-1]
    if (last.user_ticks - first.user_ticks) / TICKS >= USER_SHARE * (last.at - first.at):
        return False
    periods = list(itertools.pairwise(window))
    thrashing = sum(now.major_faults > before.major_faults for before, now in periods)
    pressure = last.pressure_us > first.pressure_us
    parked = sum(now.parked for _, now in periods)
    return (last.parked and 2 * parked >= len(periods)) or (pressure and 2 * thrashing >= len(periods))


def memory_left(files: Files) -> str:
    """What memory there is: the machine's available, and the process's cgroup's limit where it has one."""
    meminfo = dict(line.split(":", 1) for line in files.read(files.meminfo).splitlines() if ":" in line)
    available = int(meminfo.get("MemAvailable", "0 kB").split()[0]) >> 10
    swap = "" if int(meminfo.get("SwapTotal", "0 kB").split()[0]) else ", no swap"
    limit = files.read(files.limit).strip()
    capped = limit.isdigit() and int(limit) < 1 << 60
    cgroup = f", its memory cgroup's limit {int(limit) >> 20} MiB" if capped else ""
    return f"{available} MiB available{swap}{cgroup}"


def steady(files: Files) -> None:
    """Everything the loop needs, in memory and kept there, before the memory runs out: the watcher shares the
    process's memory cgroup, and a page it faulted in then (its own, or code evicted by the process's thrashing)
    would park it or thrash it beside the process it watches."""
    gc.disable()  # nothing cyclic is made here
    first = sample(files)
    if first is not None:
        stalled_on_memory([first, first._replace(at=first.at + 1)], 1.0)  # every line of it run once
    memory_left(files)
    with contextlib.suppress(OSError, AttributeError):  # not root: RLIMIT_MEMLOCK is most often too small
        libc = ctypes.CDLL(None, use_errno=True)
        # A page the loop's allocations touch for the first time once the group is at its limit would park the
        # watcher beside the process: every allocation from one heap (no mmap), never given back (no trim),
        # grown beforehand by HEAP bytes written.
        libc.mallopt(M_MMAP_MAX, 0)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
        ctypes.memset(ctypes.create_string_buffer(HEAP), 1, HEAP)
        libc.mlockall(1)  # MCL_CURRENT: every page mapped now stays in memory


def watch(pid: int, seconds: float, dump_seconds: float, prog: str) -> int:
    files = Files(pid)
    steady(files)
    os.write(1, b"r")  # on: the process's start goes on
    window: deque[Sample] = deque()  # the samples of the last `seconds`, and the one before them
    dump_at = time.monotonic() + dump_seconds if dump_seconds > 0 else None
    while True:
        wait = PERIOD if dump_at is None else max(0.0, min(PERIOD, dump_at - time.monotonic()))
        if select.select([sys.stdin], [], [], wait)[0]:
            if not os.read(sys.stdin.fileno(), 1):
                return 0  # stdin closed: disarmed, or the process exited (this watcher is its child)
            dump_at = None  # its first line
        if os.getppid() != pid:
            return 0
        if dump_at is not None and time.monotonic() >= dump_at:
            dump_at = None
            with contextlib.suppress(OSError):  # no memory for it: the stacks still come
                os.write(2, f"{prog}: no first line after {dump_seconds:g} s; every thread's stack:\n".encode())
            os.kill(pid, signal.SIGUSR1)
        if seconds <= 0:
            continue
        now = sample(files)
        if now is None:
            continue  # no memory to read with (or gone, and stdin says so next)
        window.append(now)
        while len(window) > 2 and window[1].at <= now.at - seconds:
            window.popleft()
        if stalled_on_memory(window, seconds):
            line = (
                f"{prog}: stalled {now.at - window[0].at:.0f} s at start waiting for memory ({memory_left(files)}): "
                "stopped rather than left hanging; free memory or give it more\n"
            )
            # Killed first, said after: at its cgroup's limit, a write to stderr (a pipe's page, a file's page
            # cache, both charged to the group) fails with ENOMEM, and an error here left the process parked and
            # nothing said (seen in this project's test). Gone, the process frees what it held.
            os.kill(pid, signal.SIGKILL)
            said(line.encode(), lambda: os.getppid() != pid)
            return 1


def said(line: bytes, gone: Callable[[], bool], tries: int = 100) -> None:
    """`line` on stderr, once: tried again (0.1 s apart) while it fails, as it does until the killed process is
    `gone` and its memory with it."""
    for attempt in range(tries):
        if gone() or attempt == tries - 1:
            with contextlib.suppress(OSError):
                os.write(2, line)  # stderr's file descriptor: no buffer to allocate on the way
                return
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]))
