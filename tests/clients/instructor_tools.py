"""instructor at its default mode for OpenAI (TOOLS: the response model as a forced tool, no `strict`)."""

from __future__ import annotations

import sys
from typing import Literal

import instructor
import openai
from _app import QUESTION, announce, result
from pydantic import BaseModel

announce("instructor", "openai")


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]


client = instructor.from_openai(openai.OpenAI(max_retries=0))
failures = []
for seed in range(8):  # a random-weight model may pad the JSON with whitespace past the token limit on a seed
    try:
        weather = client.chat.completions.create(
            model="my-agent",
            response_model=Weather,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=48,
            max_retries=0,
            extra_body={"seed": seed},
        )
    except Exception as exc:
        failures.append(f"seed {seed}: {type(exc).__name__}: {str(exc)[:300]}")
        continue
    result(city=weather.city, failed_seeds=failures)
    break
else:
    sys.exit("no valid Weather in 8 seeded attempts:\n" + "\n".join(failures))
