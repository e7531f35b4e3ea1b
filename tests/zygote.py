"""Fork servers for the tests' gateways and trainers: per pytest worker, one process that has imported everything
`artgw serve` imports (~1.2 s of CPU) and forks a gateway from that state instead of starting a fresh
interpreter that imports it all again; and, started on the worker's first trainer, one that has imported what
`artgw train` imports before it trains (torch, transformers, peft: ~5 s of CPU). The suite starts some 150
gateways and ~45 trainers on a 2-core machine, where CPU is what its time is made of. Two servers, not one that
imports both: a worker that never trains does not pay for torch, and a gateway is not forked from a process
that holds it.

What a forked command shares with one started the usual way: its code and arguments, its environment
(os.environ is replaced before `main` runs; `Server.forkable` says no where a variable other than ARTGW_*
differs from the worker's, since a library may have read it at import), its working directory, its stdio
(the caller's file descriptors, passed over the socket), its own session (`start_new_session=True`), and its
exit: the console script runs in the child (`runpy`, as `__main__`: `artgw train --nproc-per-node 2` starts
its ranks with multiprocessing's `spawn`, which runs the parent's `__main__` again in each, fresh interpreters
as without the server). What it does not: it is the fork server's child, not the worker's, so `ForkedProcess`
stands in for `subprocess.Popen` (pid, poll, wait, send_signal, returncode): the server reports each child's
exit status over the connection that asked for it, and reaps the child only once that connection is closed
(after `wait` or a `poll` that saw the exit), so a `killpg` between finds its zombie as with Popen. Also shared
by every child: the server's hash seed (PYTHONHASHSEED); `random`'s and numpy's generators are seeded anew.

The server is one thread (a fork beside another thread could inherit a lock held mid-operation: it refuses to
serve if its imports started one; torch's OpenMP pool starts on the first parallel op, never at import) and
ends when its pytest worker does. Tests of how `artgw` itself starts (imports, the stack dump, start-up time,
CLI errors) do not use it.

Run: python tests/zygote.py SOCKET_PATH KIND (tests/conftest.py starts it; KIND: serve or train)."""

from __future__ import annotations

import array
import atexit
import contextlib
import gc
import importlib
import io
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

# What each kind of server imports before it forks: what the command imports before it does its work.
PRELOAD = {
    "serve": (
        *("uvicorn", "artgw.cli", "gateway.app", "gateway.server"),
        # and what a gateway imports while it starts (~0.3 s of CPU a gateway, measured): Litestar's pydantic
        # plugin (a default once pydantic is importable) and the parts its app build loads, the store's driver,
        # uvicorn's loop and protocols, httpx's transports (anyio, HTTP/2, trio), the span attributes
        *("litestar.plugins.pydantic", "aiosqlite", "uvloop", "uvicorn.loops.auto", "uvicorn.lifespan.on"),
        *("uvicorn.protocols.http.auto", "uvicorn.protocols.websockets.auto", "httpcore", "h2.connection", "trio"),
        *("opentelemetry.semconv.attributes.http_attributes", "anyio._backends._asyncio", "anyio.streams.tls"),
        *("litestar._kwargs.kwargs_model", "litestar.exceptions.responses", "litestar.logging.standard"),
        *("litestar.middleware._internal.exceptions.middleware", "litestar.plugins.attrs", "uvicorn.loops.uvloop"),
    ),
    "train": (
        "artgw.cli",
        "trainer.train",  # torch, the store's client, the trainer's modules
        "trainer.loss",
        "transformers",
        "transformers.models.qwen2.modeling_qwen2",  # the tiny model's
        "transformers.models.llama.modeling_llama",  # the real model's (SmolLM2)
        "peft",
        "safetensors",
        "torch.nn.parallel",
        "torch.distributed.launcher.api",  # --nproc-per-node N: the elastic agent in the CLI process
    ),
}


