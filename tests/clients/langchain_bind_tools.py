"""LangChain's ChatOpenAI at its defaults (chat completions) with a tool bound by `bind_tools(tool_choice=...)`,
no `strict` (the endpoint from OPENAI_BASE_URL)."""

from __future__ import annotations

from typing import Literal

from _app import QUESTION, announce, first_success, result
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

announce("langchain-openai", "langchain-core", "openai")


@tool
def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """Current weather of a city."""
    return "sunny"


def ask(seed: int) -> dict:
    llm = ChatOpenAI(model="my-agent", max_tokens=48, max_retries=0, seed=seed)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(QUESTION)
    if not message.tool_calls:
        raise ValueError(f"invalid tool calls {message.invalid_tool_calls}")
    return message.tool_calls[0]


call, failures = first_success(ask, "valid tool call")
result(name=call["name"], args=call["args"], failed_seeds=failures)
