#!/usr/bin/env python3
"""How the store grows with a rollout's length: bytes of SQLite per token of the assembled trajectory, for
rollouts of 1, 10 and 30 calls, before (every call whole, in JSON) and after the compact layout (0004).

    .venv/bin/python bench/store_growth.py [--rollouts 40] [--lengths 1,10,30] [--batch 32]

The rollouts are synthetic multi-turn, tool-using agent conversations: a system prompt with tools and a user
question, then per call an assistant turn (reasoning text + a tool call, sampled token ids with float32
logprobs) and a tool result; each call's prompt is the previous prompt + the previous completion + the new
tool result, token for token, with ids drawn from a 151,936-token vocabulary (Qwen2's) and ~4 characters of
message text per token. A rollout of N calls is the first N calls of such a conversation; `--rollouts` of them
per length run side by side, written in batches of `--batch` records, as the recorder batches them.

- before: a fresh store migrated to revision 0003, the rows inserted exactly as the writer before 0004 did
  (reproduced below: `write_calls_0003`, every call's prompt ids, request and choices whole, as JSON);
- after: a fresh store at head, written by `store.calls.write_calls_sync` with the recorder's `CallCache`,
  `committed()` after each batch's transaction.

The size is SQLite's (page_count - freelist_count) * page_size after a WAL checkpoint, less the same figure of
the empty migrated store; tokens are the assembled trajectories' (`store.trajectories.assemble`, the sum of
its sequences' lengths). Every rollout is read back from both stores (the 0003 reader for before,
`store.calls.rollout_calls` for after): the records must equal what was written and the assembled
trajectories must be identical. Checks: after, 30 calls cost at most 1.3x what 10 calls cost per token, and
at most 24 bytes per token.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import platform
import random
import sqlite3
import sys
import tempfile
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import sqlalchemy as sa
from rich.console import Console
from rich.table import Table
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection, Engine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from store import create_engine, migrate  # noqa: E402
from store.calls import rollout_calls, write_calls_sync  # noqa: E402
from store.codec import CallCache  # noqa: E402
from store.db import create_sync_sqlite_engine  # noqa: E402
from store.records import CallRecord, ChoiceRecord, RolloutKey  # noqa: E402
from store.tables import rollouts  # noqa: E402
from store.trajectories import Trajectory, assemble  # noqa: E402

VOCAB = 151_936  # Qwen2's vocabulary: ids need more than 16 bits
IM_START, IM_END, NEWLINE, ASSISTANT, TOOL_CALL, TOOL_CALL_END = 151_644, 151_645, 198, 77_091, 151_657, 151_658
ROLE_TOKENS = {"system": 8_948, "user": 872, "tool": 14_172}  # each role's name: one token in Qwen2's vocabulary
MAX_RATIO = 1.3  # after: the 30-call figure at most this times the 10-call one (linear growth)
MAX_BYTES_PER_TOKEN = 24.0

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look up"},
                    "limit": {"type": "integer"},
                },
                "required": ["query"],
            },
        },
    }
    for name, description in (
        ("search_docs", "Full-text search over the internal documentation; returns the best passages."),
        ("read_file", "Read a file of the repository at a path; returns its text."),
        ("run_tests", "Run the test suite (or a subset) and return the failures."),
    )
]


# --- the conversations -------------------------------------------------------------------------------


class Conversation:
    """One agent's growing conversation: calls made one at a time, each the previous one extended."""

    def __init__(self, rollout_id: str, seed: int, started: float) -> None:
        self.rollout_id = rollout_id
        self.rng = random.Random(seed)
        self.at = started
        system = self.text(1200)
        user = self.text(self.rng.randrange(150, 500))
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]
        tools_tokens = len(msgspec.json.encode(TOOLS)) // 4  # the template renders the tools into the system turn
        self.prompt = [
            *self.turn("system", self.ids(len(system) // 4 + tools_tokens)),
            *self.turn("user", self.ids(len(user) // 4)),
            IM_START,
            ASSISTANT,
            NEWLINE,
        ]
        self.k = 0

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def text(self, chars: int) -> str:
        words: list[str] = []
        length = 0
        while length < chars:
            word = "".join(self.rng.choices("abcdefghijklmnopqrstuvwxyz", k=self.rng.randrange(2, 9)))
            words.append(word)
            length += len(word) + 1
        return " ".join(words)[:chars]

    @staticmethod
    def turn(role: str, content: list[int]) -> list[int]:
        """A chat-template turn: <|im_start|>role\n content <|im_end|>\n."""
        return [IM_START, ROLE_TOKENS[role], NEWLINE, *content, IM_END, NEWLINE]

    def call(self) -> CallRecord:
        """The next call: the model reasons briefly and calls a tool; the client then sends the tool's result."""
        rng = self.rng
        thought = self.text(rng.randrange(60, 400))
        tool = rng.choice(TOOLS)["function"]["name"]
        arguments = msgspec.json.encode({"query": self.text(rng.randrange(10, 60)), "limit": rng.randrange(1, 9)})
        tool_call = {
            "id": f"call_{self.k}",
            "type": "function",
            "function": {"name": tool, "arguments": arguments.decode()},
        }
        message = {"role": "assistant", "content": thought, "tool_calls": [tool_call]}
        sampled = [*self.ids(len(thought) // 4), TOOL_CALL, *self.ids(len(arguments) // 4 + 6), TOOL_CALL_END, IM_END]
        logprobs = array("f", [-rng.expovariate(3.0) for _ in sampled]).tolist()  # float32 values, as vLLM's
        record = CallRecord(
            call_id=f"{self.rollout_id}-{self.k:03d}",
            rollout_id=self.rollout_id,
            rollout_explicit=True,
            model="my-agent",
            step=3,
            upstream_model="my-agent@3",
            request={
                "model": "my-agent",
                "messages": list(self.messages),
                "tools": TOOLS,
                "tool_choice": "auto",
                "temperature": 1.0,
                "max_tokens": 1024,
            },
            stream=True,
            status="ok",
            http_status=200,
            error=None,
            prompt_token_ids=list(self.prompt),
            choices=[ChoiceRecord(0, message, "tool_calls", sampled, logprobs)],
            usage={
                "prompt_tokens": len(self.prompt),
                "completion_tokens": len(sampled),
                "total_tokens": len(self.prompt) + len(sampled),
            },
            started_at=self.at,
            first_token_at=self.at + 0.08,
            ended_at=self.at + 1.5,
        )
        # The client appends the assistant message and the tool's result and calls again.
        result = self.text(rng.randrange(300, 3000))
        self.messages += [message, {"role": "tool", "tool_call_id": tool_call["id"], "content": result}]
        # The next prompt: this one, the sampled tokens (up to <|im_end|>), the tool turn, the generation prompt.
        tool_turn = self.turn("tool", self.ids(len(result) // 4))
        self.prompt += [*sampled, NEWLINE, *tool_turn, IM_START, ASSISTANT, NEWLINE]
        self.at += 2.0
        self.k += 1
        return record


def rollouts_of(length: int, count: int, seed: int) -> list[list[CallRecord]]:
    conversations = [Conversation(f"len{length}-r{i:03d}", seed * 1_000_003 + i, 1.8e9 + i) for i in range(count)]
    return [[c.call() for _ in range(length)] for c in conversations]


def batches(per_rollout: list[list[CallRecord]], size: int) -> list[list[CallRecord]]:
    """The agents run side by side: the recorder sees call k of every rollout before call k + 1 of any."""
    order = [r[k] for k in range(max(map(len, per_rollout))) for r in per_rollout if k < len(r)]
    return [order[i : i + size] for i in range(0, len(order), size)]


# --- the writer and reader before 0004 (store/calls.py at revision 0003) --------------------------------

calls_0003 = sa.table(
    "calls",
    *(sa.column(name) for name in ("id", "rollout_id", "model", "step", "upstream_model", "status", "http_status")),
    *(sa.column(name) for name in ("error", "started_at", "first_token_at", "ended_at")),
    sa.column("stream", sa.Boolean()),
    *(sa.column(name, sa.JSON()) for name in ("request", "prompt_token_ids", "choices", "usage")),
)


def write_calls_0003(conn: Connection, records: Sequence[CallRecord]) -> int:
    """The writer before 0004, as it was: each call's fields as JSON, then the rollouts' counters."""
    unique: dict[str, CallRecord] = {}
    for record in records:
        unique.setdefault(record.call_id, record)
    ordered = [unique[call_id] for call_id in sorted(unique)]
    rows = [msgspec.to_builtins(r) for r in ordered]
    for row in rows:
        row["id"] = row.pop("call_id")
        row.pop("rollout_explicit")
    insert = sqlite_dialect.insert
    result = conn.execute(
        insert(calls_0003).on_conflict_do_nothing(index_elements=["id"]).returning(calls_0003.c.id), rows
    )
    new_ids = {row.id for row in result}
    per_rollout: dict[str, dict[str, Any]] = {}
    for record in ordered:
        if record.call_id not in new_ids:
            continue
        agg = per_rollout.setdefault(
            record.rollout_id,
            {
                "id": record.rollout_id,
                "model": record.model,
                "explicit": record.rollout_explicit,
                "call_count": 0,
                "first_call_at": record.started_at,
                "last_call_at": record.started_at,
            },
        )
        agg["call_count"] += 1
        agg["first_call_at"] = min(agg["first_call_at"], record.started_at)
        agg["last_call_at"] = max(agg["last_call_at"], record.started_at)
        agg["model"] = agg["model"] or record.model
    stmt = insert(rollouts)
    stmt = stmt.on_conflict_do_update(
        index_elements=["id"],
        set_={
            "call_count": rollouts.c.call_count + stmt.excluded.call_count,
            "first_call_at": sa.func.min(rollouts.c.first_call_at, stmt.excluded.first_call_at),
            "last_call_at": sa.func.max(rollouts.c.last_call_at, stmt.excluded.last_call_at),
            "model": sa.func.coalesce(rollouts.c.model, stmt.excluded.model),
        },
    )
    if per_rollout:
        conn.execute(stmt, sorted(per_rollout.values(), key=lambda r: r["id"]))
    return len(new_ids)


def read_calls_0003(conn: Connection, rollout_id: str) -> list[CallRecord]:
    rows = conn.execute(
        sa.select(calls_0003)
        .where(calls_0003.c.rollout_id == rollout_id)
        .order_by(calls_0003.c.started_at, calls_0003.c.id)
    )
    plain = [{str(k): v for k, v in row._mapping.items()} for row in rows]
    return [msgspec.convert({**row, "call_id": row["id"], "rollout_explicit": True}, CallRecord) for row in plain]


# --- measuring ---------------------------------------------------------------------------------------


class Measured(msgspec.Struct):
    store_bytes: int
    write_seconds: float
    trajectories: dict[str, Trajectory]
    records_equal: bool


def used_bytes(path: Path) -> int:
    """The bytes the database's live pages take, everything checkpointed out of the WAL."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_count, freelist, page_size = (
            conn.execute(f"PRAGMA {pragma}").fetchone()[0] for pragma in ("page_count", "freelist_count", "page_size")
        )
    finally:
        conn.close()
    return (page_count - freelist) * page_size


def fresh_store(path: Path, revision: str) -> Engine:
    url = f"sqlite+aiosqlite:///{path}"

    async def run() -> None:
        engine = create_engine(url)
        try:
            await migrate(engine, revision)
        finally:
            await engine.dispose()

    asyncio.run(run())
    engine = create_sync_sqlite_engine(url)
    assert engine is not None
    return engine


def measure(path: Path, layout: str, rollouts_: list[list[CallRecord]], batch: int) -> Measured:
    engine = fresh_store(path, "0003" if layout == "before" else "head")
    empty = used_bytes(path)
    cache = CallCache()
    started = time.perf_counter()
    for records in batches(rollouts_, batch):
        with engine.begin() as conn:
            if layout == "before":
                write_calls_0003(conn, records)
            else:
                write_calls_sync(conn, records, cache)
        if layout == "after":
            cache.committed()  # as the recorder does once the transaction has committed
    write_seconds = time.perf_counter() - started
    engine.dispose()
    size = used_bytes(path) - empty

    async def read_back() -> tuple[dict[str, Trajectory], bool]:
        reader = create_engine(f"sqlite+aiosqlite:///{path}")
        trajectories: dict[str, Trajectory] = {}
        equal = True
        try:
            async with reader.connect() as conn:
                for records in rollouts_:
                    rollout_id = records[0].rollout_id
                    if layout == "before":
                        back = await conn.run_sync(read_calls_0003, rollout_id)
                    else:
                        back = await rollout_calls(conn, RolloutKey("", rollout_id)) or []
                    equal &= msgspec.json.encode(back) == msgspec.json.encode(records)
                    trajectories[rollout_id] = assemble(rollout_id, back)
        finally:
            await reader.dispose()
        return trajectories, equal

    trajectories, equal = asyncio.run(read_back())
    return Measured(size, write_seconds, trajectories, equal)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=40, help="rollouts of each length (default 40)")
    parser.add_argument("--lengths", default="1,10,30", help="calls per rollout, comma-separated (default 1,10,30)")
    parser.add_argument("--batch", type=int, default=32, help="records per write transaction (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic conversations")
    parser.add_argument("--keep", metavar="DIR", help="write the stores into DIR and keep them")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    console = Console(width=132)
    console.print(
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, Python {platform.python_version()}, "
        f"SQLite {sqlite3.sqlite_version}; {args.rollouts} rollouts per length, batches of {args.batch}"
    )
    with tempfile.TemporaryDirectory(prefix="store-growth-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        table = Table(title="store bytes per token of the assembled trajectories (SQLite)")
        for column in ("calls/rollout", "trajectory tokens", "ids in calls", "before B/token", "after B/token"):
            table.add_column(column, justify="right")
        table.add_column("before/after", justify="right")
        table.add_column("write ms/call", justify="right")
        for layout in ("before", "after"):  # warm-up: imports and statement caches out of the write timings
            measure(root / f"warm-up-{layout}.sqlite", layout, rollouts_of(3, 4, -1), args.batch)
        per_token: dict[int, tuple[float, float]] = {}
        identical = True
        for length in lengths:
            rollouts_ = rollouts_of(length, args.rollouts, args.seed + length)
            measured = {
                layout: measure(root / f"{layout}-{length}.sqlite", layout, rollouts_, args.batch)
                for layout in ("before", "after")
            }
            before, after = measured["before"], measured["after"]
            same = msgspec.json.encode(before.trajectories) == msgspec.json.encode(after.trajectories)
            identical &= same and before.records_equal and after.records_equal
            tokens = sum(len(s.token_ids) for t in after.trajectories.values() for s in t.sequences)
            stored = sum(len(c.prompt_token_ids) + len(c.choices[0].token_ids) for r in rollouts_ for c in r)
            per_token[length] = (before.store_bytes / tokens, after.store_bytes / tokens)
            calls = length * args.rollouts
            table.add_row(
                str(length),
                f"{tokens:,}",
                f"{stored:,}",
                f"{per_token[length][0]:.1f}",
                f"{per_token[length][1]:.1f}",
                f"{per_token[length][0] / per_token[length][1]:.1f}x",
                f"{1000 * before.write_seconds / calls:.2f} / {1000 * after.write_seconds / calls:.2f}",
            )
        console.print(table)
        console.print(
            "trajectory tokens: the assembled sequences' lengths; ids in calls: prompt + sampled ids summed over "
            "the calls (what the old layout stores); B/token: store bytes (live pages, less the empty store's) "
            "per trajectory token; write ms/call: before / after, the writer's wall time per call",
            highlight=False,
        )

    checks: list[tuple[bool, str]] = [
        (identical, "read-back records equal what was written, trajectories identical before and after")
    ]
    if 10 in per_token and 30 in per_token:
        ratio = per_token[30][1] / per_token[10][1]
        checks.append((ratio <= MAX_RATIO, f"after: 30 calls <= {MAX_RATIO}x 10 calls per token: {ratio:.2f}x"))
    if 30 in per_token:
        checks.append(
            (
                per_token[30][1] <= MAX_BYTES_PER_TOKEN,
                f"after: 30 calls <= {MAX_BYTES_PER_TOKEN:.0f} B/token: {per_token[30][1]:.1f}",
            )
        )
    for ok, what in checks:
        console.print(f"  {'PASS' if ok else 'FAIL'}  {what}", highlight=False)
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
