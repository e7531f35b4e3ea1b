"""Tokens sampled under a grammar are scored the way vLLM sampled them (issue 14): real vLLM, the gateway, the
unmodified OpenAI SDK, real xgrammar.

Calls with a named tool_choice (a schema with an enum, two integers, one bounded only below, and a string
argument), with `required` and with a json_schema response_format, at temperature 1. Each recorded call's
request is turned back into vLLM's grammar masks (trainer/grammar.py); the base model's logprob of each sampled
token, log-softmaxed over the tokens its mask allows, must match the logprob vLLM reported: mean
exp(trainer - vLLM) within 5% of 1. Unmasked, it is far off (vLLM's logprobs are renormalized over the allowed
tokens): that is what the masks fix, and what shows this test can fail. Then `artgw train` takes one step on
such rollouts and must report the same ratio.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer

from store.calls import rollout_calls
from store.provide import open_store, store_url
from store.records import CallRecord, RolloutKey
from tests.conftest import GatewayProcess, TrainerProcess, poll

pytestmark = pytest.mark.engine

MODEL = "my-agent"
ROLLOUT_HEADER = "X-ART-Rollout-Id"
FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "description": "Weather forecast of a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                # bounded above by the gateway's grammar (JSON's safe integers, engine/tool_grammar.py)
                "hour": {"type": "integer", "minimum": 0},
                "note": {"type": "string", "maxLength": 12},
            },
            "required": ["city", "days", "hour", "note"],
            "additionalProperties": False,
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "strict": True,
        "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"]},
    },
}
REPORT = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "score": {"type": "number"}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}
KINDS: dict[str, dict[str, Any]] = {
    "named": {"tools": [FORECAST, LOOKUP], "tool_choice": {"type": "function", "function": {"name": "get_forecast"}}},
    "required": {"tools": [FORECAST, LOOKUP], "tool_choice": "required"},
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
    },
}
CALLS_PER_KIND = 4
MAX_TOKENS = 96  # room for whole calls (the random model pads JSON with whitespace); the rest stop here


def sdk(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=120)


def constrained_call(client: openai.OpenAI, kind: str, rollout_id: str) -> None:
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What will the weather be in Rome this week?"}],
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        extra_headers={ROLLOUT_HEADER: rollout_id},
        **KINDS[kind],
    )


def recorded(gateway: GatewayProcess, rollout_ids: list[str]) -> dict[str, CallRecord]:
    """Each rollout's one call, read back from the gateway's store (once the recorder has written it)."""

    async def read() -> dict[str, CallRecord]:
        found: dict[str, CallRecord] = {}
        async with open_store(store_url(gateway.data_dir, None)) as store, store.engine.connect() as conn:
            for rollout_id in rollout_ids:
                calls = await rollout_calls(conn, RolloutKey("", rollout_id))
                if calls:
                    (found[rollout_id],) = calls
        return found

    def all_recorded() -> dict[str, CallRecord] | None:
        calls = asyncio.run(read())
        return calls if len(calls) == len(rollout_ids) else None

    return poll(all_recorded, 30, "the calls' records")


class Scorer:
    """The base model's logprobs of a call's sampled tokens: unmasked, and under the call's grammar masks."""

    def __init__(self, model_dir: Path) -> None:
        from trainer.grammar import GrammarMasks

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.masks = GrammarMasks(tokenizer, self.model.config.vocab_size)

    @torch.no_grad()
    def __call__(self, call: CallRecord) -> dict[str, torch.Tensor]:
        (choice,) = call.choices
        prompt, sampled = call.prompt_token_ids, choice.token_ids
        bitmask = self.masks.for_call(call.request, sampled)
        assert bitmask is not None, f"{call.request.get('tool_choice')}: no grammar rebuilt"
        # The logits that predict each sampled token: the positions just before it.
        logits = self.model(torch.tensor([prompt + sampled])).logits[0, len(prompt) - 1 : -1].float()
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, bitmask)  # xgrammar's own masking: disallowed -> -inf
        token = torch.tensor(sampled)[:, None]
        return {
            "masked": torch.log_softmax(masked, -1).gather(-1, token)[:, 0],
            "unmasked": torch.log_softmax(logits, -1).gather(-1, token)[:, 0],
            "vllm": torch.tensor(choice.logprobs, dtype=torch.float32),
            "choices": torch.isfinite(masked).sum(-1),  # how many tokens each position allowed
        }


def mean_ratio(trainer: torch.Tensor, vllm: torch.Tensor) -> float:
    return float(torch.exp(trainer - vllm).mean())


