#!/usr/bin/env python3
"""What reading a rollout's last call from the store adds to a continuing call this gateway does not hold (a
restart, another replica, pushed out of memory): `Continuations.look_up` with the rollout's last call in memory,
and with memory empty (one read of the rollout's rows by its index, `store.calls.last_chat_call`, the rows
expanded, the last call's digests), on SQLite and PostgreSQL, for rollouts of 1, 10 and 30 calls.

    .venv/bin/python bench/continuation_read.py [--pg URL] [--rollouts 20] [--repeats 5] [--lengths 1,10,30]

The rollouts are `bench/store_growth.py`'s synthetic agent conversations (a 1,200-character system prompt with
three tools, then per call reasoning, a tool call and a 300-3,000-character tool result: ~800 prompt tokens a
call), written as the recorder writes them (`write_calls` with its cache, batches of 32). The continuing
request is each rollout's next call (its history and the last reply, then the tool's result). Each measured
look-up is a fresh `Continuations` (memory empty, or holding the last call alone), so every store look-up reads.
`--pg URL`: a PostgreSQL server (asyncpg URL of any database on it): the bench makes a database of its own
there and drops it afterwards; without it, SQLite alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.store_growth import batches, rollouts_of  # noqa: E402
from gateway.adapters import Route  # noqa: E402
from gateway.continuation import Continuations, message_digests  # noqa: E402
from store import create_engine, migrate  # noqa: E402
from store.calls import write_calls  # noqa: E402
from store.codec import CallCache  # noqa: E402
from store.records import CallRecord  # noqa: E402
from store.rollouts import RolloutReader  # noqa: E402
from tests.conftest import fresh_pg_database  # noqa: E402

ROUTE = Route("my-agent@3", "my-agent", 3)  # the conversations' model and step


def _next_request(calls: list[CallRecord]) -> dict[str, object]:
    """The call after a rollout's last: its history, the last reply, then the tool's result."""
    last = calls[-1]
    reply = last.choices[0].message
    result = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "the result"}
    return {**last.request, "messages": [*last.request["messages"], reply, result]}


async def _measure(
    url: str, lengths: list[int], count: int, repeats: int
) -> list[tuple[int, int, list[float], list[float]]]:
    """Per length: prompt tokens of the last call, and the look-up's seconds from memory and from the store."""
    engine = create_engine(url)
    try:
        await migrate(engine)
        cache = CallCache()
        per_length = {length: rollouts_of(length, count, seed=length) for length in lengths}
        for rollouts in per_length.values():
            for batch in batches(rollouts, 32):
                async with engine.begin() as conn:
                    await write_calls(conn, batch, cache)
                cache.committed()
        reader = RolloutReader(engine)
        out = []
        for length, rollouts in per_length.items():
            memory: list[float] = []
            stored: list[float] = []
            for _ in range(repeats):
                for calls in rollouts:
                    request = _next_request(calls)
                    key = calls[-1].rollout_key
                    held = Continuations()
                    held.remember(calls[-1])
                    empty = Continuations(read=reader.last_chat_call, read_seconds=30.0)
                    for continuations, times in ((held, memory), (empty, stored)):
                        began = time.perf_counter()
                        # The digests are computed once a call either way (gateway/proxy.py): timed with it.
                        continued, known = await continuations.look_up(key, request, ROUTE, message_digests(request))
                        times.append(time.perf_counter() - began)
                        assert known and continued is not None, (length, key)
            out.append((length, len(rollouts[0][-1].prompt_token_ids), memory, stored))
        return out
    finally:
        await engine.dispose()


def _ms(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if len(values) > 1 else values[0] * 1000


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", help="a PostgreSQL server's asyncpg URL (else SQLite alone)")
    parser.add_argument("--rollouts", type=int, default=20, help="rollouts of each length")
    parser.add_argument("--repeats", type=int, default=5, help="look-ups of each rollout, each way")
    parser.add_argument("--lengths", default="1,10,30", help="calls a rollout, comma-separated")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    stores: list[tuple[str, str]] = []
    async with contextlib.AsyncExitStack() as cleanup:
        tmp = cleanup.enter_context(tempfile.TemporaryDirectory())
        stores.append(("SQLite", f"sqlite+aiosqlite:///{Path(tmp) / 'artgw.sqlite'}"))
        if args.pg:
            stores.append(("PostgreSQL", await cleanup.enter_async_context(fresh_pg_database(args.pg))))
        table = Table(title="a continuing call's look-up of its rollout's last call (ms)")
        for column in (
            "store",
            "calls/rollout",
            "prompt tokens",
            "memory p50",
            "store p50",
            "store p90",
            "added p50",
        ):
            table.add_column(column, justify="right")
        for name, url in stores:
            for length, tokens, memory, stored in await _measure(url, lengths, args.rollouts, args.repeats):
                table.add_row(
                    name,
                    str(length),
                    f"{tokens:,}",
                    f"{_ms(memory, 50):.3f}",
                    f"{_ms(stored, 50):.2f}",
                    f"{_ms(stored, 90):.2f}",
                    f"+{_ms(stored, 50) - _ms(memory, 50):.2f}",
                )
    console = Console(width=120)
    console.print(table)
    console.print(f"Python {platform.python_version()}, {args.rollouts} rollouts x {args.repeats} look-ups each way")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
