"""Reading a rollout back as the tests check it: its calls, each call's sampled ids, and their decoded text."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from tests.conftest import poll

# A tool whose one argument is a choice of two cities, and a question that asks for both: the continuation tests'.
ROME_PARIS_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    }
]

ROME_PARIS_QUESTION = [{"role": "user", "content": "What is the weather in Rome and in Paris?"}]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def app_env(gateway: Any) -> tuple[str, dict[str, str]]:
    """A new rollout id and the environment of an app whose base URL points at that rollout of the gateway."""
    rid = new_id("env")
    return rid, {"OPENAI_BASE_URL": f"{gateway.url}/rollouts/{rid}/v1", "OPENAI_API_KEY": "unused"}


def rollout(gateway: Any, rollout_id: str) -> dict[str, Any]:
    r = httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", headers=gateway.admin)
    assert r.status_code == 200, r.text
    return r.json()


def sampled_by_call(recorded: dict[str, Any]) -> dict[str, list[int]]:
    """Each call's sampled token ids, from the assembled sequences (what training would use)."""
    out: dict[str, list[int]] = {}
    for seq in recorded["sequences"]:
        for call_id, (start, end) in zip(seq["call_ids"], seq["sampled_spans"], strict=True):
            assert all(seq["sampled_mask"][start:end])
            out[call_id] = seq["token_ids"][start:end]
    return out


def decode(tokenizer: Any, ids: list[int]) -> str:
    """Token ids as vLLM's detokenizer writes them: every token's text but the end-of-turn token that stopped
    the generation (a random-weight model may sample `<|endoftext|>` mid-text, and vLLM keeps it)."""
    return tokenizer.decode(ids, skip_special_tokens=False).removesuffix("<|im_end|>")


def texts(recorded: dict[str, Any], tokenizer: Any) -> list[str]:
    """The decoded sampled text of each call, in call order."""
    sampled = sampled_by_call(recorded)
    return [decode(tokenizer, sampled[c["id"]]) for c in recorded["calls"]]


def one_sequence(gateway: Any, rid: str, calls: int) -> dict[str, Any]:
    """The rollout once its `calls` calls are recorded, asserted to be one sequence (each split's reason if not)."""
    recorded = poll(lambda: recorded_calls(gateway, rid, calls), 10, f"{calls} calls of {rid}")
    sequences = recorded["sequences"]
    assert [len(s["call_ids"]) for s in sequences] == [calls], [s["split_reason"] for s in sequences]
    return recorded


def recorded_calls(gateway: Any, rid: str, calls: int) -> dict[str, Any] | None:
    """The rollout once it has `calls` calls recorded; None before (to poll for)."""
    answer = httpx.get(f"{gateway.base_url}/art/rollouts/{rid}", headers=gateway.admin)
    if answer.status_code != 200 or len(answer.json()["calls"]) < calls:
        return None
    return answer.json()
