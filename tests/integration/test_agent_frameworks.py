"""Agent frameworks at their default settings, pointed at the gateway by OPENAI_BASE_URL alone, as an app
configured by environment would be. Each app (tests/clients/) runs in the frameworks' own locked environment
(.venv-clients), as a process of its own; the test reads back what the gateway recorded of it."""

from __future__ import annotations

import pytest

from tests.conftest import poll, run_client
from tests.recorded import new_id, rollout, texts

pytestmark = pytest.mark.engine


def app_env(gateway) -> tuple[str, dict[str, str]]:
    """A new rollout id and the environment of an app whose base URL points at that rollout of the gateway."""
    rid = new_id("env")
    return rid, {"OPENAI_BASE_URL": f"{gateway.url}/rollouts/{rid}/v1", "OPENAI_API_KEY": "unused"}


def test_openai_agents_sdk_default_settings_runs_a_tool_agent_to_completion(engine_gateway, tokenizer) -> None:
    rid, env = app_env(engine_gateway)
    run = run_client("agents_sdk_tool_agent", env)
    assert run["asked"] and run["asked"][-1] in ("Paris", "Rome")
    assert isinstance(run["final_output"], str)
    recorded = poll(lambda: rollout(engine_gateway, rid), 10, "the rollout")
    calls = [c for c in recorded["calls"] if c["status"] == "ok"]
    assert {c["api"] for c in recorded["calls"]} == {"responses"}
    # The successful run's last two calls: the forced tool call, then the answer after the tool's result.
    tool_turn, answer_turn = calls[-2:]
    # Both are sampled under a grammar: the answer turn's tool_choice is back to `auto`, but the Agents SDK's
    # function tools are `strict`, so vLLM constrains whatever would follow a `<tool_call>`.
    assert tool_turn["constrained"] is True and answer_turn["constrained"] is True
    answer_request = answer_turn["grammar_request"]
    assert answer_request.get("tool_choice", "auto") == "auto"
    assert all(tool["function"]["strict"] for tool in answer_request["tools"])
    assert recorded["messages"][-2] == {
        "role": "tool",
        "tool_call_id": recorded["messages"][-3]["tool_calls"][0]["id"],
        "content": "sunny",
    }
    assert texts(recorded, tokenizer)[-1] == run["final_output"]


def test_pydantic_ai_default_openai_model(engine_gateway, tokenizer) -> None:
    rid, env = app_env(engine_gateway)
    run = run_client("pydantic_ai_agent", env)
    recorded = rollout(engine_gateway, rid)
    (call,) = recorded["calls"]
    assert call["api"] == "responses" and call["status"] == "ok"
    assert texts(recorded, tokenizer) == [run["output"]]


def test_langchain_responses_mode(engine_gateway, tokenizer) -> None:
    rid, env = app_env(engine_gateway)
    run = run_client("langchain_responses", env)
    recorded = rollout(engine_gateway, rid)
    (call,) = recorded["calls"]
    assert call["api"] == "responses"
    assert texts(recorded, tokenizer) == [run["text"]]


def test_llama_index_openai_like_defaults(engine_gateway, tokenizer) -> None:
    rid, env = app_env(engine_gateway)
    run = run_client("llama_index_openai_like", env)
    recorded = rollout(engine_gateway, rid)
    (call,) = recorded["calls"]
    assert call["api"] == "completions"  # OpenAILike's default: not a chat model
    assert texts(recorded, tokenizer) == [run["text"]]
