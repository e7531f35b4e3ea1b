"""Reading a rollout back as the tests check it: its calls, each call's sampled ids, and their decoded text."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

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
FORCED = {"type": "function", "function": {"name": "get_weather"}}


def first_run(run: Callable[[int], Any], seeds: int = 8) -> tuple[int, Any]:
    """`run(seed)` until one completes (a random-weight model may pad a tool call's JSON past the token limit)."""
    failures = []
    for seed in range(seeds):
        try:
            return seed, run(seed)
        except (json.JSONDecodeError, ValueError, TypeError, openai.APIError, anthropic.APIError) as exc:
            failures.append(f"seed {seed}: {type(exc).__name__}: {exc}")
    pytest.fail("no run completed:\n" + "\n".join(failures))


def forced_tool_call(gateway: Any, rid: str, seed: int) -> list[dict[str, Any]]:
    """A rollout's first call, a forced tool call (the template renders it otherwise than it was sampled: only a
    splice keeps the rollout one sequence), and the history that continues it: its reply and the tool's result."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", default_headers={"X-ART-Rollout-Id": rid})
    fields: dict[str, Any] = dict(
        model="my-agent", messages=ROME_PARIS_QUESTION, tools=ROME_PARIS_TOOLS, max_tokens=48, seed=seed
    )
    choice = client.chat.completions.create(tool_choice=FORCED, **fields).choices[0]
    (call,) = choice.message.tool_calls  # a failed parse raises: another seed
    json.loads(call.function.arguments)
    reply = choice.message.model_dump(exclude_none=True)
    return [*ROME_PARIS_QUESTION, reply, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]


ROME_PARIS_TOOLS_ANTHROPIC = [
    {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "input_schema": ROME_PARIS_TOOLS[0]["function"]["parameters"],
    }
]


def anthropic_tool_loop(
    url: str,
    rollout_id: str,
    seed: int,
    stream: bool,
    *,
    extra_body: dict[str, Any] | None = None,
    max_tokens: int = 48,
) -> list[Any]:
    """A rollout through Anthropic's Python SDK (the gateway at `url`): two forced tool_use turns, each answered
    with a tool_result, then an answer; each reply sent back whole (thinking blocks included). ValueError when a
    forced turn ran past max_tokens (try another seed)."""
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="unused", default_headers={"X-ART-Rollout-Id": rollout_id})
    messages: list[dict[str, Any]] = [{"role": "user", "content": ROME_PARIS_QUESTION[0]["content"]}]
    replies = []
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "tool", "name": "get_weather"}, None):
        fields: dict[str, Any] = dict(
            model="my-agent", max_tokens=max_tokens, messages=messages, tools=ROME_PARIS_TOOLS_ANTHROPIC
        )
        fields.update(extra_body={"seed": seed, **(extra_body or {})}, **({"tool_choice": choice} if choice else {}))
        if stream:
            with client.messages.stream(**fields) as events:
                reply = events.get_final_message()
        else:
            reply = client.messages.create(**fields)
        replies.append(reply)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if choice is not None:
            if not uses or reply.stop_reason != "tool_use":  # the JSON ran past max_tokens: another seed
                raise ValueError(f"no whole tool_use block ({reply.stop_reason})")
            results = [{"type": "tool_result", "tool_use_id": b.id, "content": "sunny"} for b in uses]
            messages.append({"role": "user", "content": results})
    return replies


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


def answered_call(gateway: Any, rollout_id: str, model: str = "my-agent") -> dict[str, Any]:
    """One short chat call of `rollout_id` to `model`, answered: its record, as the store has it."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answer = httpx.post(
        f"{gateway.base_url}/chat/completions", json=body, headers={"X-ART-Rollout-Id": rollout_id}, timeout=30
    )
    assert answer.status_code == 200, answer.text
    return rollout(gateway, rollout_id)["calls"][-1]


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
    recorded = poll(lambda: recorded_calls(gateway, rid, calls), 60, f"{calls} calls of {rid}")
    sequences = recorded["sequences"]
    assert [len(s["call_ids"]) for s in sequences] == [calls], [s["split_reason"] for s in sequences]
    return recorded


def recorded_calls(gateway: Any, rid: str, calls: int) -> dict[str, Any] | None:
    """The rollout once it has `calls` calls recorded; None before (to poll for)."""
    answer = httpx.get(f"{gateway.base_url}/art/rollouts/{rid}", headers=gateway.admin)
    if answer.status_code != 200 or len(answer.json()["calls"]) < calls:
        return None
    return answer.json()
