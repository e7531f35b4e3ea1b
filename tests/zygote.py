"""A fork server for the tests' gateways: one process per pytest worker that has imported everything
`artgw serve` imports (~1.2 s of CPU), and forks a gateway from that state instead of starting a fresh
interpreter that imports it all again. The suite starts some 150 gateways on a 2-core machine, where CPU is
what its time is made of.

What a forked gateway shares with one started the usual way: its code and arguments, its environment
(os.environ is replaced before `main` runs; `spawn` refuses to fork where a variable other than ARTGW_*
differs from the worker's, since a library may have read it at import), its working directory, its stdio
(the caller's file descriptors, passed over the socket), its own session (`start_new_session=True`), and its
exit: `main`'s return or exception ends it as the console script would. What it does not: it is the fork
server's child, not the worker's, so `ForkedProcess` stands in for `subprocess.Popen` (pid, poll, wait,
send_signal, returncode): the server reports each child's exit status over the connection that asked for it.

The server is one thread (a fork beside another thread could inherit a lock held mid-operation) and ends when
its pytest worker does. Tests of how `artgw` itself starts (imports, the stack dump, CLI errors) do not use it.

Run: python tests/zygote.py SOCKET_PATH (tests/conftest.py starts it)."""

from __future__ import annotations

import array
import atexit
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_HEADER = struct.Struct("!I")
_FDS = 3  # the child's stdin, stdout and stderr


def serve(path: str) -> None:
    """Import what a gateway imports, then fork one per request until the parent (the pytest worker) is gone."""
    # The import path of the console script `artgw` (its own directory first), not this file's directory.
    sys.path[0] = str(Path(sys.executable).parent)
    import uvicorn  # noqa: F401

    import artgw.cli  # noqa: F401  (what `artgw serve` imports before it serves)
    import gateway.app
    import gateway.server  # noqa: F401

    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            connection, _ = listener.accept()
            request, fds = _receive(connection)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in waiting.values():
                    other.close()
                _become(request, fds, connection)  # does not return here: the child runs `artgw` from there
                return
            for fd in fds:
                os.close(fd)
            connection.sendall(f"{pid}\n".encode())
            waiting[pid] = connection
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = waiting.pop(pid, None)
            if connection is not None:
                with contextlib.suppress(OSError):
                    connection.sendall(f"{status}\n".encode())
                connection.close()
    for pid in waiting:  # the worker is gone: so are its gateways, as if they were its own children
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _become(request: dict[str, Any], fds: list[int], connection: socket.socket) -> None:
    """In the forked child: take the caller's session, stdio, directory and environment, then run `artgw`."""
    import random

    connection.close()
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # stdout as a fresh interpreter would open it on these descriptors (unbuffered where PYTHONUNBUFFERED says so)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdout = open(1, "w", buffering=1 if unbuffered else -1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    random.seed()  # not the server's sequence, shared by every child
    sys.argv = list(request["argv"])
    from artgw.cli import main

    sys.exit(main(sys.argv[1:]))


def _receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = connection.recvmsg(1 << 16, socket.CMSG_SPACE(_FDS * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    (size,) = _HEADER.unpack_from(data)
    body = data[_HEADER.size :]
    while len(body) < size:
        body += connection.recv(size - len(body))
    return json.loads(body), list(fds)


class ForkedProcess:
    """A gateway the fork server started for this worker, where a test expects a `subprocess.Popen`."""

    def __init__(self, args: list[str], connection: socket.socket, pid: int) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._connection = connection

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read_status(self) -> None:
        line = b""
        while not line.endswith(b"\n"):
            chunk = self._connection.recv(64)
            if not chunk:  # the server is gone without a word: the child is unknown, say it ended
                self.returncode = -signal.SIGKILL
                return
            line += chunk
        self.returncode = os.waitstatus_to_exitcode(int(line))
        self._connection.close()


class _Server:
    """This worker's fork server, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._path: str | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def path(self) -> str:
        with self._lock:
            if self._path is None:
                where = Path(os.environ.get("TMPDIR", "/tmp")) / f"artgw-zygote-{os.getpid()}.sock"
                where.unlink(missing_ok=True)
                self._process = subprocess.Popen(
                    [sys.executable, __file__, str(where)],
                    stdin=subprocess.DEVNULL,
                    cwd=Path(__file__).resolve().parents[1],
                )
                atexit.register(self._stop, where)
                deadline = time.monotonic() + 60
                while not where.exists():
                    if self._process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the tests' fork server did not start ({self._process.returncode})")
                    time.sleep(0.02)
                self._path = str(where)
            return self._path

    def _stop(self, where: Path) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
        where.unlink(missing_ok=True)


_server = _Server()


def forkable(env: dict[str, str]) -> bool:
    """Whether a gateway with this environment may be forked: only ARTGW_* variables (read when `main` runs)
    may differ from this process's, and ARTGW_TEST_FORK=0 turns forking off."""
    if os.environ.get("ARTGW_TEST_FORK", "1") == "0":
        return False
    keys = set(env) | set(os.environ)
    return all(key.startswith("ARTGW_") or env.get(key) == os.environ.get(key) for key in keys)


def spawn(argv: list[str], *, stdout: int, env: dict[str, str], cwd: str | None = None) -> ForkedProcess:
    """`argv` (an `artgw` command line) forked from the server with stdin from /dev/null, stdout and stderr
    to `stdout`, in a session of its own."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(_server.path())
    body = json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd()}).encode()
    with open(os.devnull, "rb") as devnull:
        fds = array.array("i", [devnull.fileno(), stdout, stdout])
        connection.sendmsg([_HEADER.pack(len(body)) + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    line = b""
    while not line.endswith(b"\n"):
        chunk = connection.recv(64)
        if not chunk:
            raise RuntimeError("the tests' fork server closed the connection before forking")
        line += chunk
    return ForkedProcess(argv, connection, int(line))


if __name__ == "__main__":
    serve(sys.argv[1])
