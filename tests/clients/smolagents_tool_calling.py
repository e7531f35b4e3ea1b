"""smolagents' ToolCallingAgent at its defaults (every step a `required` tool call, no `strict`)."""

from __future__ import annotations

import os

from _app import QUESTION, announce, result
from smolagents import OpenAIServerModel, ToolCallingAgent, tool

announce("smolagents", "openai")
asked: list[str] = []


@tool
def get_weather(city: str) -> str:
    """Current weather of a city.

    Args:
        city: the city, Paris or Rome.
    """
    asked.append(city)
    return "sunny"


steps: list[dict[str, object]] = []
output = ""
for seed in range(8):  # a random-weight model may pad the JSON past the token limit on a seed
    model = OpenAIServerModel(
        model_id="my-agent",
        api_base=os.environ["OPENAI_BASE_URL"],
        api_key="unused",
        client_kwargs={"max_retries": 0},
        max_tokens=96,
        seed=seed,
    )
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=1, verbosity_level=0)
    try:
        output = str(agent.run(QUESTION))
    except Exception as exc:  # the step's tool calls are what the test checks; the run may end without an answer
        output = type(exc).__name__
    steps = [
        {"name": call.name, "arguments": call.arguments}
        for step in agent.memory.steps
        for call in (getattr(step, "tool_calls", None) or ())
    ]
    if steps:
        break
result(steps=steps, asked=asked, output=output[:200])