def test_masked_logprobs_match_vllms_and_unmasked_do_not(engine_gateway: GatewayProcess, tiny_model: Path) -> None:
    rollout_ids = {
        kind: [f"grammar-{kind}-{k}-{uuid.uuid4().hex[:8]}" for k in range(CALLS_PER_KIND)] for kind in KINDS
    }
    client = sdk(engine_gateway)
    try:
        for kind, ids in rollout_ids.items():
            for rollout_id in ids:
                constrained_call(client, kind, rollout_id)
    finally:
        client.close()
    calls = recorded(engine_gateway, [r for ids in rollout_ids.values() for r in ids])
    scorer = Scorer(tiny_model)

    per_kind = {}
    for kind, ids in rollout_ids.items():
        scores = [scorer(calls[r]) for r in ids]
        per_kind[kind] = {key: torch.cat([s[key] for s in scores]) for key in scores[0]}
    everything = {key: torch.cat([k[key] for k in per_kind.values()]) for key in per_kind["named"]}
    free = everything["choices"] > 1  # positions where the grammar left a real choice (the rest: logprob 0)
    summary = {
        kind: (
            len(s["vllm"]),
            round(mean_ratio(s["masked"], s["vllm"]), 4),
            round(mean_ratio(s["unmasked"], s["vllm"]), 4),
        )
        for kind, s in per_kind.items()
    }
    print(f"\n(tokens, masked ratio, unmasked ratio) per kind: {summary}; free positions {int(free.sum())}")

    for kind, s in per_kind.items():
        assert 0.95 <= mean_ratio(s["masked"], s["vllm"]) <= 1.05, (kind, summary)
    assert int(free.sum()) >= 20  # the check is not carried by forced tokens alone
    assert 0.95 <= mean_ratio(everything["masked"][free], everything["vllm"][free]) <= 1.05, summary
    # Token by token too: vLLM's CPU kernels and these differ by float noise, not by a renormalization.
    assert float((everything["masked"] - everything["vllm"]).abs().median()) < 0.05, summary
    # Unmasked, the trainer's ratio is far from 1: the bug the masks fix.
    assert mean_ratio(everything["unmasked"], everything["vllm"]) < 0.5, summary
    assert mean_ratio(everything["unmasked"][free], everything["vllm"][free]) < 0.5, summary


def test_a_training_step_on_constrained_rollouts_reports_their_ratio(
    engine_gateway: GatewayProcess, tiny_model: Path
) -> None:
    groups: list[str] = []
    client = sdk(engine_gateway)
    try:
        for g in range(2):  # the trainer's --groups-per-step (TrainerProcess: 2)
            members = [f"grammar-train-{g}-{k}-{uuid.uuid4().hex[:8]}" for k in range(3)]
            for k, rollout_id in enumerate(members):
                constrained_call(client, ("named", "required", "json_schema")[k], rollout_id)
            answer = httpx.post(
                f"{engine_gateway.base_url}/art/groups",
                json={
                    "model": MODEL,
                    "group_id": f"grammar-g{g}-{uuid.uuid4().hex[:6]}",
                    "rollouts": [{"rollout_id": r, "reward": w} for r, w in zip(members, (1.0, 0.0, 0.5), strict=True)],
                },
                headers=engine_gateway.admin,
                timeout=30,
            )
            assert answer.status_code == 201, answer.text
            groups.append(answer.json()["id"])
    finally:
        client.close()

    def settled() -> bool:
        """The trainer has taken every group: trained (by a step, or as groups without learning signal) or failed."""
        states = [
            httpx.get(f"{engine_gateway.base_url}/art/groups/{g}", headers=engine_gateway.admin, timeout=30).json()
            for g in groups
        ]
        return all(state["state"] in ("trained", "failed") for state in states)

    trainer = TrainerProcess("trainer-grammar", engine_gateway, tiny_model)  # our 2 groups make its one step
    try:
        poll(settled, 240, "the trainer to take the groups", every=0.5, alive=[trainer])
    finally:
        trainer.stop()
    answer = httpx.get(f"{engine_gateway.base_url}/art/models/{MODEL}", headers=engine_gateway.admin, timeout=30)
    assert answer.status_code == 200, answer.text
    steps = answer.json()["steps"]
    # No step: the trainer found no trainable token (constrained tokens left as context) or no learning signal.
    assert len(steps) == 1, trainer.log()[-3000:]
    (step,) = steps
    metrics = step["metrics"]
    print(f"\nstep 1 metrics: {metrics}")
    assert set(metrics["group_ids"]) == set(groups)
    assert metrics["constrained_tokens"] > 0, trainer.log()[-3000:]
    assert 0.95 <= metrics["constrained_ratio_mean"] <= 1.05, metrics
    assert 0.95 <= metrics["ratio_mean"] <= 1.05, metrics  # every trained token here was constrained
