#!/usr/bin/env python3
"""Sticky routing vs round-robin on two real vLLM engines (#45): vLLM's prefix-cache hit rate and the time to first
token of multi-turn rollouts whose calls stay on one engine, against the same rollouts with calls alternating
between the engines.

    .venv/bin/python bench/engine_routing.py [--pg URL] [--rollouts 8] [--turns 6] [--rounds 2]

Two vLLM servers of the tests' toy model (`artgw tiny-model`), started as the supervised engine runs it (prefix
caching on, vLLM's default). Three gateways on one store (a fresh PostgreSQL database: `--pg URL` of a server, else
`scripts/postgres`'s), each `--continuity splice` (the default):

- *sticky*: one gateway with `--upstream A --upstream B`: a rollout's calls stay on the engine of its first call,
  new rollouts go to the least loaded;
- *round-robin*: a gateway in front of each engine, a rollout's turn t sent to gateway (r + t) mod 2: replicas
  behind a round-robin balancer, one store (each continuing call spliced from its rollout's last call, read from
  the store when the other replica answered it).

Each round runs both, one after the other, `--rollouts` at once, each `--turns` streamed chat calls (a user message
of ~400 tokens a turn, 16 tokens of reply); every rollout's text begins with a nonce of its own, so no prefix is
shared across rollouts or rounds. The hit rate is the change of `vllm:prefix_cache_hits_total` over
`vllm:prefix_cache_queries_total` (tokens) summed over both engines' /metrics across a mode's runs; vLLM's time to
first token is the change of its `vllm:time_to_first_token_seconds` histogram's sum over its count (the engine's own,
without the gateway); the client's is to the first streamed event, through the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from artgw.tiny_model import build_tiny_model  # noqa: E402
from bench.continuation import ARTGW, Processes, wait_ready  # noqa: E402
from bench.vllm_engines import free_port, vllm_engines  # noqa: E402
from tests.conftest import fresh_pg_database  # noqa: E402

MODEL = "my-agent"
WORDS = "alpha bravo cedar delta ember falcon granite harbor island juniper kettle lantern meadow nickel".split()
WORDS_A_TURN = 80  # ~400 tokens of the toy model's tokenizer: 6 turns and their replies fit its 4,096
COUNTERS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries")
TTFT = "vllm:time_to_first_token_seconds"


@dataclass
class Mode:
    name: str
    gateways: list[str]  # base URLs; a rollout's turn t goes to gateways[(r + t) % len]
    client_ttft: list[float] = field(default_factory=list)
    engine: dict[str, float] = field(default_factory=dict)  # summed deltas of the engines' counters


def engine_figures(text: str) -> dict[str, float]:
    """The prefix-cache counters and the TTFT histogram's sum and count of one engine's /metrics (over its label
    sets)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name in (*(f"{c}_total" for c in COUNTERS), f"{TTFT}_sum", f"{TTFT}_count"):
                if sample.name == name:
                    out[name] = out.get(name, 0.0) + sample.value
    return out


