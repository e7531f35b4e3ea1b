"""Agent frameworks at their default settings, pointed at the gateway by OPENAI_BASE_URL alone, as an app
configured by environment would be. Each app (tests/clients/) runs in the frameworks' own locked environment
(.venv-clients), as a process of its own; the test reads back what the gateway recorded of it."""

from __future__ import annotations

import pytest

from tests.conftest import poll, run_client
from tests.recorded import app_env, rollout, texts

pytestmark = pytest.mark.engine


def test_openai_agents_sdk_default_settings_runs_a_tool_agent_to_completion(engine_gateway, tokenizer) -> None:
    rid, env = app_env(engine_gateway)
    run = run_client("agents_sdk_tool_agent", env)
    assert run["asked"] and run["asked"][-1] in ("Paris", "Rome")
    assert isinstance(run["final_output"], str)
    recorded = poll(lambda: rollout(engine_gateway, rid), 60, "the rollout")
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
    # One rollout, one sequence (gateway/continuation.py): the answer turn went on from the tokens the model
    # sampled for its tool call, on the default Responses API.
    assert recorded["sequences"][-1]["call_ids"][-2:] == [tool_turn["id"], answer_turn["id"]]


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


# ---------------------------------------------------------------- forced tool calls at the frameworks' defaults (#27)


def forced_calls_strict(gateway, rollout_id: str) -> list[dict]:
    """The rollout's calls that forced a tool: each recorded with its tools strict (as the engine got them)."""
    calls = poll(lambda: rollout(gateway, rollout_id)["calls"], 60, "the rollout")
    forced = [
        c for c in calls if c["grammar_request"] and c["grammar_request"].get("tool_choice") not in (None, "auto")
    ]
    assert forced, calls
    for call in forced:
        assert all(t["function"].get("strict") for t in call["grammar_request"]["tools"]), call
    return forced


def test_instructor_tools_mode_gets_a_valid_model(engine_gateway) -> None:
    rid, env = app_env(engine_gateway)
    run = run_client("instructor_tools", env)
    assert run["city"] in ("Paris", "Rome")
    forced_calls_strict(engine_gateway, rid)


def test_smolagents_tool_calling_agent_calls_its_tools_with_valid_arguments(engine_gateway) -> None:
    rid, env = app_env(engine_gateway)
    run = run_client("smolagents_tool_calling", env)
    recorded = rollout(engine_gateway, rid)["calls"]
    seen = [
        (c["status"], c["error"], c["finish_reasons"], (c["grammar_request"] or {}).get("tool_choice"))
        for c in recorded
    ]
    assert run["steps"], (run, seen)
    for step in run["steps"]:
        assert step["name"] in ("get_weather", "final_answer") and isinstance(step["arguments"], dict), step
        if step["name"] == "get_weather":
            assert isinstance(step["arguments"].get("city"), str), step
    forced_calls_strict(engine_gateway, rid)


def test_autogen_function_tool_forced_gets_valid_arguments(engine_gateway) -> None:
    rid, env = app_env(engine_gateway)
    run = run_client("autogen_function_tool", env)
    assert run["strict"] is False  # autogen's default: the gateway makes the forced call strict all the same
    assert run["name"] == "get_weather" and run["arguments"]["city"] in ("Paris", "Rome")
    forced_calls_strict(engine_gateway, rid)


def test_strands_default_agent_with_no_tools_and_structured_output(engine_gateway) -> None:
    rid, env = app_env(engine_gateway)
    run = run_client("strands_agent", env)
    assert isinstance(run["text"], str)  # `tools: []` was a 400 from vLLM
    assert run["city"] in ("Paris", "Rome"), run
    calls = rollout(engine_gateway, rid)["calls"]
    assert calls[0]["status"] == "ok"


def test_llama_index_structured_predict_gets_a_valid_model(engine_gateway) -> None:
    rid, env = app_env(engine_gateway)
    run = run_client("llama_index_structured_predict", env)
    assert run["city"] in ("Paris", "Rome")
    forced_calls_strict(engine_gateway, rid)


def test_vercel_ai_sdk_forced_tool_gets_a_valid_input(engine_gateway) -> None:
    """Vercel's `ai` with `@ai-sdk/openai` (Node), toolChoice naming the tool (#27: ToolChoiceViolationError)."""
    rid, env = app_env(engine_gateway)
    run = run_client("vercel_forced_tool", env)
    (call,) = run["calls"]
    assert call["name"] == "get_weather" and call["input"]["city"] in ("Paris", "Rome"), run
    forced_calls_strict(engine_gateway, rid)


def test_openai_agents_js_calls_its_tool_with_a_valid_input(engine_gateway) -> None:
    """`@openai/agents` (Node) with a tool, one provider per run (the SDK keeps the first client it is given)."""
    rid, env = app_env(engine_gateway)
    run = run_client("openai_agents_tool", env)
    assert run["asked"] and all(city in ("Paris", "Rome") for city in run["asked"]), run
    forced_calls_strict(engine_gateway, rid)


def test_langchain_bind_tools_with_tool_choice_gets_valid_arguments(engine_gateway) -> None:
    rid, env = app_env(engine_gateway)
    run = run_client("langchain_bind_tools", env)
    assert run["name"] == "get_weather" and run["args"]["city"] in ("Paris", "Rome"), run
    forced_calls_strict(engine_gateway, rid)
