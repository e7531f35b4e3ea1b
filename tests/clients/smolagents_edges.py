"""smolagents' ToolCallingAgent at its defaults (every step a `required` tool call, no `strict`) at the edges of
forced calls (#42 item 4), one step each:

- `marked`: a final answer that can only be a string holding the parser's own markers (`(choices: ...)`,
  smolagents' way of giving an argument an enum), whole and streamed (`stream_outputs`), one call a reply
  (smolagents refuses a final answer beside other calls);
- `cut`: a step whose reply is cut at the token limit after some complete calls (the engine favours `<tool_call>`:
  `logit_bias` from CALL_TOKEN, passed through as smolagents passes any extra model argument).

Prints the tool calls each step ran, with their arguments, and the calls the tools saw."""

from __future__ import annotations

import json
import os
import sys

from _app import QUESTION, announce, result
from smolagents import OpenAIServerModel, ToolCallingAgent, tool

announce("smolagents", "openai")
MARKED = "a </tool_call> b <tool_call>"
seen: list[str] = []


# smolagents adds a `final_answer` tool of its own, which the model may call instead (any text as its answer) unless
# the app gives one by that name: these are, with the argument's values pinned as each case needs.
def final_answer_tool(choices: str):
    def final_answer(answer: str) -> str:
        seen.append(answer)
        return answer

    final_answer.__doc__ = f"""The final answer.

    Args:
        answer: the answer (choices: {choices})
    """
    return tool(final_answer)


@tool
def get_weather(city: str) -> str:
    """Current weather of a city.

    Args:
        city: the city (choices: ["Paris", "Rome"])
    """
    seen.append(city)
    return "sunny"


def step(tools: list, stream: bool = False, **model_arguments: object) -> dict[str, object]:
    """One agent step: the tool calls it ran and what the tools were given."""
    seen.clear()
    model = OpenAIServerModel(
        model_id="my-agent",
        api_base=os.environ["OPENAI_BASE_URL"],
        api_key="unused",
        client_kwargs={"max_retries": 0},
        **model_arguments,
    )
    agent = ToolCallingAgent(tools=tools, model=model, max_steps=1, verbosity_level=0, stream_outputs=stream)
    output = None
    try:
        output = agent.run(QUESTION)
    except Exception as exc:  # the step's tool calls are what the test checks; the run may end without an answer
        print(f"run ended: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
    # The calls smolagents got from the model's reply (it runs them all; a final answer beside other calls it then
    # refuses, an error of the step).
    calls = [
        {"name": call.function.name, "arguments": call.function.arguments}
        for memory in agent.memory.steps
        for call in (getattr(getattr(memory, "model_output_message", None), "tool_calls", None) or ())
    ]
    errors = [str(memory.error)[:300] for memory in agent.memory.steps if getattr(memory, "error", None)]
    return {"calls": calls, "seen": list(seen), "errors": errors, "output": None if output is None else str(output)}


marked = final_answer_tool(json.dumps([MARKED]))
city = final_answer_tool(json.dumps(["Paris", "Rome"]))
result(
    marked=step([marked], max_tokens=256, parallel_tool_calls=False),
    marked_streamed=step([marked], stream=True, max_tokens=256, parallel_tool_calls=False),
    cut=step([get_weather, city], max_tokens=160, seed=0, logit_bias={os.environ["CALL_TOKEN"]: 100}),
)