async def scrape(client: httpx.AsyncClient, engines: list[str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for url in engines:
        for name, value in engine_figures((await client.get(f"{url}/metrics")).text).items():
            total[name] = total.get(name, 0.0) + value
    return total


async def rollout(client: httpx.AsyncClient, mode: Mode, r: int, turns: int, seed: str) -> None:
    words = random.Random(f"{seed}-{r}")
    nonce = uuid.uuid4().hex
    rollout_id = f"route-{nonce[:12]}"
    messages: list[dict[str, str]] = [{"role": "system", "content": f"Task {nonce}: answer each message briefly."}]
    for t in range(turns):
        text = " ".join(words.choice(WORDS) for _ in range(WORDS_A_TURN))
        messages.append({"role": "user", "content": f"Turn {t}: {text}"})
        body = {"model": MODEL, "messages": messages, "max_tokens": 16, "stream": True}
        gateway = mode.gateways[(r + t) % len(mode.gateways)]
        began, first, reply = time.perf_counter(), None, []
        headers = {"X-ART-Rollout-Id": rollout_id}
        async with client.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as answer:
            if answer.status_code != 200:
                raise SystemExit(f"{gateway}: {answer.status_code} {(await answer.aread()).decode()[:500]}")
            async for line in answer.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if first is None:
                    first = time.perf_counter() - began
                if line != "data: [DONE]":
                    for choice in json.loads(line[6:]).get("choices") or ():
                        reply.append((choice.get("delta") or {}).get("content") or "")
        assert first is not None
        mode.client_ttft.append(first)
        messages.append({"role": "assistant", "content": "".join(reply)})


async def run_mode(mode: Mode, engines: list[str], rollouts: int, turns: int, seed: str) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        before = await scrape(client, engines)
        await asyncio.gather(*(rollout(client, mode, r, turns, seed) for r in range(rollouts)))
        after = await scrape(client, engines)
    for name, value in after.items():
        mode.engine[name] = mode.engine.get(name, 0.0) + value - before.get(name, 0.0)


def continued(gateways: list[str]) -> dict[str, float]:
    """The gateways' continuing calls by how they were served (`artgw_continued_calls_total{how}`) and their reads
    of a rollout's last call from the store by outcome (`artgw_continuation_reads_total{found}`), summed."""
    out: dict[str, float] = {}
    for url in gateways:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
            for sample in family.samples:
                if sample.name == "artgw_continued_calls_total":
                    key = sample.labels["how"]
                elif sample.name == "artgw_continuation_reads_total":
                    key = f"store read {sample.labels['found']}"
                else:
                    continue
                out[key] = out.get(key, 0.0) + sample.value
    return out


def start_gateway(procs: Processes, where: Path, db: str, *upstreams: str) -> str:
    port = free_port()
    data = where / f"gw-{port}"
    data.mkdir(parents=True)
    cmd = [ARTGW, "serve", *(a for u in upstreams for a in ("--upstream", u)), "--port", str(port)]
    cmd += ["--data-dir", str(data), "--db", db, "--auth", "off", "--log-level", "warning"]
    proc = procs.start(cmd, where / f"gw-{port}.log")
    url = f"http://127.0.0.1:{port}"
    wait_ready(f"{url}/readyz", proc, 120)
    return url


def pg_server() -> str:
    """This checkout's test PostgreSQL server (scripts/postgres: started if it is not running)."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "postgres")], capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def _ms(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1000


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", help="a PostgreSQL server's asyncpg URL (else scripts/postgres's)")
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts at once in each run")
    parser.add_argument("--turns", type=int, default=6, help="calls a rollout")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
    args = parser.parse_args()
    console = Console(width=130)
    procs = Processes()
    async with contextlib.AsyncExitStack() as cleanup:
        where = Path(cleanup.enter_context(tempfile.TemporaryDirectory()))
        db = await cleanup.enter_async_context(fresh_pg_database(args.pg or pg_server()))
        model = build_tiny_model(where / "tiny")
        console.print("starting two vLLM engines ...")
        started = time.monotonic()
        engines = [url for url, _ in cleanup.enter_context(vllm_engines(model, where, count=2))]
        console.print(f"engines up in {time.monotonic() - started:.0f} s: {engines}")
        cleanup.callback(procs.stop_all)
        sticky = Mode("sticky", [start_gateway(procs, where, db, *engines)])
        robin = Mode("round-robin", [start_gateway(procs, where, db, url) for url in engines])
        # Warm the engines (their first calls compile) and every gateway outside the figures.
        for warm in (sticky, robin):
            await run_mode(Mode("warm-up", warm.gateways), engines, 2, 2, "warm")
        warm = {mode.name: continued(mode.gateways) for mode in (sticky, robin)}
        for round_ in range(args.rounds):
            for mode in (sticky, robin):
                began = time.monotonic()
                await run_mode(mode, engines, args.rollouts, args.turns, f"{round_}-{mode.name}")
                console.print(f"round {round_ + 1} {mode.name}: {time.monotonic() - began:.1f} s")
        how = {
            mode.name: {k: v - warm[mode.name].get(k, 0.0) for k, v in continued(mode.gateways).items()}
            for mode in (sticky, robin)
        }
    title = f"two vLLM engines, {args.rollouts} rollouts x {args.turns} turns at once, {args.rounds} rounds"
    table = Table(title=title)
    for column in ("", "sticky", "round-robin", "sticky / round-robin"):
        table.add_column(column, justify="left" if not column else "right")

    def hit_rate(mode: Mode) -> float:
        return mode.engine["vllm:prefix_cache_hits_total"] / mode.engine["vllm:prefix_cache_queries_total"]

    def engine_ttft(mode: Mode) -> float:
        return mode.engine[f"{TTFT}_sum"] / mode.engine[f"{TTFT}_count"] * 1000

    rows = [
        ("prefix-cache hit rate (tokens)", hit_rate, "{:.1%}"),
        ("prompt tokens queried", lambda m: m.engine["vllm:prefix_cache_queries_total"], "{:,.0f}"),
        ("vLLM's time to first token, mean ms", engine_ttft, "{:.1f}"),
        ("client's time to first token p50 ms", lambda m: _ms(m.client_ttft, 50), "{:.1f}"),
        ("client's time to first token p90 ms", lambda m: _ms(m.client_ttft, 90), "{:.1f}"),
    ]
    for label, figure, form in rows:
        a, b = figure(sticky), figure(robin)
        table.add_row(label, form.format(a), form.format(b), f"{a / b:.2f}x" if b else "-")
    console.print(table)
    continuing = args.rounds * args.rollouts * (args.turns - 1)
    for name, counts in how.items():
        # A continuing call that finds its rollout's last call neither in memory nor in the store (the other
        # replica's record not written yet: `store read none`) is rendered anew, counted under no `how`.
        served = ", ".join(f"{v:.0f} {k}" for k, v in sorted(counts.items()) if v)
        console.print(f"{name}: {continuing} continuing calls: {served}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
