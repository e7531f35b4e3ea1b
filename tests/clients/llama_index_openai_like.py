"""llama-index's OpenAILike at its defaults: not a chat model, so `complete` goes through /v1/completions."""

from __future__ import annotations

import os

from _app import announce, result
from llama_index.llms.openai_like import OpenAILike

announce("llama-index-llms-openai-like", "llama-index-core", "openai")
llm = OpenAILike(model="my-agent", api_base=os.environ["OPENAI_BASE_URL"], api_key="unused", max_tokens=8)
result(text=llm.complete("Once upon a time").text)
