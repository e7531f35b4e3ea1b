"""A forced tool call's arguments match the tool's schema, strict or not (#27), on chat, Responses and Messages,
through the real SDKs at their defaults (no `strict`), on the tiny random-weight model and a real vLLM.

Before: vLLM 0.32 (`--tool-strict-level auto`) constrained only the `<tool_call>` envelope of a call forced
without `strict`, and the tiny model wrote any JSON there (`"arguments": "66630"`). Each call is recorded with
the tools as the engine got them (strict), which is what the trainer rebuilds the grammar from.

At their edges (#42), before: the grammar let the model pad the arguments with whitespace without end (at 48
tokens most named calls were cut); a reply cut inside a later call lost the complete calls before it (no
`tool_calls`, the raw `<tool_call>` text as content); and a string argument holding `</tool_call>` gave no call.
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


def completed(arguments: list[str | None], *, every: bool = False) -> list[Any]:
    """The arguments of the calls the model finished (a random model may run a string to the token limit):
    each one must be JSON that the tool's schema accepts; and most calls (`every`: all) must have finished."""
    done = [json.loads(a) for a in arguments if a is not None]
    assert len(done) == len(arguments) if every else len(done) >= len(arguments) // 2, arguments
    for value in done:
        jsonschema.validate(value, SCHEMA)
    return done


def sdk(gateway: Any, rollout_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout_id}/v1", api_key="unused", max_retries=0)


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
    """Every reply within 48 tokens has a call the schema accepts (#42: no free whitespace to pad it with; a
    reply cut after the call's arguments, in the envelope's last tokens, keeps the call)."""
    rid = new_id("forced-chat")
    client = sdk(engine_gateway, rid)
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
        calls = r.choices[0].message.tool_calls or []  # a reply cut after its call's arguments keeps the call
        arguments.append(calls[0].function.arguments if calls else None)
    completed(arguments, every=True)
    assert recorded_strict(engine_gateway, rid) == [True] * len(SEEDS)


def test_a_named_call_with_an_integer_argument_ends_within_48_tokens(engine_gateway) -> None:
    """#42's goal, the bench's schema (bench/forced_tools.py: `city`, and an optional unbounded integer `days`
    that the random model writes up to 16 digits of): every named call within 48 tokens ends, valid. Before,
    the grammar admitted every spelling of the envelope's constant text and the random model spent 27 tokens on
    a head the tokenizer spells in 14: 9 of the bench's 24 seeds (0, 3 and 6 of these) ran out of tokens."""
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "days": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}
    client = sdk(engine_gateway, new_id("forced-days"))
    for seed in range(8):
        (choice,) = client.chat.completions.create(
            model="my-agent",
            messages=USER,  # type: ignore[arg-type]
            tools=[tool],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=48,
            seed=seed,
        ).choices
        assert choice.finish_reason == "stop" and choice.message.tool_calls, (seed, choice)
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schema)  # type: ignore[union-attr]


def test_required_calls_cut_at_the_limit_keep_the_complete_ones(engine_gateway, tokenizer) -> None:
    """`required` lets the model call again after each call; favoured, it calls until the token limit. The
    calls it completed come back as OpenAI returns them: in `tool_calls`, finish_reason `length`, and no
    `<tool_call>` text as content."""
    again = {str(tokenizer.convert_tokens_to_ids("<tool_call>")): 100}
    rid = new_id("forced-cut")
    for seed in SEEDS:
        r = sdk(engine_gateway, rid).chat.completions.create(
            model="my-agent",
            messages=USER,  # type: ignore[arg-type]
            tools=[chat_tool()],  # type: ignore[list-item]
            tool_choice="required",
            max_tokens=160,  # room for a few calls: a random model spells their envelopes in many small tokens
            logit_bias=again,
            seed=seed,
        )
        (choice,) = r.choices
        assert choice.finish_reason == "length" and not choice.message.content, choice
        calls = choice.message.tool_calls or []
        assert len(calls) >= 2, choice
        completed([c.function.arguments for c in calls], every=True)  # type: ignore[union-attr]


MARKED = "a </tool_call> b <tool_call>"  # the parser's own markers, in a string argument


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
@pytest.mark.parametrize(
    ("tool_choice", "finish_reason"),
    [({"type": "function", "function": {"name": "note"}}, "stop"), ("required", "tool_calls")],
    ids=["named", "required"],
)
def test_a_string_argument_with_the_parsers_markers_is_parsed(
    engine_gateway, tool_choice: Any, finish_reason: str, stream: bool
) -> None:
    """The schema leaves one value, so the call is the same at any seed; before, non-streamed it gave no call
    (`required`: finish_reason `tool_calls` with `tool_calls` null), streamed a call with broken arguments."""
    schema = {"type": "object", "properties": {"text": {"enum": [MARKED]}}, "required": ["text"]}
    tool = {"type": "function", "function": {"name": "note", "parameters": schema}}
    request: dict[str, Any] = {
        "model": "my-agent",
        "messages": USER,
        "tools": [tool],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        # One value, but not one spelling: the random model may write it in many small tokens (64 cut it, once).
        "max_tokens": 256,
    }
    client = sdk(engine_gateway, new_id("forced-marker"))
    if stream:
        arguments: dict[int, str] = {}
        got = None
        for chunk in client.chat.completions.create(**request, stream=True):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")  # type: ignore[union-attr]
                got = choice.finish_reason or got
        calls = list(arguments.values())
    else:
        (choice,) = client.chat.completions.create(**request).choices
        got, calls = choice.finish_reason, [c.function.arguments for c in choice.message.tool_calls or []]  # type: ignore[union-attr]
    assert got == finish_reason and len(calls) == 1, (got, calls)
    assert json.loads(calls[0]) == {"text": MARKED}


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
        inputs.append(json.dumps(uses[0].input) if uses else None)
    completed(inputs, every=True)
    assert recorded_strict(engine_gateway, rid) == [True] * len(SEEDS)


def test_responses_tools_are_strict_when_the_schema_allows(engine_gateway) -> None:
    """OpenAI's rule for a Responses function tool without `strict`: strict when its schema allows it (every
    property required, no others). Forced or not, its arguments then follow the schema."""
    rid = new_id("forced-resp")
    client = sdk(engine_gateway, rid)
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
