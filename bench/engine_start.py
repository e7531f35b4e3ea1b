"""What an engine start costs on CPU, with its engine core spawned (vLLM's own server module, what vLLM's CPU
platform does) and forked from the API server (`engine/vllm_server.py`, what `artgw serve` and the CPU compose
file run): the same command line otherwise (the supervised engine's), the tests' toy model, one after the other.
CPU is summed over the engine's process tree (psutil) when /health first answers; wall is from the spawn.

    .venv/bin/python bench/engine_start.py [--rounds 3]

Run it alone: two cores shared with anything else make the figures meaningless.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from artgw.tiny_model import build_tiny_model  # noqa: E402
from bench.engine_layout import tree_cpu  # noqa: E402
from bench.vllm_engines import free_port, healthy  # noqa: E402
from engine.supervisor import EngineConfig  # noqa: E402

MODULES = {"spawned (vLLM's module)": "vllm.entrypoints.openai.api_server", "forked (ours)": "engine.vllm_server"}


def start(model: Path, module: str, log: Path) -> tuple[float, float]:
    """(CPU s, wall s) of one engine's start, served by `module` with the supervised engine's arguments."""
    config = EngineConfig(base_model=str(model), served_name="tiny", port=free_port(), max_model_len=4096)
    command = config.command()
    command[command.index("-m") + 1] = module
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, env=config.environment(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while not healthy(config.url):
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited ({proc.returncode}); its log:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        return tree_cpu(psutil.Process(proc.pid)), time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="engines started per way (alternating)")
    args = parser.parse_args()
    console = Console()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in MODULES}
    with tempfile.TemporaryDirectory() as where:
        model = build_tiny_model(Path(where) / "tiny")
        for round_ in range(args.rounds):
            for name, module in MODULES.items():
                runs[name].append(start(model, module, Path(where) / f"{round_}-{module}.log"))
                console.print(f"round {round_ + 1}, {name}: {runs[name][-1][0]:.1f} s CPU, {runs[name][-1][1]:.1f} s")
    base, ours = MODULES
    table = Table(title=f"An engine's start on CPU, the toy model (median of {args.rounds})")
    for column in ("", f"{base}", f"{ours}", "ratio"):
        table.add_column(column, justify="left" if not column else "right")
    for i, what in enumerate(("CPU s", "wall s")):
        b, o = (statistics.median(r[i] for r in runs[n]) for n in (base, ours))
        table.add_row(what, f"{b:.1f}", f"{o:.1f}", f"{o / b:.2f}x")
    console.print(table)


if __name__ == "__main__":
    main()
