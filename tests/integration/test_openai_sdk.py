"""The real OpenAI SDK, sync and async, through the gateway to a real vLLM serving the tiny model."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from tests.conftest import BASE_NAME, WEATHER_TOOLS, metric, poll

pytestmark = pytest.mark.engine

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = WEATHER_TOOLS


@pytest.fixture
def client(engine_gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_gateway.base_url, api_key="unused", max_retries=0)


@pytest.fixture
def aclient(engine_gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=engine_gateway.base_url, api_key="unused", max_retries=0)


def test_sync_non_stream(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="my-agent", messages=USER, max_tokens=8, temperature=0)
    assert r.model == "my-agent"
    assert len(r.choices) == 1
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage is not None and r.usage.completion_tokens >= 1
    # The gateway asked vLLM for logprobs and token ids; the client did not, so it sees none.
    assert r.choices[0].logprobs is None
    raw = r.model_dump()
    assert raw.get("prompt_token_ids") is None
    assert raw["choices"][0].get("token_ids") is None


def test_sync_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="my-agent",
        messages=USER,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1 and usage[0].completion_tokens >= 1
    assert all(c.model == "my-agent" for c in chunks)
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    assert isinstance(text, str)


async def test_async_non_stream_and_stream(aclient: openai.AsyncOpenAI) -> None:
    r = await aclient.chat.completions.create(model="my-agent", messages=USER, max_tokens=5)
    assert r.choices[0].message.content is not None
    stream = await aclient.chat.completions.create(model="my-agent", messages=USER, max_tokens=5, stream=True)
    finish = [c.choices[0].finish_reason async for c in stream if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"])


def test_n_greater_than_one_stream_and_not(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="my-agent", messages=USER, max_tokens=6, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    stream = client.chat.completions.create(model="my-agent", messages=USER, max_tokens=6, n=3, stream=True)
    seen = {c.choices[0].index for c in stream if c.choices}
    assert seen == {0, 1, 2}


def test_tools_required_gives_a_parsed_tool_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="my-agent",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # one call; a random model would otherwise call again and again
        max_tokens=200,
        temperature=0,
    )
    calls = r.choices[0].message.tool_calls
    assert calls, r
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_an_empty_tool_list_means_no_tools(client: openai.OpenAI, tool_choice: str | None) -> None:
    """strands' default Agent and fast-agent send `tools: []` (#27: vLLM's 400 `tools must not be an empty
    array` came back through the gateway)."""
    extra = {"tool_choice": tool_choice} if tool_choice else {}
    r = client.chat.completions.create(model="my-agent", messages=USER, tools=[], max_tokens=4, **extra)  # type: ignore[call-overload]
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("length", "stop")


def test_a_seeded_call_with_a_long_prompt_does_not_take_the_engine_down(client: openai.OpenAI, engine_gateway) -> None:
    """vLLM 0.32 on CPU crashed its engine on a seeded request whose prompt it prefilled in chunks (smolagents'
    2,000-token system prompt with a seed did it): the engine is started with a step budget that keeps a prompt
    whole (engine/supervisor.py)."""
    long = [{"role": "user", "content": "word " * 1200}]
    for seed in (1, 2):
        r = client.chat.completions.create(model="my-agent", messages=long, max_tokens=2, seed=seed)  # type: ignore[arg-type]
        assert r.usage is not None and r.usage.prompt_tokens > 1500
    assert httpx.get(f"{engine_gateway.url}/readyz", timeout=30).status_code == 200


def test_tools_streamed_tool_call(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="my-agent",
        messages=USER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        stream=True,
    )
    names, args = [], []
    for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if call.function and call.function.name:
                names.append(call.function.name)
            if call.function and call.function.arguments:
                args.append(call.function.arguments)
    assert names == ["get_weather"]
    assert json.loads("".join(args))["city"] in ("Paris", "Rome")


def test_client_gets_logprobs_and_token_ids_when_it_asks(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="my-agent",
        messages=USER,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True},
    )
    raw = r.model_dump()
    assert len(raw["choices"][0]["logprobs"]["content"]) == len(raw["choices"][0]["token_ids"]) >= 1
    assert len(raw["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert raw["prompt_token_ids"]


def test_response_has_exactly_the_fields_vllm_gives_the_same_request(engine_gateway, vllm_url: str) -> None:
    body = {"model": "my-agent", "messages": USER, "max_tokens": 3}
    via = httpx.post(f"{engine_gateway.base_url}/chat/completions", json=body).json()
    direct = httpx.post(f"{vllm_url}/v1/chat/completions", json={**body, "model": BASE_NAME}).json()

    def shape(payload: dict) -> dict:
        # every key, and which are null, must match: only ids, texts and timestamps may differ
        return {
            "top": {k: v is None for k, v in payload.items() if k not in ("usage",)},
            "choice": {k: v is None for k, v in payload["choices"][0].items() if k != "message"},
        }

    assert shape(via) == shape(direct)


def test_models_lists_trainable_and_base(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == ["my-agent", "my-agent@latest", BASE_NAME]  # no step trained yet: no `my-agent@K`
    assert client.models.retrieve("my-agent@latest").id == "my-agent@latest"


def test_base_model_by_name_and_step_zero_pin(client: openai.OpenAI) -> None:
    assert client.chat.completions.create(model=BASE_NAME, messages=USER, max_tokens=2).model == BASE_NAME
    assert client.chat.completions.create(model="my-agent@0", messages=USER, max_tokens=2).model == "my-agent@0"


def test_unknown_model_raises_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=USER, max_tokens=2)
    assert info.value.code == "model_not_found"


def test_client_disconnect_mid_stream_is_recorded_cancelled_and_the_engine_stops(engine_gateway, vllm_url) -> None:
    """With the real engine: the gateway stops relaying and records the call cancelled (or, if the whole answer
    was already handed to the socket, ok with every token: never an ok that lost tokens); vLLM has no request
    left running. (That the gateway closes the engine's stream at once is shown deterministically against the
    stub engine in test_errors.py: vLLM's own API server, streaming flat out on this CPU, may only notice the
    closed connection when the generation is over.)"""
    max_tokens = 3000  # vLLM on this CPU takes ~6 s for these
    body = {
        "model": "my-agent",
        "messages": USER,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # vLLM extension: keeps generating, so only a disconnect can stop it
        "stream": True,
    }
    rollout_id = f"hangup-{uuid.uuid4().hex[:8]}"
    headers = {"X-ART-Rollout-Id": rollout_id}
    url = f"{engine_gateway.base_url}/chat/completions"
    # A generous timeout: vLLM may still be flushing an earlier answer before it starts this one.
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        # hang up now
    poll(
        lambda: metric(vllm_url, "vllm:num_requests_running", exported=True) == 0, 60, "vLLM to have no request running"
    )
    rollout = httpx.get(
        f"{engine_gateway.base_url}/art/rollouts/{rollout_id}", timeout=30, headers=engine_gateway.admin
    ).json()
    (call,) = rollout["calls"]
    if call["status"] == "ok":
        # vLLM's starved API server can flush the whole answer in one burst, which the gateway hands to the
        # socket's buffers before the hang-up reaches it: then the call is complete, every token recorded.
        assert call["finish_reasons"] == ["length"]
        assert [sum(s["sampled_mask"]) for s in rollout["sequences"]] == [max_tokens]
    else:
        assert (call["status"], call["finish_reasons"]) == ("cancelled", [None])
        assert rollout["sequences"] == []
