"""What vLLM's two compiled sampling helpers cost a CPU engine: the tests' toy model served by the supervised command
line, once as vLLM has it (the logprob ranks and the random sample compiled with inductor on the first calls) and once
with TORCH_COMPILE_DISABLE=1 (what `engine/supervisor.py` sets on CPU), alternating, with bench/engine_layout.py's
bursts of chat calls. CPU is summed over the engine's process tree (psutil). torch's compile cache
(/tmp/torchinductor_*) is warm after the first start, as on a machine that ran an engine before; a new container's is
not, and pays g++ on top (~10 s of CPU an engine in the deployment's test).

    .venv/bin/python bench/engine_compile.py [--rounds 2]

Run it alone: two cores shared with anything else make the figures meaningless.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from artgw.tiny_model import build_tiny_model  # noqa: E402
from bench.engine_layout import comparison, measure  # noqa: E402

VARIANTS = {"compiled (vLLM's)": "0", "eager (ours)": "1"}  # TORCH_COMPILE_DISABLE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="engines started per variant (alternating)")
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as where:
        model = build_tiny_model(Path(where) / "tiny")
        runs: dict[str, list[dict[str, tuple[float, float]]]] = {name: [] for name in VARIANTS}
        for round_ in range(args.rounds):
            for name, disable in VARIANTS.items():
                console.print(f"round {round_ + 1}: {name}")
                os.environ["TORCH_COMPILE_DISABLE"] = disable  # the engine's environment is this process's
                runs[name].append(measure(model, (), Path(where)))
    title = "vLLM on CPU: the engine's CPU seconds (median of the rounds), sampling helpers compiled or not"
    console.print(comparison(runs, title))


if __name__ == "__main__":
    main()
