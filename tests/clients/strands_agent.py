"""strands' default Agent on its OpenAI model: no tools (`tools: []`), then structured output (a forced tool)."""

from __future__ import annotations

import os
from typing import Literal

from _app import QUESTION, announce, result
from pydantic import BaseModel
from strands import Agent
from strands.models.openai import OpenAIModel
from strands.types.exceptions import MaxTokensReachedException

announce("strands-agents", "openai")


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]


model = OpenAIModel(
    client_args={"base_url": os.environ["OPENAI_BASE_URL"], "api_key": "unused", "max_retries": 0},
    model_id="my-agent",
    params={"max_tokens": 48},
)
try:  # a random-weight model writes until the token limit, which strands raises
    text = str(Agent(model=model, callback_handler=None)("Say hi."))
except MaxTokensReachedException:
    text = "(max tokens)"
failures = []
weather = None
for _ in range(4):  # a random-weight model may pad the JSON past the token limit
    try:
        weather = Agent(model=model, callback_handler=None).structured_output(Weather, QUESTION)
        break
    except Exception as exc:
        failures.append(f"{type(exc).__name__}: {str(exc)[:200]}")
result(text=text, city=weather.city if weather else None, failures=failures)
