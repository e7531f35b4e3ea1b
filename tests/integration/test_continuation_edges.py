"""A continuing (spliced) call answers what the plain path answers at its edges, through each API's own SDK.

Each test asks one request twice on the same history: as a rollout's continuing call (served from the model's own
tokens, gateway/continuation.py) and as a new rollout's first call (the plain path). At the token limit the client
is told the answer was cut (`length`, `response.incomplete`, `max_tokens`), never that a cut-off tool call ended;
at the end of sequence the stop token is not text. The record says what the client was told.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest

from tests.conftest import END_TOKEN, GatewayProcess
from tests.recorded import ROME_PARIS_QUESTION, ROME_PARIS_TOOLS, decode, new_id, one_sequence, sampled_by_call

pytestmark = pytest.mark.engine

END_BIAS = {str(END_TOKEN): 100}  # the answer ends at once: its only token is the end of sequence
FOLLOW_UP = "And tomorrow?"
SEED = 1
# A forced call cut in its arguments: the envelope's head is 13 tokens (the tokenizer's own spelling, pinned)
CUT_AT = 16
STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


def _spliced_and_plain(
    gateway: GatewayProcess, first: Callable[[str], Any], then: Callable[[str, Any], Any]
) -> tuple[Any, Any, dict[str, Any]]:
    """`then` on the history `first` leaves: as the rollout's continuing call, and as a new rollout's first call;
    and the rollout as recorded (one sequence: the continuing call was spliced)."""
    rid = new_id("edge")
    history = first(rid)
    spliced = then(rid, history)
    plain = then(new_id("plain"), history)
    return spliced, plain, one_sequence(gateway, rid, 2)


def _recorded_reply(recorded: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The continuing call's recorded finish reason and reply (the rollout's last message)."""
    (reason,) = recorded["calls"][1]["finish_reasons"]
    return reason, recorded["messages"][-1]


# -- chat completions ------------------------------------------------------------------------------------------


def _openai(gateway: GatewayProcess, rid: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", default_headers={"X-ART-Rollout-Id": rid})


def _chat(gateway: GatewayProcess, stream: bool, **fields: Any) -> Callable[[str, Any], dict[str, Any]]:
    def then(rid: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        client = _openai(gateway, rid)
        asked = dict(model="my-agent", messages=messages, tools=ROME_PARIS_TOOLS, seed=SEED, **fields)
        if stream:
            with client.chat.completions.stream(**asked, stream_options={"include_usage": True}) as events:
                for _ in events:
                    pass
                answer = events.current_completion_snapshot
        else:
            answer = client.chat.completions.create(**asked)
        (choice,) = answer.choices
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return {
            "finish_reason": choice.finish_reason,
            "content": choice.message.content,
            "tool_calls": calls,
            "completion_tokens": answer.usage.completion_tokens if answer.usage else None,
        }

    return then


def _chat_first(gateway: GatewayProcess) -> Callable[[str], list[dict[str, Any]]]:
    def first(rid: str) -> list[dict[str, Any]]:
        reply = _openai(gateway, rid).chat.completions.create(
            model="my-agent", messages=ROME_PARIS_QUESTION, tools=ROME_PARIS_TOOLS, max_tokens=8, seed=SEED
        )
        said = reply.choices[0].message.model_dump(exclude_none=True)
        return [*ROME_PARIS_QUESTION, said, {"role": "user", "content": FOLLOW_UP}]

    return first


@STREAMS
def test_chat_cut_at_max_tokens_says_length(engine_gateway: GatewayProcess, stream: bool) -> None:
    then = _chat(engine_gateway, stream, tool_choice="required", max_tokens=CUT_AT)
    spliced, plain, recorded = _spliced_and_plain(engine_gateway, _chat_first(engine_gateway), then)
    assert plain["finish_reason"] == "length"
    if stream:  # the edge: the call's name and part of its arguments streamed before the cut
        assert [name for name, _ in plain["tool_calls"]] == ["get_weather"]
    assert spliced == plain
    reason, reply = _recorded_reply(recorded)
    assert reason == "length"
    told = [(c["function"]["name"], c["function"]["arguments"]) for c in reply.get("tool_calls") or ()]
    assert told == [(name, arguments or "") for name, arguments in spliced["tool_calls"]]


@STREAMS
def test_chat_at_the_end_of_sequence_has_no_special_token(engine_gateway: GatewayProcess, stream: bool) -> None:
    then = _chat(engine_gateway, stream, max_tokens=8, logit_bias=END_BIAS)
    spliced, plain, recorded = _spliced_and_plain(engine_gateway, _chat_first(engine_gateway), then)
    assert plain == {"finish_reason": "stop", "content": "", "tool_calls": [], "completion_tokens": 1}
    assert spliced == plain
    reason, reply = _recorded_reply(recorded)
    assert (reason, reply["content"]) == ("stop", "")


# -- Responses -------------------------------------------------------------------------------------------------

RESPONSE_TOOLS = [{"type": "function", **ROME_PARIS_TOOLS[0]["function"]}]


def _responses_first(gateway: GatewayProcess) -> Callable[[str], list[dict[str, Any]]]:
    def first(rid: str) -> list[dict[str, Any]]:
        said = _openai(gateway, rid).responses.create(
            model="my-agent",
            input=ROME_PARIS_QUESTION[0]["content"],
            tools=RESPONSE_TOOLS,  # type: ignore[arg-type]
            max_output_tokens=8,
            extra_body={"seed": SEED},
        )
        kept = [item.model_dump(exclude_none=True) for item in said.output]
        return [*ROME_PARIS_QUESTION, *kept, {"role": "user", "content": FOLLOW_UP}]

    return first


def _responses(gateway: GatewayProcess, stream: bool, **fields: Any) -> Callable[[str, Any], dict[str, Any]]:
    def then(rid: str, items: list[dict[str, Any]]) -> dict[str, Any]:
        client = _openai(gateway, rid)
        asked: dict[str, Any] = dict(model="my-agent", input=items, tools=RESPONSE_TOOLS, **fields)
        last_event = None
        if stream:
            for event in client.responses.create(**asked, stream=True):
                last_event = event.type
            answer = event.response  # response.completed / .incomplete carry the whole response
        else:
            answer = client.responses.create(**asked)
        output = [
            (item.type, item.status, getattr(item, "arguments", None), getattr(item, "content", None))
            for item in answer.output
        ]
        return {
            "status": answer.status,
            "incomplete": answer.incomplete_details.reason if answer.incomplete_details else None,
            "last_event": last_event,
            "output": output,
            "output_text": answer.output_text,
            "output_tokens": answer.usage.output_tokens if answer.usage else None,
        }

    return then


@STREAMS
def test_responses_cut_at_max_output_tokens_is_incomplete(engine_gateway: GatewayProcess, stream: bool) -> None:
    then = _responses(
        engine_gateway, stream, tool_choice="required", max_output_tokens=CUT_AT, extra_body={"seed": SEED}
    )
    spliced, plain, recorded = _spliced_and_plain(engine_gateway, _responses_first(engine_gateway), then)
    assert (plain["status"], plain["incomplete"]) == ("incomplete", "max_output_tokens")
    assert plain["last_event"] == ("response.incomplete" if stream else None)
    assert spliced == plain
    assert _recorded_reply(recorded)[0] == "length"


@STREAMS
def test_responses_at_the_end_of_sequence_has_no_special_token(engine_gateway: GatewayProcess, stream: bool) -> None:
    then = _responses(engine_gateway, stream, max_output_tokens=8, extra_body={"seed": SEED, "logit_bias": END_BIAS})
    spliced, plain, recorded = _spliced_and_plain(engine_gateway, _responses_first(engine_gateway), then)
    assert (plain["status"], plain["output_text"], plain["output_tokens"]) == ("completed", "", 1)
    assert spliced == plain
    reason, reply = _recorded_reply(recorded)
    assert (reason, reply["content"]) == ("stop", "")


# -- Anthropic Messages ----------------------------------------------------------------------------------------

MESSAGE_TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "input_schema": ROME_PARIS_TOOLS[0]["function"]["parameters"],
    }
]


