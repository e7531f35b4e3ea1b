"""What vLLM's process layout costs on CPU: the tests' toy model served by the supervised command line, once in
vLLM's multiprocess layout (API server, engine core, worker: `--distributed-executor-backend mp`) and once with
the model in the engine core (`uni`: what `engine/supervisor.py` runs on CPU), one after the other, with the same
bursts of chat calls. CPU is summed over the engine's process tree (psutil), the second and a half after each burst
included: the multiprocess layout's engine core and worker busy-wait on their shared-memory queue for a second after
every message.

    .venv/bin/python bench/engine_layout.py [--rounds 2]

Run it alone: two cores shared with anything else make the figures meaningless.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from artgw.tiny_model import build_tiny_model  # noqa: E402
from bench.vllm_engines import vllm_engines  # noqa: E402

LAYOUTS = {"with a worker (vLLM's)": ("--distributed-executor-backend", "mp"), "without (ours)": ()}
BURSTS = [(1, 20, 16), (8, 64, 32), (32, 128, 24)]  # (concurrent calls, calls, tokens each)
SETTLE = 1.5  # seconds after a burst whose CPU still counts


def tree_cpu(root: psutil.Process) -> float:
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


async def burst(url: str, concurrent: int, calls: int, tokens: int) -> None:
    limit = asyncio.Semaphore(concurrent)
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(i: int) -> None:
            async with limit:
                body = {
                    "model": "tiny",
                    "messages": [{"role": "user", "content": f"hello {i}"}],
                    "max_tokens": tokens,
                    "ignore_eos": True,
                    "logprobs": True,  # the gateway always asks for them
                }
                answer = await client.post(f"{url}/v1/chat/completions", json=body)
                answer.raise_for_status()

        await asyncio.gather(*(one(i) for i in range(calls)))


def measure(model: Path, extra: tuple[str, ...], where: Path) -> dict[str, tuple[float, float]]:
    """{what: (CPU s, wall s)} for the start and each burst of one engine in this layout."""
    started = time.monotonic()
    with vllm_engines(model, where, extra=extra) as [(url, proc)]:
        root = psutil.Process(proc.pid)
        figures = {"start": (tree_cpu(root), time.monotonic() - started)}
        for concurrent, calls, tokens in BURSTS:
            cpu, wall = tree_cpu(root), time.monotonic()
            asyncio.run(burst(url, concurrent, calls, tokens))
            wall = time.monotonic() - wall
            time.sleep(SETTLE)
            figures[f"{calls} calls x {tokens} tokens, {concurrent} at once"] = (tree_cpu(root) - cpu, wall)
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="engines started per layout (alternating)")
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as where:
        model = build_tiny_model(Path(where) / "tiny")
        runs: dict[str, list[dict[str, tuple[float, float]]]] = {name: [] for name in LAYOUTS}
        for round_ in range(args.rounds):
            for name, extra in LAYOUTS.items():
                console.print(f"round {round_ + 1}: {name}")
                runs[name].append(measure(model, extra, Path(where)))
    base, ours = LAYOUTS
    table = Table(title="vLLM on CPU: the engine's CPU seconds (median of the rounds) by process layout")
    for column in ("", f"{base} CPU s", f"{ours} CPU s", "ratio", f"{base} wall s", f"{ours} wall s"):
        table.add_column(column, justify="left" if not column else "right")
    for what in runs[base][0]:
        cpu_b, cpu_o = (statistics.median(r[what][0] for r in runs[n]) for n in (base, ours))
        wall_b, wall_o = (statistics.median(r[what][1] for r in runs[n]) for n in (base, ours))
        table.add_row(what, f"{cpu_b:.1f}", f"{cpu_o:.1f}", f"{cpu_o / cpu_b:.2f}x", f"{wall_b:.1f}", f"{wall_o:.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
