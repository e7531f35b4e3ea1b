"""Issue #40, item 5: a burst of seeded calls with long prompts must not kill a CPU engine. vLLM 0.32 on CPU dies
(`CPU Generator does not use offset`) when a seeded prompt is prefilled in chunks; four ~3,600-token prompts at
once overran the step budget (2 x max_model_len) and the engine died. The session's engine is started with the
supervisor's own arguments (EngineConfig.command), so this checks what `artgw serve` runs."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.conftest import BASE_NAME

pytestmark = pytest.mark.engine

CALLS = 4
PROMPT_TOKENS = 3600  # of the session engine's 4,096: three such prompts overrun a step of 8,192 tokens


async def test_a_burst_of_long_seeded_prompts_is_served_and_the_engine_lives(vllm_url: str) -> None:
    rng = random.Random(40)
    # Token ids, so the length is exact; a prompt of its own per call, so no prefix cache shortens one.
    prompts = [[rng.randrange(10, 1000) for _ in range(PROMPT_TOKENS)] for _ in range(CALLS)]
    async with httpx.AsyncClient(base_url=vllm_url, timeout=300) as client:

        async def call(i: int) -> int:
            body = {"model": BASE_NAME, "prompt": prompts[i], "max_tokens": 4, "seed": i, "temperature": 1.0}
            try:
                return (await client.post("/v1/completions", json=body)).status_code
            except httpx.TransportError:
                return 0  # the engine went away mid-call

        statuses = await asyncio.gather(*(call(i) for i in range(CALLS)))
        health = (await client.get("/health")).status_code
    assert statuses == [200] * CALLS
    assert health == 200  # a dead engine core answers 503
