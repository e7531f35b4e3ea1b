"""instructor at its default mode for OpenAI (TOOLS: the response model as a forced tool, no `strict`)."""

from __future__ import annotations

from typing import Literal

import instructor
import openai
from _app import QUESTION, announce, first_success, result
from pydantic import BaseModel

announce("instructor", "openai")


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]


client = instructor.from_openai(openai.OpenAI(max_retries=0))


def ask(seed: int) -> Weather:
    return client.chat.completions.create(
        model="my-agent",
        response_model=Weather,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=48,
        max_retries=0,
        extra_body={"seed": seed},
    )


weather, failures = first_success(ask, "valid Weather")
result(city=weather.city, failed_seeds=failures)
