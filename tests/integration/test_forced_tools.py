"""A forced tool call's arguments match the tool's schema, strict or not (#27), on chat, Responses and Messages,
through the real SDKs at their defaults (no `strict`), on the tiny random-weight model and a real vLLM.

Before: vLLM 0.32 (`--tool-strict-level auto`) constrained only the `<tool_call>` envelope of a call forced
without `strict`, and the tiny model wrote any JSON there (`"arguments": "66630"`). Each call is recorded with
the tools as the engine got them (strict), which is what the trainer rebuilds the grammar from.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.recorded import new_id, rollout

pytestmark = pytest.mark.engine

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
}
USER = [{"role": "user", "content": "What is the weather?"}]
SEEDS = range(4)


def chat_tool(**extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA, **extra}}


def completed(arguments: list[str | None]) -> list[Any]:
    """The arguments of the calls the model finished (a random model may run a string to the token limit):
    each one must be JSON that the tool's schema accepts; and most calls must have finished."""
    done = [json.loads(a) for a in arguments if a is not None]
    assert len(done) >= len(arguments) // 2, arguments
    for value in done:
        jsonschema.validate(value, SCHEMA)
    return done


def recorded_strict(gateway: Any, rollout_id: str) -> list[bool]:
    """Whether each recorded call's tools were strict, as the trainer reads them (the grammar request)."""
    calls = rollout(gateway, rollout_id)["calls"]
    return [all(t["function"].get("strict") for t in c["grammar_request"]["tools"]) for c in calls]


@pytest.mark.parametrize(
    ("tool_choice", "strict"),
    [
        ({"type": "function", "function": {"name": "get_weather"}}, {}),
        ("required", {}),
        ({"type": "function", "function": {"name": "get_weather"}}, {"strict": False}),  # autogen's FunctionTool
    ],
    ids=["named", "required", "named-strict-false"],
)
def test_chat_forced_calls_get_arguments_the_schema_accepts(engine_gateway, tool_choice: Any, strict: dict) -> None:
    rid = new_id("forced-chat")
    client = openai.OpenAI(base_url=f"{engine_gateway.url}/rollouts/{rid}/v1", api_key="unused", max_retries=0)
    arguments = []
    for seed in SEEDS:
        r = client.chat.completions.create(
            model="my-agent",
            messages=USER,  # type: ignore[arg-type]
            tools=[chat_tool(**strict)],  # type: ignore[list-item]
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            max_tokens=48,
            temperature=1.0,
            seed=seed,
        )
        calls = r.choices[0].message.tool_calls or []
        arguments.append(calls[0].function.arguments if calls and r.choices[0].finish_reason != "length" else None)
    completed(arguments)
    assert recorded_strict(engine_gateway, rid) == [True] * len(SEEDS)


def test_messages_forced_tool_gets_input_the_schema_accepts(engine_gateway) -> None:
    rid = new_id("forced-msg")
    client = anthropic.Anthropic(base_url=f"{engine_gateway.url}/rollouts/{rid}", api_key="unused", max_retries=0)
    inputs: list[str | None] = []
    for seed in SEEDS:
        m = client.messages.create(
            model="my-agent",
            messages=USER,  # type: ignore[arg-type]
            tools=[{"name": "get_weather", "input_schema": SCHEMA}],  # type: ignore[list-item]
            tool_choice={"type": "tool", "name": "get_weather"},
            max_tokens=48,
            extra_body={"seed": seed},
        )
        uses = [b for b in m.content if b.type == "tool_use"]
        inputs.append(json.dumps(uses[0].input) if uses and m.stop_reason == "tool_use" else None)
    completed(inputs)
    assert recorded_strict(engine_gateway, rid) == [True] * len(SEEDS)


def test_responses_tools_are_strict_when_the_schema_allows(engine_gateway) -> None:
    """OpenAI's rule for a Responses function tool without `strict`: strict when its schema allows it (every
    property required, no others). Forced or not, its arguments then follow the schema."""
    rid = new_id("forced-resp")
    client = openai.OpenAI(base_url=f"{engine_gateway.url}/rollouts/{rid}/v1", api_key="unused", max_retries=0)
    tool = {"type": "function", "name": "get_weather", "parameters": {**SCHEMA, "additionalProperties": False}}
    arguments = []
    for seed in SEEDS:
        r = client.responses.create(
            model="my-agent",
            input="What is the weather?",
            tools=[tool],  # type: ignore[list-item]
            tool_choice="required",
            max_output_tokens=48,
            extra_body={"seed": seed},
        )
        calls = [item for item in r.output if item.type == "function_call"]
        arguments.append(calls[0].arguments if calls and r.status == "completed" else None)
    completed(arguments)
    assert recorded_strict(engine_gateway, rid) == [True] * len(SEEDS)
