"""Hundreds of concurrent calls, mixed stream/non-stream, some clients hanging up mid-stream, some invalid:
exactly one record per accepted call and none for a rejected one, including across a graceful shutdown."""

from __future__ import annotations

import asyncio
import sqlite3
from collections import Counter

import httpx
import pytest

pytestmark = pytest.mark.engine

CALLS = 300
HANGUP_TOKENS = 2000  # the answer a hanging-up client asks for and abandons after its first event
USER = [{"role": "user", "content": "Count to three."}]


def kind(i: int) -> str:
    return ("plain", "plain", "stream", "stream", "hangup", "invalid")[i % 6]


async def one_call(client: httpx.AsyncClient, i: int) -> str:
    headers = {"X-ART-Rollout-Id": f"c-{i}"}
    body = {"model": "my-agent", "messages": USER, "max_tokens": 8}
    match kind(i):
        case "plain":
            r = await client.post("/chat/completions", json=body, headers=headers)
            return "ok" if r.status_code == 200 else f"status {r.status_code}"
        case "stream":
            async with client.stream("POST", "/chat/completions", json={**body, "stream": True}, headers=headers) as r:
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return "ok" if lines[-1] == "data: [DONE]" else "unfinished"
        case "hangup":
            long = {**body, "stream": True, "max_tokens": HANGUP_TOKENS, "ignore_eos": True}
            async with client.stream("POST", "/chat/completions", json=long, headers=headers) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # hang up after the first event
            return "ok"
        case _:
            r = await client.post("/chat/completions", json={"model": "my-agent"}, headers=headers)
            return "ok" if r.status_code == 400 else f"status {r.status_code}"


async def run_load(base_url: str) -> list[str]:
    limits = httpx.Limits(max_connections=CALLS, max_keepalive_connections=CALLS)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as client:
        return await asyncio.gather(*(one_call(client, i) for i in range(CALLS)))


def test_every_accepted_call_recorded_exactly_once(vllm_url, gateway_factory) -> None:
    gateway = gateway_factory("--upstream", vllm_url)
    outcomes = asyncio.run(run_load(gateway.base_url))
    assert Counter(outcomes) == {"ok": CALLS}
    # Graceful shutdown right away: whatever is still queued must be flushed, not lost.
    assert gateway.stop() == 0
    with sqlite3.connect(gateway.db_path) as db:
        rows = db.execute("SELECT rollout_id, status FROM calls").fetchall()
        tokens = dict(db.execute("SELECT rollout_id, json_extract(choices, '$[0].tokens') FROM calls"))
        rollouts = dict(db.execute("SELECT id, call_count FROM rollouts").fetchall())
    per_rollout = Counter(rollout_id for rollout_id, _ in rows)
    accepted = {f"c-{i}" for i in range(CALLS) if kind(i) != "invalid"}
    assert set(per_rollout) == accepted  # nothing for the rejected calls
    assert set(per_rollout.values()) == {1}  # exactly once each
    assert rollouts == dict.fromkeys(accepted, 1)
    status = {rollout_id: s for rollout_id, s in rows}
    hangups = [f"c-{i}" for i in range(CALLS) if kind(i) == "hangup"]
    # A hang-up is `cancelled` with the tokens relayed until then, or, when the whole answer was already in
    # the socket's buffers before the hang-up reached the gateway (a busy client reads its first event late),
    # `ok` with every token: never an `ok` that lost tokens.
    for rollout_id in hangups:
        assert status[rollout_id] in ("cancelled", "ok"), status[rollout_id]
        if status[rollout_id] == "ok":
            assert tokens[rollout_id] == HANGUP_TOKENS, (rollout_id, tokens[rollout_id])
    assert {status[r] for r in accepted - set(hangups)} == {"ok"}
