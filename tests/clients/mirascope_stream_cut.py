"""mirascope v2 (`llm.Model`, its OpenAI provider: the Responses API for an `openai/` model it does not know) with
a tool and a structured answer in `tool` mode, which it asks for as `tool_choice: {"type": "allowed_tools", "mode":
"required"}`: a forced call that ends, then a stream going on from it with a token limit that cuts the next
forced call (#42 item 1). The stream is asked twice on the same history: as the rollout's continuing call
(OPENAI_BASE_URL) and as a new rollout's first call (PLAIN_ROLLOUT). Greedy: mirascope sends no `seed` to the
Responses API."""

from __future__ import annotations

import os
from typing import Literal

from _app import announce, result
from mirascope import llm
from pydantic import BaseModel

announce("mirascope", "openai")


class Answer(BaseModel):
    summary: Literal["sunny", "rainy"]  # short: a random model's free string would run to any limit


@llm.tool
def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """Current weather of a city."""
    return "sunny"


forced = llm.format(Answer, mode="tool")
# The first call has the tools the stream has (another set of tools is a new sequence), forced too: cut early
# (under `required` a random model calls again and again until its limit).
first = llm.Model("openai/my-agent", max_tokens=8, temperature=0).call(
    "What is the weather in Rome and in Paris?", tools=[get_weather], format=forced
)
history = [*first.messages, llm.messages.user("And tomorrow?")]


def cut(base_url: str, limit: int) -> dict[str, object]:
    llm.register_provider("openai", base_url=base_url, api_key="unused")
    stream = llm.Model("openai/my-agent", max_tokens=limit, temperature=0).stream(
        history, tools=[get_weather], format=forced
    )
    stream.finish()
    return {
        "finish_reason": stream.finish_reason and stream.finish_reason.value,
        "tool_calls": [(call.name, call.args) for call in stream.tool_calls],
        "texts": [text.text for text in stream.texts],  # the structured answer's call is text to mirascope
    }


# A stream cut before any call's name (8 tokens: inside `<tool_call>`): mirascope 2.8 raised on the empty message
# the gateway sent for it (`output_text.done` with no delta before it).
try:
    early: object = cut(f"{os.environ['PLAIN_ROLLOUT']}-early/v1", 8)
except RuntimeError as error:
    early = str(error)

# The first limit at which the plain stream is cut inside a call, past its name: of get_weather, or of the
# structured answer's tool, whose arguments mirascope streams as text. Each plain try is a new rollout
# (PLAIN_ROLLOUT-limit), so that none continues another.
tried = {}
for limit in range(24, 80, 4):
    plain = cut(f"{os.environ['PLAIN_ROLLOUT']}-{limit}/v1", limit)
    if plain["finish_reason"] == "max_tokens" and (plain["tool_calls"] or plain["texts"]):
        spliced = cut(os.environ["OPENAI_BASE_URL"], limit)
        result(limit=limit, tried=tried, early=early, plain=plain, spliced=spliced)
        break
    tried[limit] = plain
else:
    raise SystemExit(f"no limit cut the plain stream inside a call: {tried}")
