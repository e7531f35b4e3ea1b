"""`artgw serve --workers N`: N gateway processes on one port in front of its engines.

One process's event loop is its limit (bench/README.md: ~700-900 calls/s at 256 connections on the 2-core
machine); past it, more processes. Each binds the port with
SO_REUSEPORT (the kernel spreads new connections over them) and is a whole gateway, as replicas are
(README: several replicas share one store and one engine): the store is the truth for rollouts, groups and
keys, and a rollout's last call not held by the process its next call lands on is read from the store
(gateway/continuation.py). Only two things are per process and made so here: the journal (each process its
own, `recording.journal.worker_journal_dir`) and the engines (one, or `--engines N`), which are not multiplied:
the first process (this one) supervises them as a single gateway does, the others are given their URLs as
`--upstream` URLs are (each process then keeps its own pool of them: engine/pool.py).

Stopping: a signal to this process is passed on to the workers, which finish their calls and write their
records while the engine still runs; only then does this process stop, and the engine with it. A worker that
dies stops them all (exit 1), for the process manager to start again (its journal is replayed on that start).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from gateway.provide import keep_private, with_engine_ports
from gateway.settings import Settings
from store.provide import open_store

log = logging.getLogger("artgw.workers")
PR_SET_PDEATHSIG = 1  # linux/prctl.h: the signal a process gets when its parent dies
STOP_SECONDS = 120.0  # a worker's graceful stop (30 s for its calls, 30 s for its records) with room to spare


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets listening on one port with SO_REUSEPORT (`port` 0: a free one, the same for all)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    for _ in range(count):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        port = sock.getsockname()[1]
        sock.listen(2048)  # uvicorn's own backlog
        sockets.append(sock)
    return sockets


def worker_settings(settings: Settings, port: int) -> Settings:
    """A worker's settings: the bound port, and the first process's engines (--engines) as its upstreams."""
    settings = dataclasses.replace(settings, port=port, migrate=False)
    if settings.base_model is None:
        return settings
    return dataclasses.replace(settings, base_model=None, upstream=settings.engine_urls, engines=1, engine_ports=())


async def _migrate(url: str) -> None:
    async with open_store(url, migrate_schema=True):  # once, before any worker opens the store
        pass


class _FirstWorker(uvicorn.Server):
    """The first process's server: it passes a stop on to the workers and waits for them before its own
    shutdown (which stops the engine) begins."""

    def __init__(self, config: uvicorn.Config, workers: list[int]) -> None:
        super().__init__(config)
        self.workers = workers
        self.worker_died = False
        self._stopping = False
        self._watchers = [threading.Thread(target=self._watch, args=(pid,), daemon=True) for pid in workers]
        for watcher in self._watchers:
            watcher.start()

    def _watch(self, pid: int) -> None:
        _, status = os.waitpid(pid, 0)  # the only wait on this pid (the engine is another child: never waited here)
        if not self._stopping:
            log.error("gateway worker %d ended (%s): stopping the gateway", pid, _how(status))
            self.worker_died = True
            self.should_exit = True

    def _stop_workers(self) -> None:
        self._stopping = True
        for pid in self.workers:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._stop_workers()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # The workers' calls finish and their records are written while the engine still runs.
        await asyncio.to_thread(self.stop_workers_and_wait)
        await super().shutdown(sockets)

    def stop_workers_and_wait(self) -> None:
        """Stop the workers and wait for them (again: a no-op); SIGKILL any still there after STOP_SECONDS."""
        self._stop_workers()
        deadline = time.monotonic() + STOP_SECONDS
        for watcher in self._watchers:
            watcher.join(max(0.0, deadline - time.monotonic()))
        if any(watcher.is_alive() for watcher in self._watchers):
            log.error("a gateway worker did not stop within %.0f s: killed", STOP_SECONDS)
            for pid in self.workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit {os.waitstatus_to_exitcode(status)}"


ServerFactory = Callable[[uvicorn.Config], uvicorn.Server]
ServeOne = Callable[[Settings, int, socket.socket, ServerFactory], int]


def serve_workers(settings: Settings, serve: ServeOne) -> tuple[int, bool]:
    """Start `settings.workers` processes; `serve(settings, worker, sock, server_factory)` runs one (its app
    and uvicorn server, on `sock`). Returns the first process's exit code and whether a worker died."""
    settings = with_engine_ports(settings)  # chosen once: every worker calls the engines at these ports
    keep_private(settings.data_dir, settings.sqlite_path)
    if settings.migrate:
        asyncio.run(_migrate(settings.db_url))
    sockets = listening_sockets(settings.host, settings.port, settings.workers)
    port = sockets[0].getsockname()[1]
    children = worker_settings(settings, port)
    parent = os.getpid()
    pids: list[int] = []
    for worker in range(1, settings.workers):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                # Never outlive the first process (it supervises the engine these call); Linux with glibc only.
                with contextlib.suppress(OSError, AttributeError):
                    ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
                if os.getppid() == parent:
                    for other in sockets:
                        if other is not sockets[worker]:
                            other.close()
                    code = serve(children, worker, sockets[worker], uvicorn.Server)
            finally:
                os._exit(code)
        pids.append(pid)
    for sock in sockets[1:]:
        sock.close()
    holder: list[_FirstWorker] = []

    def first(config: uvicorn.Config) -> uvicorn.Server:
        holder.append(_FirstWorker(config, pids))
        return holder[0]

    code = serve(dataclasses.replace(settings, port=port, migrate=False), 0, sockets[0], first)
    if holder:  # also when this process's own start failed (uvicorn then runs no shutdown)
        holder[0].stop_workers_and_wait()
    return code, bool(holder and holder[0].worker_died)
