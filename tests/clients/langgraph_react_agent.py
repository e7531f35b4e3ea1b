"""LangGraph's prebuilt react agent on langchain-openai's ChatOpenAI at its defaults (the endpoint from
OPENAI_BASE_URL), each attempt tagged with its own rollout id (`ROLLOUT_ID`-`seed`). Its model is chosen per
turn: the tool is forced for the first two turns, then the agent answers with the tool offered, so one run is a
three-call tool loop."""

from __future__ import annotations

import os
from typing import Literal

from _app import QUESTION, announce, first_success, result
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

announce("langgraph", "langgraph-prebuilt", "langchain-openai")
asked: list[str] = []


@tool
def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """Current weather of a city."""
    asked.append(city)
    return "sunny"


def attempt(seed: int) -> tuple[int, list[str]]:
    rollout = f"{os.environ['ROLLOUT_ID']}-{seed}"
    llm = ChatOpenAI(model="my-agent", max_tokens=48, seed=seed, default_headers={"X-ART-Rollout-Id": rollout})
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    offered = llm.bind_tools([get_weather])

    def model(state: dict, runtime: object) -> object:
        # user, (assistant tool call, tool result) twice, then an answer
        return forced if len(state["messages"]) < 5 else offered

    agent = create_react_agent(model, [get_weather])
    run = agent.invoke({"messages": [("user", QUESTION)]}, {"recursion_limit": 8})
    return seed, [type(m).__name__ for m in run["messages"]]


(seed, kinds), failures = first_success(attempt, "react agent run")
result(seed=seed, messages=kinds, asked=asked, failed_seeds=failures)
