"""pydantic-ai's default OpenAI model (`openai:NAME`: the Responses API, the endpoint from OPENAI_BASE_URL)."""

from __future__ import annotations

from _app import INSTRUCTIONS, QUESTION, announce, result
from pydantic_ai import Agent

announce("pydantic-ai-slim", "openai")
agent = Agent("openai:my-agent", instructions=INSTRUCTIONS)
run = agent.run_sync(QUESTION, model_settings={"max_tokens": 8})
result(output=run.output)