def _anthropic(gateway: GatewayProcess, rid: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key="unused", default_headers={"X-ART-Rollout-Id": rid})


def _messages_first(gateway: GatewayProcess, seed: int, tools: bool) -> Callable[[str], list[dict[str, Any]]]:
    def first(rid: str) -> list[dict[str, Any]]:
        asked: list[dict[str, Any]] = [{"role": "user", "content": ROME_PARIS_QUESTION[0]["content"]}]
        said = _anthropic(gateway, rid).messages.create(
            model="my-agent",
            max_tokens=8,
            messages=asked,  # type: ignore[arg-type]
            extra_body={"seed": seed},
            **({"tools": MESSAGE_TOOLS} if tools else {}),  # type: ignore[arg-type]
        )
        kept = {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in said.content]}
        return [*asked, kept, {"role": "user", "content": FOLLOW_UP}]

    return first


def _messages(gateway: GatewayProcess, stream: bool, seed: int, **fields: Any) -> Callable[[str, Any], dict[str, Any]]:
    def then(rid: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        client = _anthropic(gateway, rid)
        asked = dict(model="my-agent", messages=messages, extra_body={"seed": seed}, **fields)
        if stream:
            with client.messages.stream(**asked) as events:
                answer = events.get_final_message()
        else:
            answer = client.messages.create(**asked)
        blocks = [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in answer.content]
        return {"stop_reason": answer.stop_reason, "content": blocks, "output_tokens": answer.usage.output_tokens}

    return then


@STREAMS
def test_messages_cut_at_max_tokens_says_max_tokens(engine_gateway: GatewayProcess, stream: bool) -> None:
    then = _messages(engine_gateway, stream, SEED, tools=MESSAGE_TOOLS, tool_choice={"type": "any"}, max_tokens=CUT_AT)
    first = _messages_first(engine_gateway, SEED, tools=True)
    spliced, plain, recorded = _spliced_and_plain(engine_gateway, first, then)
    assert plain["stop_reason"] == "max_tokens"
    assert spliced == plain
    assert _recorded_reply(recorded)[0] == "length"


@STREAMS
def test_messages_at_the_end_of_sequence_has_no_special_token(
    engine_gateway: GatewayProcess, tokenizer: Any, stream: bool
) -> None:
    """Messages has no logit bias: the first seed whose continuing call the model ends itself, within its token
    limit. Its text is what the model sampled before the end of sequence (a long answer is not compared with the
    plain path's: the two prompts differ, and so may a token or two of what is sampled from them)."""
    for seed in range(24):
        rid = new_id("edge")
        said = _messages(engine_gateway, stream, seed, max_tokens=96)(
            rid, _messages_first(engine_gateway, seed, False)(rid)
        )
        if said["stop_reason"] == "end_turn":
            break
    else:
        pytest.fail("no seed's answer reached the end of sequence within 96 tokens")
    recorded = one_sequence(engine_gateway, rid, 2)
    ((kind, text, _),) = said["content"]
    sampled = sampled_by_call(recorded)[recorded["calls"][1]["id"]]
    assert (kind, text, said["output_tokens"]) == ("text", decode(tokenizer, sampled), len(sampled))
    assert sampled[-1] == END_TOKEN and "<|im_end|>" not in text
    reason, reply = _recorded_reply(recorded)
    assert (reason, reply["content"]) == ("stop", text)
