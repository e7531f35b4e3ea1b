"""The OpenAI Agents SDK at its defaults (the Responses API; the endpoint from OPENAI_BASE_URL): a tool agent
forced to call its tool first, run to completion. APP_EXTRA_BODY (JSON): more request fields (a test's logit_bias
that closes a random model's reasoning)."""

from __future__ import annotations

import json
import os
import sys
from typing import Literal

from _app import INSTRUCTIONS, QUESTION, announce, result
from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled

announce("openai-agents", "openai")
set_tracing_disabled(True)  # traces would go to OpenAI's servers
asked: list[str] = []


@function_tool
def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """Current weather of a city."""
    asked.append(city)
    return "sunny"


failures: list[str] = []
for seed in range(8):
    agent = Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        model="my-agent",
        tools=[get_weather],
        # Forced to call the tool first; the SDK resets tool_choice after a tool call, so the run ends.
        model_settings=ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=64,
            extra_body={"seed": seed, **json.loads(os.environ.get("APP_EXTRA_BODY", "{}"))},
        ),
    )
    try:
        run = Runner.run_sync(agent, QUESTION, max_turns=3, run_config=RunConfig(tracing_disabled=True))
    except Exception as exc:  # a random-weight model may pad its JSON past the token limit on a seed
        failures.append(f"seed {seed}: {type(exc).__name__}: {exc}")
        continue
    result(final_output=run.final_output, asked=asked, failed_seeds=failures)
    break
else:
    sys.exit("the agent never completed in 8 seeded attempts:\n" + "\n".join(failures))
