"""Where each pytest-xdist worker's time went in a run of the suite: the busy span of each worker, its idle
tail, its longest tests, and (where the lines carry it) the CPU each test file cost, from the lines
`ARTGW_TEST_TIMELINE=FILE scripts/test` writes (tests/conftest.py).

    ARTGW_TEST_TIMELINE=/tmp/timeline.jsonl scripts/test
    .venv/bin/python bench/suite_timeline.py /tmp/timeline.jsonl [--top 12]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("timeline", type=Path, help="the file ARTGW_TEST_TIMELINE named")
    parser.add_argument("--top", type=int, default=12, help="longest tests listed per worker, costliest files listed")
    args = parser.parse_args()
    runs = [json.loads(line) for line in args.timeline.read_text().splitlines() if line.strip()]
    if not runs:
        raise SystemExit(f"{args.timeline}: no tests recorded")
    first, last = min(r["start"] for r in runs), max(r["end"] for r in runs)
    by_worker: dict[str, list[dict]] = defaultdict(list)
    for run in runs:
        by_worker[run["worker"]].append(run)
    console = Console()
    summary = Table(title=f"the suite: {(last - first) / 60:.1f} min from the first test's start to the last's end")
    for column in ("worker", "tests", "busy (min)", "ends at (min)", "idle tail (min)"):
        summary.add_column(column, justify="right")
    for worker, mine in sorted(by_worker.items()):
        busy = sum(r["end"] - r["start"] for r in mine)
        ends = max(r["end"] for r in mine) - first
        summary.add_row(
            worker, str(len(mine)), f"{busy / 60:.1f}", f"{ends / 60:.1f}", f"{(last - first - ends) / 60:.1f}"
        )
    console.print(summary)
    for worker, mine in sorted(by_worker.items()):
        longest = Table(title=f"{worker}: the {args.top} longest tests")
        longest.add_column("s", justify="right")
        longest.add_column("test")
        for run in sorted(mine, key=lambda r: r["start"] - r["end"])[: args.top]:
            longest.add_row(f"{run['end'] - run['start']:.0f}", run["test"])
        console.print(longest)
    if all("cpu" in r for r in runs):
        console.print(_cpu_by_file(runs, args.top))


def _cpu_by_file(runs: list[dict], top: int) -> Table:
    """The test files that cost the most CPU (the worker's and what it waited for: tests/conftest.py)."""
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    for run in runs:
        name = run["test"].split("::")[0]
        cpu[name] += run["cpu"]
        wall[name] += run["end"] - run["start"]
    total = sum(cpu.values())
    table = Table(title=f"CPU: {total:.0f} s in all; the {top} costliest test files")
    for column in ("CPU s", "share", "wall s", "file"):
        table.add_column(column, justify="left" if column == "file" else "right")
    for name in sorted(cpu, key=cpu.__getitem__, reverse=True)[:top]:
        table.add_row(f"{cpu[name]:.0f}", f"{cpu[name] / total:.0%}", f"{wall[name]:.0f}", name)
    return table


if __name__ == "__main__":
    main()
