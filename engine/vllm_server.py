"""vLLM's OpenAI server with its engine core forked instead of spawned, for the supervisor's CPU layout (the model
in the engine core, no worker: engine/supervisor.py `_model_in_engine_core`). Run as a script with vLLM's own
arguments: `python engine/vllm_server.py --model M ...`. vLLM only.

vLLM's CPU platform sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` for every process it starts, so the engine core
imports torch and vLLM again before it loads a model: measured on this 2-core machine with the tests' toy model,
a start cost 20.2 s of CPU (15.1 s of it the two interpreters' imports) and 24.9 s wall; forked, 12.0 s and
15.1 s, the same greedy answer. Forking the engine core from the API server is vLLM's own default wherever no
device runtime is initialized (GPU machines included); its CPU platform forces spawn for the workers of its
multiprocess executor, which this layout does not start. The API server runs no tensor work before the engine
core starts, so no OpenMP thread pool exists to be inherited broken."""

from __future__ import annotations

import os
import runpy
import sys

SERVER = "vllm.entrypoints.openai.api_server"


def _keep_fork() -> None:
    from vllm.platforms.cpu import CpuPlatform

    update = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]  # a classmethod's function

    def check_and_update_config(cls: type[CpuPlatform], vllm_config: object) -> None:
        update(cls, vllm_config)
        if vllm_config.parallel_config.distributed_executor_backend == "uni":  # type: ignore[attr-defined]
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]


if __name__ == "__main__":
    _keep_fork()
    sys.argv[0] = SERVER
    runpy.run_module(SERVER, run_name="__main__", alter_sys=True)
