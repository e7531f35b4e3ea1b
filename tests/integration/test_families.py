"""Real model families served end to end: `artgw serve` speaks the family of the model it serves.

A tiny random-weight model with Qwen3's real tokenizer and chat template (`artgw tiny-model --family qwen3`),
served with no engine arguments: the gateway picks vLLM's hermes tool-call parser and qwen3 reasoning parser
from the model's files, says so, and the OpenAI SDK gets tool calls and reasoning in their own fields.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.conftest import WEATHER_TOOLS, start_gateway, wait_http

pytestmark = pytest.mark.engine


def test_serve_picks_qwen3s_parsers_and_answers_a_forced_call_as_tool_calls(
    family_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model = family_model("qwen3")
    gateway = start_gateway(tmp_path, "--base-model", str(model), wait=False)
    try:
        try:
            wait_http(f"{gateway.url}/readyz", 600, gateway.proc)
        except Exception:
            print(gateway.log()[-5000:])
            raise
        log = gateway.log()
        assert "vLLM's parsers: tool calls hermes, reasoning qwen3 (a Qwen3 template" in log, log[-3000:]
        started = re.search(r"starting vLLM: (.*) \(log: ", log)
        assert started is not None, log[-3000:]
        assert "--tool-call-parser artgw_hermes --reasoning-parser qwen3" in started.group(
            1
        )  # hermes: our plugin of it

        token = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused")
        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        # Thinking on: a random model closes its reasoning only when `</think>` is favoured; vLLM then samples
        # the forced call under its grammar, where `"` and `}` favoured end the JSON instead of endless whitespace.
        bias = {str(token("</think>")): 100, str(token('"')): 20, str(token("}")): 20}
        reply = client.chat.completions.create(
            model="my-agent",
            messages=question,  # type: ignore[arg-type]
            tools=WEATHER_TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=200,
            extra_body={"logit_bias": bias},
        )
        calls = reply.choices[0].message.tool_calls
        assert calls, reply.model_dump_json()
        assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
        assert json.loads(calls[0].function.arguments)["city"] in {"Paris", "Rome"}  # type: ignore[union-attr]
        assert "<tool_call>" not in (reply.choices[0].message.content or "")

        # A free answer with thinking on: the qwen3 reasoning parser puts it in `reasoning`, not in the content.
        free = client.chat.completions.create(model="my-agent", messages=question, max_tokens=8)  # type: ignore[arg-type]
        message = free.choices[0].message
        assert free.choices[0].finish_reason == "length"
        assert not message.content, message.model_dump_json()
        assert (message.model_extra or {}).get("reasoning"), message.model_dump_json()
    finally:
        gateway.stop()
