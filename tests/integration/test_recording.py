"""Recording with the real OpenAI SDK and real vLLM: token fidelity, rollout keying, assembly, export."""

from __future__ import annotations

import json
import subprocess
import uuid

import httpx
import openai
import pytest

from tests.conftest import ARTGW, BASE_NAME, WEATHER_TOOLS
from tests.recorded import sampled_by_call

pytestmark = pytest.mark.engine

USER = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is the weather?"}]
TOOLS = WEATHER_TOOLS


def rollout(gateway, rollout_id: str) -> dict:
    r = httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", headers=gateway.admin)
    assert r.status_code == 200, r.text
    return r.json()


def client_for(gateway, rollout_id: str | None = None) -> openai.OpenAI:
    base = gateway.base_url if rollout_id is None else f"{gateway.url}/rollouts/{rollout_id}/v1"
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0)


def test_non_stream_tokens_decode_to_the_text_and_prompt_ids_are_vllms(engine_gateway, vllm_url, tokenizer) -> None:
    rid = f"fid-{uuid.uuid4().hex[:8]}"
    r = client_for(engine_gateway).chat.completions.create(
        model="my-agent", messages=USER, max_tokens=24, extra_headers={"X-ART-Rollout-Id": rid}
    )
    recorded = rollout(engine_gateway, rid)
    (call,) = recorded["calls"]
    assert call["status"] == "ok" and call["n"] == 1 and call["step"] == 0
    tokens = httpx.post(
        f"{vllm_url}/tokenize", json={"model": BASE_NAME, "messages": USER, "add_generation_prompt": True}
    ).json()["tokens"]
    (seq,) = recorded["sequences"]
    assert seq["token_ids"][: len(tokens)] == tokens
    assert seq["sampled_mask"] == [0] * len(tokens) + [1] * (len(seq["token_ids"]) - len(tokens))
    sampled = seq["token_ids"][len(tokens) :]
    assert tokenizer.decode(sampled, skip_special_tokens=True) == r.choices[0].message.content
    assert len(sampled) == r.usage.completion_tokens
    assert all(isinstance(lp, float) and lp <= 0 for lp in seq["logprobs"][len(tokens) :])


def test_stream_tokens_decode_to_the_streamed_text(engine_gateway, tokenizer) -> None:
    rid = f"fid-{uuid.uuid4().hex[:8]}"
    stream = client_for(engine_gateway, rid).chat.completions.create(
        model="my-agent", messages=USER, max_tokens=24, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    recorded = rollout(engine_gateway, rid)
    assert recorded["calls"][0]["stream"] is True
    (seq,) = recorded["sequences"]
    sampled = [t for t, m in zip(seq["token_ids"], seq["sampled_mask"], strict=True) if m]
    assert len(sampled) >= 1
    assert tokenizer.decode(sampled, skip_special_tokens=True) == text
    assert recorded["messages"][-1]["content"] == text


def test_keying_by_header_path_and_neither(engine_gateway) -> None:
    body = {"model": "my-agent", "messages": USER, "max_tokens": 2}
    by_header = httpx.post(
        f"{engine_gateway.base_url}/chat/completions", json=body, headers={"X-ART-Rollout-Id": "hdr-1"}
    )
    by_path = httpx.post(f"{engine_gateway.url}/rollouts/path-1/v1/chat/completions", json=body)
    neither = httpx.post(f"{engine_gateway.base_url}/chat/completions", json=body)
    assert by_header.headers["X-ART-Rollout-Id"] == "hdr-1"
    assert by_path.headers["X-ART-Rollout-Id"] == "path-1"
    made_up = neither.headers["X-ART-Rollout-Id"]
    assert made_up.startswith("r-")
    for rid in ("hdr-1", "path-1", made_up):
        assert len(rollout(engine_gateway, rid)["calls"]) == 1
    page = httpx.get(
        f"{engine_gateway.base_url}/art/rollouts",
        params={"model": "my-agent", "limit": 1000},
        headers=engine_gateway.admin,
    ).json()
    listed = {row["id"]: row for row in page["data"]}
    assert listed[made_up]["explicit"] is False and listed["hdr-1"]["explicit"] is True
    assert httpx.get(f"{engine_gateway.base_url}/art/rollouts/nope", headers=engine_gateway.admin).status_code == 404


def test_multi_turn_tool_rollout_is_one_sequence_of_the_sampled_tokens(engine_gateway, tokenizer) -> None:
    # Turn 1: a forced tool call (guided decoding). vLLM's hermes output has no newlines inside <tool_call>,
    # the chat template adds them when it re-renders the turn: re-rendered, the next prompt would not extend it;
    # the gateway goes on from the sampled tokens instead (gateway/continuation.py). JSON allows free whitespace,
    # which a random-weight model may emit until max_tokens: try a few seeds.
    for seed in range(8):
        rid = f"tools-{uuid.uuid4().hex[:8]}"
        client = client_for(engine_gateway, rid)
        r1 = client.chat.completions.create(
            model="my-agent",
            messages=USER,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=200,
            seed=seed,
        )
        if r1.choices[0].message.tool_calls:
            break
    else:
        pytest.fail("no complete tool call in 8 seeded attempts")
    tool_call = r1.choices[0].message.tool_calls[0]
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": tool_call.id, "type": "function", "function": tool_call.function.model_dump()}],
        },
        {"role": "tool", "tool_call_id": tool_call.id, "content": "sunny"},
    ]
    # Turns 2 and 3: one forced token each (logit_bias), a token the template re-renders identically.
    the = tokenizer.convert_tokens_to_ids("the")
    forced = {"max_tokens": 1, "logit_bias": {str(the): 100}, "tools": TOOLS}
    r2 = client.chat.completions.create(model="my-agent", messages=history, **forced)
    assert r2.choices[0].message.content == "the"
    history += [{"role": "assistant", "content": "the"}, {"role": "user", "content": "and tomorrow?"}]
    client.chat.completions.create(model="my-agent", messages=history, **forced)

    recorded = rollout(engine_gateway, rid)
    ids = [c["id"] for c in recorded["calls"]]
    (sequence,) = recorded["sequences"]
    assert sequence["call_ids"] == ids and sequence["split_reason"] is None
    # Masks sit exactly on sampled tokens: the tool call as sampled, then the forced "the" twice.
    sampled = [t for t, m in zip(sequence["token_ids"], sequence["sampled_mask"], strict=True) if m]
    assert sampled == [*sampled_by_call(recorded)[ids[0]], the, the]
    assert tokenizer.decode(sampled[:-2], skip_special_tokens=False).startswith("<tool_call>")
    assert recorded["trainable_tokens"] == len(sampled)
    assert recorded["messages"][-1] == {"role": "assistant", "content": "the"}
    assert recorded["tools"] == TOOLS


def test_export_writes_one_trajectory_per_line(engine_gateway) -> None:
    rid = f"exp-{uuid.uuid4().hex[:8]}"
    httpx.post(
        f"{engine_gateway.base_url}/chat/completions",
        json={"model": "my-agent", "messages": USER, "max_tokens": 3},
        headers={"X-ART-Rollout-Id": rid},
    )
    api = rollout(engine_gateway, rid)
    out = subprocess.run(
        [ARTGW, "export", "--model", "my-agent", "--data-dir", str(engine_gateway.data_dir)],
        check=True,
        capture_output=True,
        text=True,
    )
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    mine = [t for t in lines if t["rollout_id"] == rid]
    assert len(mine) == 1
    assert mine[0]["sequences"] == api["sequences"] and mine[0]["messages"] == api["messages"]
    assert f"exported {len(lines)} trajectories" in out.stderr
