"""What making a new store costs, as each fresh gateway (and `artgw migrate`) does on its start: the 16 migrations
replayed one by one, or tables.py's schema made at once and stamped head (store/db.py `migrate`, the default since
the suite's time was counted: ~150 gateways start there on a fresh store). Each in a fresh interpreter that has
imported what a gateway has (SQLAlchemy, aiosqlite, alembic), alternating, on SQLite; CPU and wall of the call.

    .venv/bin/python bench/store_start.py [--rounds 10]

Run it alone: two cores shared with anything else make the figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]

ONE = """
import asyncio, json, sys, time
import aiosqlite, alembic.command, sqlalchemy  # a gateway has these by the time it migrates
from store.db import create_engine, migrate

async def main(path: str, replay: bool) -> None:
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    async with engine.connect():
        pass  # the file and the first connection, outside the measure
    wall, cpu = time.perf_counter(), time.process_time()
    await migrate(engine, replay=replay)
    print(json.dumps([time.process_time() - cpu, time.perf_counter() - wall]))
    await engine.dispose()

asyncio.run(main(sys.argv[1], sys.argv[2] == "replay"))
"""

WAYS = {"replayed (16 migrations)": "replay", "at once (create_all + stamp)": "once"}


def one(way: str, path: Path) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", ONE, str(path), way], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    cpu, wall = json.loads(out.splitlines()[-1])
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="stores made each way, alternating (default 10)")
    args = parser.parse_args()
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, way in WAYS.items():
                figures[name].append(one(way, Path(tmp) / f"{way}-{round_}.sqlite"))
    table = Table(title=f"A new SQLite store, median of {args.rounds}")
    for column in ("made", "CPU ms", "wall ms", "CPU ratio"):
        table.add_column(column, justify="left" if column == "made" else "right")
    baseline = statistics.median(cpu for cpu, _ in figures["replayed (16 migrations)"])
    for name, runs in figures.items():
        cpu = statistics.median(c for c, _ in runs)
        wall = statistics.median(w for _, w in runs)
        table.add_row(name, f"{cpu * 1000:.0f}", f"{wall * 1000:.0f}", f"{cpu / baseline:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
