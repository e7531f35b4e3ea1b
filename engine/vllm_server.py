"""`python -m engine.vllm_server ARGS`: vLLM's OpenAI server (`vllm.entrypoints.openai.api_server`, same ARGS),
its engine core forked from the API server rather than spawned, on CPU.

vLLM's CPU platform sets every child's start method to `spawn` (for the workers of its `mp` layout, which start
OpenMP thread pools of their own), and the engine core is then a fresh interpreter that imports vLLM, torch and
transformers again: measured with the tests' toy model on 2 cores, 15 s of the 37 s an engine took to start,
all of it CPU (bench/engine_layout.py). The API server has run no tensor code when it starts its engine core, so
a fork copies an interpreter that already holds those modules: the same start took 22 s. That is vLLM's own
default on GPU machines, where the API server forks its engine core unless CUDA is already initialized.

Only the engine core's start is changed, and only when the fork is safe: on the CPU build, where the API server's
only threads besides its main one are ZeroMQ's I/O threads (which vLLM's GPU default forks beside too: the child
makes contexts of its own). Any other thread (an OpenMP pool, a library's worker) could be holding a lock at the
fork that the child would wait on forever, and then the engine core is spawned as before. A ZeroMQ thread names
itself once running, so a just-started one is waited for (NAMING_WAIT). Hugging Face tokenizers' thread pool,
started by a batch encode (Qwen3's tokenizer at the API server's start), is kept from starting
(TOKENIZERS_PARALLELISM=false unless set): its threads are nameless like OpenMP's. The engine core's own children
(the `mp` layout's workers) keep vLLM's `spawn`.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import os
import runpy
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

API_SERVER = "vllm.entrypoints.openai.api_server"
FORK_SAFE_THREADS = ("ZMQbg/",)  # name prefixes of the threads a fork may leave behind (see above)
FORKED, SPAWNED = "Forking the engine core", "Spawning the engine core"  # the engine log's line, each start
NAMING_WAIT = 2.0  # seconds the threads may take to show ZeroMQ's names before the engine core is spawned instead

# Under vLLM's logger, whose handler and format the API server's lines have: "(APIServer pid=N) INFO ... [file:line]".
logger = logging.getLogger("vllm.artgw.vllm_server")


def other_threads(task_dir: Path = Path("/proc/self/task")) -> list[str]:
    """The names of this process's threads other than the calling one (Linux: /proc/self/task/*/comm); a thread
    that ended while they were read is left out."""
    this = threading.get_native_id()
    names = []
    for task in task_dir.iterdir():
        if int(task.name) != this:
            try:
                names.append((task / "comm").read_text().strip())
            except FileNotFoundError:  # ended between the listing and the read
                continue
    return names


def fork_is_safe(threads: list[str]) -> bool:
    """Whether a process whose other threads are named `threads` may fork a child that runs Python and torch."""
    return all(name.startswith(FORK_SAFE_THREADS) for name in threads)


def forking_when_safe(
    vllm_context: Callable[[], multiprocessing.context.BaseContext],
) -> Callable[[], multiprocessing.context.BaseContext]:
    """vLLM's `get_mp_context` for the engine core's start: fork where `fork_is_safe`, else vLLM's own choice."""

    def context() -> multiprocessing.context.BaseContext:
        chosen = vllm_context()
        if chosen.get_start_method() != "spawn":
            return chosen
        deadline = time.monotonic() + NAMING_WAIT
        threads = other_threads()
        while not fork_is_safe(threads) and time.monotonic() < deadline:
            time.sleep(0.01)
            threads = other_threads()
        if fork_is_safe(threads):
            logger.info("%s from the API server (its other threads: %s)", FORKED, ", ".join(threads) or "none")
            return multiprocessing.get_context("fork")
        logger.info("%s: the API server runs threads a fork could leave holding a lock (%s)", SPAWNED, threads)
        return chosen

    return context


def main() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import vllm.v1.engine.utils as engine_utils  # where the engine core's process is made (CoreEngineProcManager)

        engine_utils.get_mp_context = forking_when_safe(engine_utils.get_mp_context)  # type: ignore[attr-defined]
    sys.argv[0] = API_SERVER
    runpy.run_module(API_SERVER, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
