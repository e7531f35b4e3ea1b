"""llama-index's structured_predict on OpenAILike as a function-calling chat model (a forced tool, no `strict`)."""

from __future__ import annotations

import os
from typing import Literal

from _app import QUESTION, announce, first_success, result
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.openai_like import OpenAILike
from pydantic import BaseModel

announce("llama-index-llms-openai-like", "llama-index-core", "openai")


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]


def ask(seed: int) -> Weather:
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
    return llm.structured_predict(Weather, PromptTemplate(QUESTION))


weather, failures = first_success(ask, "valid Weather")
result(city=weather.city, failed_seeds=failures)
