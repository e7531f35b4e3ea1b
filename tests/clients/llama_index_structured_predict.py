"""llama-index's structured_predict on OpenAILike as a function-calling chat model (a forced tool, no `strict`)."""

from __future__ import annotations

import os
import sys
from typing import Literal

from _app import QUESTION, announce, result
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.openai_like import OpenAILike
from pydantic import BaseModel

announce("llama-index-llms-openai-like", "llama-index-core", "openai")


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]


failures = []
for seed in range(8):  # a random-weight model may pad the JSON past the token limit on a seed
    llm = OpenAILike(
        model="my-agent",
        api_base=os.environ["OPENAI_BASE_URL"],
        api_key="unused",
        is_chat_model=True,
        is_function_calling_model=True,
        max_tokens=48,
        max_retries=0,
        additional_kwargs={"seed": seed},
    )
    try:
        weather = llm.structured_predict(Weather, PromptTemplate(QUESTION))
    except Exception as exc:
        failures.append(f"seed {seed}: {type(exc).__name__}: {str(exc)[:300]}")
        continue
    result(city=weather.city, failed_seeds=failures)
    break
else:
    sys.exit("no valid Weather in 8 seeded attempts:\n" + "\n".join(failures))
