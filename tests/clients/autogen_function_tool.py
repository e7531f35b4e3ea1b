"""autogen's OpenAI client with a default FunctionTool (`strict: false`), the tool forced by tool_choice."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Literal

from _app import QUESTION, announce, result
from autogen_core.models import UserMessage
from autogen_core.tools import FunctionTool
from autogen_ext.models.openai import OpenAIChatCompletionClient

announce("autogen-ext", "autogen-core", "openai")


async def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """Current weather of a city."""
    return "sunny"


async def main() -> None:
    tool = FunctionTool(get_weather, description="Current weather of a city.")
    failures = []
    for seed in range(8):  # a random-weight model may pad the JSON past the token limit on a seed
        client = OpenAIChatCompletionClient(
            model="my-agent",
            base_url=os.environ["OPENAI_BASE_URL"],
            api_key="unused",
            max_tokens=48,
            seed=seed,
            model_info={
                "vision": False,
                "function_calling": True,
                "json_output": False,
                "family": "unknown",
                "structured_output": False,
            },
        )
        answer = await client.create([UserMessage(content=QUESTION, source="user")], tools=[tool], tool_choice=tool)
        await client.close()
        if isinstance(answer.content, list) and answer.content and answer.finish_reason != "length":
            call = answer.content[0]
            result(name=call.name, arguments=json.loads(call.arguments), strict=tool.schema.get("strict"))
            return
        failures.append(f"seed {seed}: {answer.finish_reason} {str(answer.content)[:200]}")
    sys.exit("no complete tool call in 8 seeded attempts:\n" + "\n".join(failures))


asyncio.run(main())
