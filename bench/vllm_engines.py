"""Real vLLM engines for the benches: started together (their starts overlap), each waited for at its `/health`,
stopped (their process group) on leaving.

    with vllm_engines(model, where, count=2) as engines:
        for url, proc in engines: ...
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from engine.supervisor import EngineConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    """Whether the engine at `url` answers its /health with 200 (within 2 s)."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def vllm_engines(
    model: Path,
    where: Path,
    *,
    count: int = 1,
    extra: Sequence[str] = (),
    served_name: str = "tiny",
    max_model_len: int = 4096,
    timeout: float = 600.0,
) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """`count` vLLM servers of `model` as the supervised engine runs it (its command line, `extra` appended), their
    logs `where/vllm-N.log`; (url, process) each, once every one answers /health."""
    started: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        for n in range(count):
            config = EngineConfig(
                base_model=str(model),
                served_name=served_name,
                port=free_port(),
                max_model_len=max_model_len,
                log_path=where / f"vllm-{n}.log",
                extra_args=tuple(extra),
            )
            started.append((config.url, config.start_unsupervised()))
        deadline = time.monotonic() + timeout
        for n, (url, proc) in enumerate(started):
            while not healthy(url):
                if proc.poll() is not None:
                    log_text = (where / f"vllm-{n}.log").read_text(errors="replace")[-3000:]
                    raise SystemExit(f"vLLM exited ({proc.returncode}); its log:\n{log_text}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"vLLM at {url} did not answer /health in {timeout:.0f} s")
                time.sleep(0.2)
        yield started
    finally:
        for _, proc in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc in started:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