def serve(path: str, kind: str) -> None:
    """Import what `artgw KIND` imports, then fork one per request until the parent (the pytest worker) is gone."""
    # The import path of the console script `artgw` (its own directory first), not this file's directory.
    sys.path[0] = str(Path(sys.executable).parent)
    for module in PRELOAD[kind]:
        importlib.import_module(module)
    if kind == "train":
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (lazy in transformers)
    # What the imports made lives as long as every child: out of the collector's sight, a child's collections walk
    # only what it makes (the gateway's full collection before it serves took ~0.1 s of CPU walking the imports').
    gc.collect()
    gc.freeze()
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:  # a child would inherit a lock another thread may hold, and hang
        sys.exit(f"the {kind} fork server's imports started {len(threads) - 1} thread(s): it cannot fork safely")

    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    running: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
    ended: dict[socket.socket, int] = {}  # connection told of its child's exit -> the child, reaped when it closes
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, *ended], [], [], 0.05)
        for connection in ready:
            if connection is not listener:  # closed (or anything else said): the caller has the status
                os.waitpid(ended.pop(connection), 0)
                connection.close()
                continue
            connection, _ = listener.accept()
            request, fds = _receive(connection)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in [*running.values(), *ended]:
                    other.close()
                _become(request, fds, connection)  # does not return here: the child runs `artgw` from there
                return
            for fd in fds:
                os.close(fd)
            connection.sendall(f"{pid}\n".encode())
            running[pid] = connection
        for pid, connection in list(running.items()):
            # WNOWAIT: the child stays a zombie, its process group there for a killpg, until its caller knows.
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is None:
                continue
            del running[pid]
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            try:
                connection.sendall(f"{code}\n".encode())
                ended[connection] = pid
            except OSError:  # the caller is gone
                os.waitpid(pid, 0)
                connection.close()
    for pid in [*running, *ended.values()]:  # the worker is gone: so are its children, as if they were its own
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _become(request: dict[str, Any], fds: list[int], connection: socket.socket) -> None:
    """In the forked child: take the caller's session, stdio, directory and environment, then run `artgw`."""
    import random
    import runpy

    connection.close()
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # stdout and stderr as a fresh interpreter opens them on these descriptors (PYTHONUNBUFFERED: write through)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for name, fd, errors in (("stdout", 1, sys.stdout.errors), ("stderr", 2, "backslashreplace")):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            encoding=sys.stdout.encoding,
            errors=errors,
            line_buffering=name == "stderr",
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    random.seed()  # not the server's sequence, shared by every child
    if "numpy" in sys.modules:  # likewise numpy's, seeded when the server imported it
        sys.modules["numpy"].random.seed()
    sys.argv = list(request["argv"])
    runpy.run_path(sys.argv[0], run_name="__main__")  # the console script: it exits with `main`'s code


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
    """A command a fork server started for this worker, where a test expects a `subprocess.Popen`."""

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
        self.returncode = int(line)
        self._connection.close()  # the server reaps the child now


class Server:
    """One of this worker's fork servers (`kind`: what it preloads), started on first use with this worker's
    environment (`base`, else os.environ then) and `env` over it."""

    def __init__(self, kind: str, env: dict[str, str] | None = None) -> None:
        self.kind = kind
        self._extra = dict(env or {})
        self._lock = threading.Lock()
        self._path: str | None = None
        # The worker's environment to start it with (`env` over it); None: os.environ as it is then.
        self.base: dict[str, str] | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def forkable(self, env: dict[str, str]) -> bool:
        """Whether a command with this environment may be forked from this server: only ARTGW_* variables (read
        when `main` runs) may differ from this worker's (with the server's `env` over it: a library may have
        read any other at import), and ARTGW_TEST_FORK=0 turns forking off."""
        if os.environ.get("ARTGW_TEST_FORK", "1") == "0":
            return False
        own = {**os.environ, **self._extra}
        return all(key.startswith("ARTGW_") or env.get(key) == own.get(key) for key in set(env) | set(own))

    def spawn(self, argv: list[str], *, stdout: int, env: dict[str, str], cwd: str | None = None) -> ForkedProcess:
        """`argv` (an `artgw` command line) forked from the server with stdin from /dev/null, stdout and stderr
        to `stdout`, in a session of its own."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self._started())
        body = json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd()}).encode()
        with open(os.devnull, "rb") as devnull:
            fds = array.array("i", [devnull.fileno(), stdout, stdout])
            connection.sendmsg([_HEADER.pack(len(body)) + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        line = b""
        while not line.endswith(b"\n"):
            chunk = connection.recv(64)
            if not chunk:
                raise RuntimeError(f"the tests' {self.kind} fork server closed the connection before forking")
            line += chunk
        return ForkedProcess(argv, connection, int(line))

    def _started(self) -> str:
        with self._lock:
            if self._path is None:
                where = Path(os.environ.get("TMPDIR", "/tmp")) / f"artgw-zygote-{self.kind}-{os.getpid()}.sock"
                where.unlink(missing_ok=True)
                self._process = subprocess.Popen(
                    [sys.executable, __file__, str(where), self.kind],
                    stdin=subprocess.DEVNULL,
                    cwd=Path(__file__).resolve().parents[1],
                    env={**(self.base or os.environ), **self._extra},
                )
                atexit.register(self._stop, where)
                deadline = time.monotonic() + 120
                while not where.exists():
                    if self._process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the tests' {self.kind} fork server did not start ({self._process.returncode})"
                        )
                    time.sleep(0.02)
                self._path = str(where)
            return self._path

    def _stop(self, where: Path) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
        where.unlink(missing_ok=True)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
