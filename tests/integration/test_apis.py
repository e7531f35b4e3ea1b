"""Every API an agent app speaks, driven by the real clients, unmodified, through the gateway to a real vLLM.

Each test reads its rollout back and checks token-exactness: the sampled token ids the gateway recorded decode
to exactly the text the client received (never a re-tokenization of it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.recorded import decode, new_id, rollout, sampled_by_call, texts

pytestmark = pytest.mark.engine

INSTRUCTIONS = "You answer briefly."
QUESTION = "What is the weather?"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": WEATHER_SCHEMA,
    "strict": True,  # vLLM samples a tool's arguments under its schema only when strict
}


def openai_client(gateway, rollout_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout_id}/v1", api_key="unused", max_retries=0)


def forced_tool_call(create, **kwargs: Any) -> Any:
    """A forced call of get_weather: guided decoding closes the JSON, though a random-weight model may pad it
    with whitespace until the token limit on some seeds; the first seed that completes it wins."""
    for seed in range(8):
        result = create(seed=seed, **kwargs)
        if result is not None:
            return result
    pytest.fail("no complete tool call in 8 seeded attempts")


# ---------------------------------------------------------------- Responses, with the OpenAI SDK


def test_responses_plain_is_recorded_token_exactly(engine_gateway, tokenizer) -> None:
    rid = new_id("resp")
    client = openai_client(engine_gateway, rid)
    r = client.responses.create(model="my-agent", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=16)
    assert r.status in ("completed", "incomplete") and r.model == "my-agent"
    recorded = rollout(engine_gateway, rid)
    (call,) = recorded["calls"]
    assert (call["api"], call["status"], call["stream"]) == ("responses", "ok", False)
    assert texts(recorded, tokenizer) == [r.output_text]
    assert len(sampled_by_call(recorded)[call["id"]]) == r.usage.output_tokens
    # What the model saw: the instructions as a system turn, then the input.
    assert recorded["messages"][:2] == [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": QUESTION},
    ]


def test_responses_streamed_through_the_sdk_helper(engine_gateway, tokenizer) -> None:
    rid = new_id("resp-stream")
    client = openai_client(engine_gateway, rid)
    # Cut off at the token limit, the stream ends as OpenAI's does: `response.incomplete` with the whole response.
    with client.responses.stream(model="my-agent", input=QUESTION, max_output_tokens=16) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    assert "".join(deltas) == final.output_text
    # Ended by the model (its end-of-turn token forced): `response.completed`, which the helper returns.
    eos = {str(tokenizer.convert_tokens_to_ids("<|im_end|>")): 100}
    with client.responses.stream(
        model="my-agent", input=QUESTION, max_output_tokens=16, extra_body={"logit_bias": eos}
    ) as stream:
        done = stream.get_final_response()
    assert (done.status, done.output_text) == ("completed", "")
    recorded = rollout(engine_gateway, rid)
    first, second = recorded["calls"]
    assert [(c["api"], c["stream"]) for c in (first, second)] == [("responses", True), ("responses", True)]
    assert texts(recorded, tokenizer) == [final.output_text, ""]
    assert final.usage is not None and final.usage.output_tokens == len(sampled_by_call(recorded)[first["id"]])


def test_responses_function_tool_gives_a_function_call_item(engine_gateway, tokenizer) -> None:
    rid = new_id("resp-tool")
    client = openai_client(engine_gateway, rid)

    def create(seed: int) -> Any:
        r = client.responses.create(
            model="my-agent",
            input=QUESTION,
            tools=[RESPONSES_TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=200,
            extra_body={"seed": seed},
        )
        calls = [item for item in r.output if item.type == "function_call"]
        return r if calls and r.status == "completed" else None

    r = forced_tool_call(create)
    (item,) = [item for item in r.output if item.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments)["city"] in ("Paris", "Rome")
    recorded = rollout(engine_gateway, rid)
    last = recorded["calls"][-1]
    assert last["api"] == "responses" and last["constrained"] is True
    decoded = decode(tokenizer, sampled_by_call(recorded)[last["id"]])
    assert "".join(item.arguments.split()) in "".join(decoded.split())


TIME_TOOL = {"type": "function", "name": "get_time", "parameters": WEATHER_SCHEMA, "strict": True}


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_allowed_tools_offers_the_model_only_those(engine_gateway, api: str) -> None:
    """OpenAI's `tool_choice: {"type": "allowed_tools", ...}` (Responses: mode and tools; chat: under
    `allowed_tools`), as mirascope sends it. Before: Responses refused it (`tool_choice.type`) and vLLM refused
    chat's (naming `tool_choice.function`). Now the model is offered only the allowed tools, `required` forcing
    one of them, and the record holds what the engine was given; the answer echoes the choice as sent."""
    rid = new_id(f"allowed-{api}")
    client = openai_client(engine_gateway, rid)

    def create(seed: int) -> Any:
        if api == "responses":
            allowed = {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "get_weather"}],
            }
            r = client.responses.create(
                model="my-agent",
                input=QUESTION,
                tools=[TIME_TOOL, RESPONSES_TOOL],
                tool_choice=allowed,
                max_output_tokens=200,
                extra_body={"seed": seed},
            )
            assert r.tool_choice.type == "allowed_tools" and r.tool_choice.tools == allowed["tools"]
            return [item.name for item in r.output if item.type == "function_call"] if r.status == "completed" else None
        chat_tools = [
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
            for t in (TIME_TOOL, RESPONSES_TOOL)
        ]
        weather = {"type": "function", "function": {"name": "get_weather"}}
        c = client.chat.completions.create(
            model="my-agent",
            messages=[{"role": "user", "content": QUESTION}],
            tools=chat_tools,
            tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [weather]}},
            max_tokens=200,
            seed=seed,
        )
        calls = c.choices[0].message.tool_calls
        return [call.function.name for call in calls] if calls and c.choices[0].finish_reason != "length" else None

    names = forced_tool_call(create)
    assert names and set(names) == {"get_weather"}
    (call,) = rollout(engine_gateway, rid)["calls"][-1:]
    sampled_under = call["grammar_request"]  # what the trainer rebuilds the engine's grammar from
    assert [tool["function"]["name"] for tool in sampled_under["tools"]] == ["get_weather"]
    assert sampled_under["tool_choice"] == "required"


def test_previous_response_id_continues_the_conversation_and_stored_responses_can_be_read(
    engine_gateway, tokenizer
) -> None:
    rid = new_id("resp-chain")
    client = openai_client(engine_gateway, rid)
    first = client.responses.create(model="my-agent", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=8)
    second = client.responses.create(
        model="my-agent", previous_response_id=first.id, input="And tomorrow?", max_output_tokens=8
    )
    recorded = rollout(engine_gateway, rid)
    assert [c["api"] for c in recorded["calls"]] == ["responses", "responses"]
    assert texts(recorded, tokenizer) == [first.output_text, second.output_text]
    # The second call saw the first turn (its input and its answer), without the first call's instructions:
    # OpenAI does not carry instructions over.
    assert recorded["messages"] == [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": second.output_text},
    ]
    # Reading and deleting what is stored takes a key, even with --auth off (#40): the admin's reads any.
    admin = openai.OpenAI(base_url=f"{engine_gateway.url}/v1", api_key=engine_gateway.admin_key, max_retries=0)
    got = admin.responses.retrieve(first.id)
    assert (got.id, got.output_text) == (first.id, first.output_text)
    items = admin.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["And tomorrow?"]
    admin.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        admin.responses.retrieve(first.id)
    assert gone.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model="my-agent", previous_response_id=first.id, input="hi", max_output_tokens=2)
    assert unknown.value.body == {
        "message": f"Previous response with id '{first.id}' not found.",
        "type": "not_found_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
    assert unknown.value.response.headers["X-ART-Rollout-Id"] == rid  # errors carry the rollout id too


# ---------------------------------------------------------------- Completions and models, with the OpenAI SDK


def test_completions_text_token_ids_n_and_stream(engine_gateway, tokenizer) -> None:
    rid = new_id("cmpl")
    client = openai_client(engine_gateway, rid)
    text = client.completions.create(model="my-agent", prompt="Once upon a time", max_tokens=8, temperature=0)
    prompt_ids = tokenizer.encode("Once upon a time")
    ids = client.completions.create(model="my-agent", prompt=prompt_ids, max_tokens=8, temperature=0)
    # The same prompt as text and as token ids: the same greedy answer.
    assert ids.choices[0].text == text.choices[0].text
    recorded = rollout(engine_gateway, rid)
    assert [c["api"] for c in recorded["calls"]] == ["completions", "completions"]
    assert texts(recorded, tokenizer) == [text.choices[0].text, ids.choices[0].text]
    assert recorded["sequences"][-1]["token_ids"][: len(prompt_ids)] == prompt_ids

    rid_n = new_id("cmpl-n")
    two = openai_client(engine_gateway, rid_n).completions.create(
        model="my-agent", prompt="Once upon a time", max_tokens=8, n=2
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    for choice in two.choices:
        one = rollout(engine_gateway, f"{rid_n}/{choice.index}")
        assert one["rollout_id"] == f"{rid_n}/{choice.index}"
        assert texts(one, tokenizer) == [choice.text]

    rid_s = new_id("cmpl-stream")
    stream = openai_client(engine_gateway, rid_s).completions.create(
        model="my-agent", prompt="Once upon a time", max_tokens=8, stream=True
    )
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    recorded = rollout(engine_gateway, rid_s)
    assert (recorded["calls"][0]["api"], recorded["calls"][0]["stream"]) == ("completions", True)
    assert texts(recorded, tokenizer) == [streamed]


def test_completions_asked_for_token_ids_and_logprobs_get_them(engine_gateway) -> None:
    client = openai_client(engine_gateway, new_id("cmpl-ids"))
    plain = client.completions.create(model="my-agent", prompt="Hi", max_tokens=4)
    assert plain.choices[0].logprobs is None and plain.model_dump()["choices"][0].get("token_ids") is None
    asked = client.completions.create(
        model="my-agent", prompt="Hi", max_tokens=4, logprobs=2, extra_body={"return_token_ids": True}
    )
    raw = asked.model_dump()["choices"][0]
    assert len(raw["token_ids"]) == len(asked.choices[0].logprobs.token_logprobs) >= 1
    assert all(len(top) <= 3 for top in asked.choices[0].logprobs.top_logprobs)


def test_models_retrieve(engine_gateway) -> None:
    client = openai.OpenAI(base_url=engine_gateway.base_url, api_key="unused", max_retries=0)
    model = client.models.retrieve("my-agent")
    assert (model.id, model.object) == ("my-agent", "model")
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert missing.value.body["code"] == "model_not_found"


# ---------------------------------------------------------------- Anthropic's SDK


def anthropic_client(gateway, rollout_id: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{gateway.url}/rollouts/{rollout_id}", api_key="unused", max_retries=0)


def test_anthropic_messages_plain_and_streamed(engine_gateway, tokenizer) -> None:
    rid = new_id("msg")
    client = anthropic_client(engine_gateway, rid)
    message = client.messages.create(
        model="my-agent", system=INSTRUCTIONS, messages=[{"role": "user", "content": QUESTION}], max_tokens=16
    )
    assert message.role == "assistant" and message.stop_reason in ("end_turn", "max_tokens")
    text = "".join(block.text for block in message.content if block.type == "text")
    with client.messages.stream(
        model="my-agent", messages=[{"role": "user", "content": QUESTION}], max_tokens=16
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(b.text for b in final.content if b.type == "text") == streamed
    recorded = rollout(engine_gateway, rid)
    assert [(c["api"], c["stream"]) for c in recorded["calls"]] == [("messages", False), ("messages", True)]
    assert texts(recorded, tokenizer) == [text, streamed]
    assert final.usage.output_tokens == len(sampled_by_call(recorded)[recorded["calls"][1]["id"]])


def test_anthropic_tool_use_then_tool_result(engine_gateway, tokenizer) -> None:
    rid = new_id("msg-tool")
    client = anthropic_client(engine_gateway, rid)
    user = [{"role": "user", "content": QUESTION}]

    def create(seed: int) -> Any:
        m = client.messages.create(
            model="my-agent",
            messages=user,
            tools=[ANTHROPIC_TOOL],
            tool_choice={"type": "tool", "name": "get_weather"},
            max_tokens=200,
            extra_body={"seed": seed},
        )
        uses = [b for b in m.content if b.type == "tool_use"]
        return m if m.stop_reason == "tool_use" and uses and "city" in uses[0].input else None

    first = forced_tool_call(create)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Rome")
    second = client.messages.create(
        model="my-agent",
        messages=[
            *user,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
        ],
        tools=[ANTHROPIC_TOOL],
        max_tokens=8,
    )
    recorded = rollout(engine_gateway, rid)
    last = recorded["calls"][-1]
    assert last["api"] == "messages" and last["status"] == "ok"
    # The tool result reached the model as a tool turn after the assistant's call.
    assert recorded["messages"][-3]["tool_calls"][0]["id"] == use.id
    assert recorded["messages"][-2] == {"role": "tool", "tool_call_id": use.id, "content": "sunny"}
    text = "".join(b.text for b in second.content if b.type == "text")
    assert texts(recorded, tokenizer)[-1] == text


def test_anthropic_errors_are_in_anthropics_shape(engine_gateway) -> None:
    client = anthropic_client(engine_gateway, new_id("msg-err"))
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert missing.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "The model `nope` does not exist or you do not have access to it.",
        },
    }
    r = httpx.post(f"{engine_gateway.base_url}/messages", json={"model": "my-agent", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_anthropic_count_tokens_is_the_engines_count_of_the_prompt(engine_gateway) -> None:
    """`messages.count_tokens` (#27: a 404 in OpenAI's shape): the prompt tokens the engine gets for the same
    Messages request, tools and system prompt included; nothing recorded. Other paths under /v1/messages
    answer in Anthropic's shape too."""
    rid = new_id("count")
    client = anthropic_client(engine_gateway, rid)
    asked = {"model": "my-agent", "system": INSTRUCTIONS, "messages": [{"role": "user", "content": QUESTION}]}
    for tools in ([], [ANTHROPIC_TOOL]):
        counted = client.messages.count_tokens(**asked, tools=tools)  # type: ignore[arg-type]
        made = client.messages.create(**asked, tools=tools, max_tokens=1)  # type: ignore[arg-type]
        assert counted.input_tokens == made.usage.input_tokens > 0
    with_tool = client.messages.count_tokens(**asked, tools=[ANTHROPIC_TOOL])  # type: ignore[arg-type]
    assert with_tool.input_tokens > client.messages.count_tokens(**asked).input_tokens  # type: ignore[arg-type]
    assert len(rollout(engine_gateway, rid)["calls"]) == 2  # the two creates; no count is a call
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.count_tokens(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    for method, path in (("GET", "/messages"), ("POST", "/messages/batches"), ("GET", "/messages/count_tokens")):
        r = httpx.request(method, f"{engine_gateway.base_url}{path}", json={})
        assert r.status_code in (404, 405) and r.json()["type"] == "error", (path, r.text)
        assert r.json()["error"]["type"] == ("not_found_error" if r.status_code == 404 else "invalid_request_error")


# ---------------------------------------------------------------- one rollout, several APIs


def test_a_rollout_mixing_chat_responses_completions_and_messages_is_one_trajectory(engine_gateway, tokenizer) -> None:
    """Calls of different APIs extend each other by token prefix exactly as chat calls do."""
    rid = new_id("mixed")
    client = openai_client(engine_gateway, rid)
    the = tokenizer.convert_tokens_to_ids("the")
    force_the = {"max_tokens": 1, "logit_bias": {str(the): 100}}
    history = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model="my-agent", messages=history, **force_the)
    assert chat.choices[0].message.content == "the"
    # The next turn through the Responses API: the chat template renders "the" back as the same token, so this
    # call's prompt extends the chat call's tokens and the two merge into one sequence.
    response = client.responses.create(
        model="my-agent",
        instructions=INSTRUCTIONS,
        input=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "the"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        max_output_tokens=1,
        extra_body={"logit_bias": {str(the): 100}},
    )
    assert response.output_text == "the"
    # A completions call on the token ids so far, plus more: extends by construction.
    so_far = rollout(engine_gateway, rid)["sequences"][0]["token_ids"]
    more = tokenizer.encode("\nmore")
    completion = client.completions.create(model="my-agent", prompt=so_far + more, max_tokens=4)
    # And an Anthropic Messages call in the same rollout (a new conversation: a sequence of its own).
    message = anthropic_client(engine_gateway, rid).messages.create(
        model="my-agent", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    recorded = rollout(engine_gateway, rid)
    assert [c["api"] for c in recorded["calls"]] == ["chat", "responses", "completions", "messages"]
    ids = [c["id"] for c in recorded["calls"]]
    merged, other = recorded["sequences"]
    assert merged["call_ids"] == ids[:3] and merged["split_reason"] is None
    assert other["call_ids"] == ids[3:]
    sampled = sampled_by_call(recorded)
    assert sampled[ids[0]] == sampled[ids[1]] == [the]
    assert merged["token_ids"][: len(so_far) + len(more)] == so_far + more
    assert texts(recorded, tokenizer) == ["the", "the", completion.choices[0].text, message.content[0].text]


# ---------------------------------------------------------------- LiteLLM (in the main environment: RULER uses it)


@pytest.fixture
def openai_env(engine_gateway, monkeypatch) -> Iterator[str]:
    """OPENAI_BASE_URL pointing at a rollout of the gateway, as an app configured by environment would."""
    rid = new_id("env")
    monkeypatch.setenv("OPENAI_BASE_URL", f"{engine_gateway.url}/rollouts/{rid}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    yield rid


def test_litellm_text_completion(engine_gateway, openai_env, tokenizer, monkeypatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price map download
    import litellm

    reply = litellm.text_completion(
        model="openai/my-agent",
        api_base=os.environ["OPENAI_BASE_URL"],
        api_key="unused",
        prompt="Once upon a time",
        max_tokens=8,
    )
    recorded = rollout(engine_gateway, openai_env)
    (call,) = recorded["calls"]
    assert call["api"] == "completions"
    assert texts(recorded, tokenizer) == [reply.choices[0].text]
