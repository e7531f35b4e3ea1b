"""LangChain's ChatOpenAI in Responses mode (the endpoint from OPENAI_BASE_URL)."""

from __future__ import annotations

from _app import QUESTION, announce, result
from langchain_openai import ChatOpenAI

announce("langchain-openai", "langchain-core", "openai")
llm = ChatOpenAI(model="my-agent", use_responses_api=True, max_tokens=8, max_retries=0)
result(text=llm.invoke(QUESTION).text)
