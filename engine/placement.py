"""Where each supervised engine runs when the gateway starts several (`artgw serve --engines N`): its port and its
share of the machine's devices, as environment variables for its process. Pure functions of what they are given
(the caller reads the machine), so that the settings can check them at start and tests can try any machine.

With GPUs each engine gets one of its own (`CUDA_VISIBLE_DEVICES`): more engines than GPUs visible is refused,
since two vLLM engines on one GPU each claim most of its memory. On CPU the cores are split: one engine today gets
every core but one (engine/supervisor.py, `OMP_NUM_THREADS`), so N engines share those cores, each a contiguous
slice of its own (`OMP_NUM_THREADS` its size, `VLLM_CPU_OMP_THREADS_BIND` its cores, which vLLM's multiprocess
executor binds its threads to; the supervisor's CPU layout, `uni`, only counts them). With fewer cores than that
the one kept back is given too, and with fewer cores than engines engines share a core.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path


def visible_gpus(environ: Mapping[str, str] = os.environ, dev: Path = Path("/dev")) -> tuple[str, ...]:
    """The GPUs a process may use: `CUDA_VISIBLE_DEVICES`' entries when it is set (empty: none), else one per
    NVIDIA device node."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return tuple(gpu.strip() for gpu in listed.split(",") if gpu.strip())
    nodes = sorted(int(p.name.removeprefix("nvidia")) for p in dev.glob("nvidia[0-9]*") if p.name[6:].isdigit())
    return tuple(str(n) for n in nodes)


def engine_environments(count: int, *, gpus: Sequence[str], cpus: Sequence[int]) -> list[dict[str, str]]:
    """Each of `count` engines' own environment variables: a GPU each of `gpus` when there are any (ValueError
    when there are fewer than engines), else a slice of `cpus` each. One engine gets nothing: it runs as it always
    has (every GPU visible, the supervisor's own thread count)."""
    if count < 1:
        raise ValueError(f"--engines must be >= 1, got {count}")
    if count == 1:
        return [{}]
    if gpus:
        if count > len(gpus):
            raise ValueError(
                f"--engines {count} needs a GPU per engine; {len(gpus)} visible ({','.join(gpus)}): "
                f"give --engines {len(gpus)} or fewer"
            )
        return [{"CUDA_VISIBLE_DEVICES": gpus[i]} for i in range(count)]
    shares = cpu_shares(count, cpus)
    return [{"OMP_NUM_THREADS": str(len(s)), "VLLM_CPU_OMP_THREADS_BIND": _cpu_list(s)} for s in shares]


def this_machines_environments(count: int) -> list[dict[str, str]]:
    """`engine_environments` for this machine: the GPUs visible to this process, else the cores it may run on."""
    return engine_environments(count, gpus=visible_gpus(), cpus=sorted(os.sched_getaffinity(0)))


def cpu_shares(count: int, cpus: Sequence[int]) -> list[list[int]]:
    """`cpus` split into `count` contiguous slices as even as can be, one core kept back (for the gateway, as one
    engine leaves it) when there are more cores than engines; with fewer cores than engines, a core each in turn."""
    cores = sorted(cpus) or [0]
    if len(cores) > count:
        cores = cores[:-1]
    if len(cores) < count:
        return [[cores[i % len(cores)]] for i in range(count)]
    size, extra = divmod(len(cores), count)
    shares, start = [], 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        shares.append(cores[start:end])
        start = end
    return shares


def _cpu_list(cores: Sequence[int]) -> str:
    """vLLM's CPU list syntax (`0-3,6`): ranges of consecutive cores."""
    parts: list[str] = []
    start = prev = cores[0]
    for core in [*cores[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if core is not None:
            start = prev = core
    return ",".join(parts)
