"""Real model families served end to end: `artgw serve` speaks the family of the model it serves.

A tiny random-weight model with Qwen3's real tokenizer and chat template (`artgw tiny-model --family qwen3`),
served with no engine arguments (one engine for the module): the gateway picks vLLM's hermes tool-call parser and
qwen3 reasoning parser from the model's files, says so, and the OpenAI SDK gets tool calls and reasoning in their
own fields. A rollout on that template is one sequence, thinking on or off, whatever the client does with the
model's reasoning (gateway/continuation.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.vllm_server import FORKED, SPAWNED
from gateway.continuation import DERENDER_PATH, GENERATE_PATH, DerenderedStream, Splice, Splicer
from gateway.settings import served_base_name
from store.trajectories import Trajectory
from tests.conftest import WEATHER_TOOLS, GatewayProcess, metric, poll, run_client, serving
from tests.recorded import (
    ROME_PARIS_QUESTION,
    ROME_PARIS_TOOLS,
    anthropic_tool_loop,
    app_env,
    first_run,
    new_id,
    one_sequence,
    rollout,
    sampled_by_call,
)
from trainer.batch import pack_sequences, sequences_from_trajectory
from trainer.data import constrained_masks
from trainer.grammar import GrammarMasks
from trainer.logprobs import policy_token_logprobs

pytestmark = pytest.mark.engine


@dataclass(frozen=True)
class Served:
    gateway: GatewayProcess
    family: str
    model: Path  # the tiny model's directory
    tokenizer: Any
    stops: tuple[str, ...]  # the family's end-of-turn tokens, which the client's text never shows
    reasons: bool  # whether the family's template opens a reasoning block (Qwen3's <think>)
    # A forced call's logit bias: a random model ends the call's JSON where `"` and `}` are favoured (and closes
    # Qwen3's reasoning at once, `</think>`) instead of writing whitespace to the limit.
    forced_bias: dict[str, int]

    @property
    def forced_bias_body(self) -> dict[str, Any]:
        return {"logit_bias": self.forced_bias}

    @property
    def forced_tokens(self) -> int:
        """A forced call's token limit: Mistral's call is a JSON array of {name, arguments}, longer than hermes'."""
        return 120 if self.family == "mistral" else 48

    @property
    def call_id(self) -> str:
        """A tool call's id as vLLM's chat makes it: the Mistral parser's 9 alphanumeric characters (mistral_common
        takes no other), vLLM's own otherwise."""
        return "[A-Za-z0-9]{9}" if self.family == "mistral" else "chatcmpl-tool-[0-9a-f]{16}"

    def sampled_calls(self, text: str) -> list[dict[str, Any]]:
        """The tool calls (name and arguments) in a reply's sampled text, as the family's markers wrap them."""
        if self.family == "mistral":
            # a forced call is the JSON array alone (vLLM's schema for it), a free one follows the marker
            calls = json.loads(text.split("[TOOL_CALLS]", 1)[-1])
            return [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
        return [json.loads(text.split("<tool_call>", 1)[1].split("</tool_call>")[0])]


class _Tekken:
    """Mistral's tekken tokenizer (mistral_common's) as the tests read a transformers tokenizer."""

    def __init__(self, path: Path) -> None:
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        self.tekken = MistralTokenizer.from_file(str(path)).instruct_tokenizer.tokenizer

    def convert_tokens_to_ids(self, token: str) -> int:
        (only,) = self.tekken.encode(token, bos=False, eos=False)
        return int(only)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        return self.tekken.id_to_piece(ids) if isinstance(ids, int) else [self.tekken.id_to_piece(i) for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """As vLLM's MistralTokenizer decodes: special tokens kept are only the markers its parsers read (its
        `convert_tokens_to_string`), the others never text."""
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        if not skip_special_tokens:
            ids = [i for i in ids if not self.tekken.is_special(i) or self.tekken.id_to_piece(i) in _TEKKEN_MARKERS]
        policy = SpecialTokenPolicy.IGNORE if skip_special_tokens else SpecialTokenPolicy.KEEP
        return str(self.tekken.decode(ids, special_token_policy=policy))


_TEKKEN_MARKERS = ("[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]")


def _served(family_gateway: Callable[[str], GatewayProcess], family_model: Callable[[str], Path], name: str) -> Served:
    """Family `name`'s tiny model served with no engine arguments: the suite's one engine for that family."""
    model = family_model(name)
    tokenizer = _tokenizer(model, name)
    eos = json.loads((model / "generation_config.json").read_text())["eos_token_id"]
    stops = tuple(tokenizer.convert_ids_to_tokens(eos if isinstance(eos, list) else [eos]))
    token = tokenizer.convert_tokens_to_ids
    bias = {str(token('"')): 20, str(token("}")): 20}
    if name == "qwen3":
        bias[str(token("</think>"))] = 100
    return Served(family_gateway(name), name, model, tokenizer, stops, reasons=name == "qwen3", forced_bias=bias)


@functools.cache
def _tokenizer(model: Path, name: str) -> Any:
    """The family's tokenizer, read once (each of the family's tests asks for it)."""
    return _Tekken(model / "tekken.json") if name == "mistral" else AutoTokenizer.from_pretrained(model)


@pytest.fixture
def qwen3(family_gateway: Callable[[str], GatewayProcess], family_model: Callable[[str], Path]) -> Served:
    return _served(family_gateway, family_model, "qwen3")


@pytest.fixture
def llama3_1(family_gateway: Callable[[str], GatewayProcess], family_model: Callable[[str], Path]) -> Served:
    return _served(family_gateway, family_model, "llama3_1")


@pytest.fixture
def mistral(family_gateway: Callable[[str], GatewayProcess], family_model: Callable[[str], Path]) -> Served:
    return _served(family_gateway, family_model, "mistral")


def test_serve_picks_qwen3s_parsers_and_answers_a_forced_call_as_tool_calls(qwen3: Served) -> None:
    gateway = qwen3.gateway
    log = gateway.log()
    assert "vLLM's parsers: tool calls hermes, reasoning qwen3 (a Qwen3 template" in log, log[-3000:]
    started = re.search(r"starting vLLM: (.*) \(log: ", log)
    assert started is not None, log[-3000:]
    assert "--tool-call-parser artgw_hermes --reasoning-parser qwen3" in started.group(1)  # hermes: our plugin of it
    # Qwen3's tokenizer batch-encodes at the API server's start: with its thread pool kept off, the engine core is
    # still forked (engine/vllm_server.py), not spawned afresh
    engine_log = (gateway.data_dir / "engine.log").read_text()
    assert FORKED in engine_log and SPAWNED not in engine_log, engine_log[-3000:]

    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused")
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    # Thinking on: a random model closes its reasoning only when `</think>` is favoured; vLLM then samples
    # the forced call under its grammar, where `"` and `}` favoured end the JSON instead of endless whitespace.
    bias = qwen3.forced_bias
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


# -- one rollout, one sequence on Qwen3's template ---------------------------------------------------------------

FORCED = {"type": "function", "function": {"name": "get_weather"}}
# What the client does with the model's reasoning, and whether thinking is on: the OpenAI SDK's own message sends
# it back as `reasoning` (the field vLLM renders); `reasoning_content` is what other clients send (vLLM 0.32 does
# not render it); most agent code keeps only content and tool calls; thinking off renders an empty think block.
CLIENTS = ["sdk message", "reasoning_content", "reasoning dropped", "thinking off"]


def _sent_back(message: Any, client: str) -> dict[str, Any]:
    sent: dict[str, Any] = message.model_dump(exclude_none=True)
    reasoning = sent.pop("reasoning", None)
    if client == "sdk message" and reasoning is not None:
        sent["reasoning"] = reasoning
    elif client == "reasoning_content" and reasoning is not None:
        sent["reasoning_content"] = reasoning
    return sent


class _Loop:
    """A rollout's calls through the OpenAI SDK on the tiny Qwen3, whole or streamed, each reply sent back as
    `client` does."""

    def __init__(self, served: Served, rid: str, client: str, stream: bool, seed: int) -> None:
        self.sdk = openai.OpenAI(
            base_url=served.gateway.base_url, api_key="unused", default_headers={"X-ART-Rollout-Id": rid}
        )
        self.client, self.stream, self.seed = client, stream, seed
        self.messages: list[dict[str, Any]] = [*ROME_PARIS_QUESTION]
        self.replies: list[Any] = []
        self.tools_offered: list[bool] = []
        self.forced_bias = served.forced_bias

    def call(self, **fields: Any) -> Any:
        fields = {"model": "my-agent", "messages": self.messages, "max_tokens": 48, "seed": self.seed, **fields}
        if self.client == "thinking off":
            fields["extra_body"] = {**fields.get("extra_body", {}), "chat_template_kwargs": {"enable_thinking": False}}
        if not self.stream:
            choice = self.sdk.chat.completions.create(**fields).choices[0]
        else:
            with self.sdk.chat.completions.stream(**fields) as events:
                for _ in events:
                    pass
                choice = events.current_completion_snapshot.choices[0]
        self.replies.append(choice)
        self.tools_offered.append(bool(fields.get("tools")))
        self.messages.append(_sent_back(choice.message, self.client))
        return choice

    def forced_call(self, **fields: Any) -> None:
        fields = {
            "tools": ROME_PARIS_TOOLS,
            "tool_choice": FORCED,
            "extra_body": {"logit_bias": self.forced_bias},
            **fields,
        }
        choice = self.call(**fields)
        if choice.finish_reason == "length":  # the JSON ran past max_tokens: another seed
            raise ValueError(f"cut at max_tokens after {len(choice.message.tool_calls or [])} call(s)")
        (tool_call,) = choice.message.tool_calls
        # sampled to its end under the tool's (strict) schema: never another seed's matter
        assert _json_or_text(tool_call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"}), tool_call
        self.messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "sunny"})


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _received(text: str, thinking: bool) -> tuple[str, str]:
    """Sampled text as the qwen3 reasoning parser splits it: the reasoning (all of it until `</think>`, the
    template's generation prompt opened the block) and the content after it."""
    if not thinking:
        return "", text
    reasoning, closed, content = text.partition("</think>")
    return reasoning.removeprefix("<think>").strip("\n"), content.lstrip("\n") if closed else ""


def _assert_one_sequence_of_what_the_client_got(
    served: Served, rid: str, loop: _Loop, before: dict[str, float]
) -> dict[str, Any]:
    gateway = served.gateway
    recorded = one_sequence(gateway, rid, len(loop.replies))
    sampled = sampled_by_call(recorded)
    for call, reply, tools in zip(recorded["calls"], loop.replies, loop.tools_offered, strict=True):
        # vLLM's text leaves special tokens out, but where tools are offered (the tool parser must see its markers)
        ids = sampled[call["id"]]
        text = served.tokenizer.decode(
            ids[:-1] if served.tokenizer.convert_ids_to_tokens(ids[-1]) in served.stops else ids,
            skip_special_tokens=not tools,
        )
        reasoning, content = _received(text, served.reasons and loop.client != "thinking off")
        message = reply.message
        assert reasoning == ((message.model_extra or {}).get("reasoning") or "").strip("\n"), (text, message)
        if message.tool_calls:  # the sampled ids are the tool call the client parsed
            (tool_call,) = message.tool_calls
            assert re.fullmatch(served.call_id, tool_call.id), tool_call.id  # spliced or not
            assert served.sampled_calls(content) == [
                {"name": "get_weather", "arguments": json.loads(tool_call.function.arguments)}
            ], (text, message)
        else:
            assert content == (message.content or ""), (text, message)
    for how, was in before.items():  # every continuing call spliced, none served as sent
        now = metric(gateway.url, "artgw_continued_calls_total", how=how) - was
        assert now == (len(loop.replies) - 1 if how == "spliced" else 0), (how, now)
    return recorded


def _counts(gateway: GatewayProcess) -> dict[str, float]:
    return {
        how: metric(gateway.url, "artgw_continued_calls_total", how=how)
        for how in ("spliced", "template_mismatch", "render_failed")
    }


def _tool_loop(served: Served, rid: str, client: str, stream: bool) -> dict[str, Any]:
    """The OpenAI SDK's 4-call tool loop: two forced tool calls (each result sent back), an answer, a follow-up;
    asserted one sequence of what the client got, every continuing call spliced. Returns the recording."""

    def run(seed: int) -> tuple[_Loop, dict[str, float]]:
        before = _counts(served.gateway)
        loop = _Loop(served, f"{rid}-{seed}", client, stream, seed)
        loop.forced_call(max_tokens=served.forced_tokens)
        loop.forced_call(max_tokens=served.forced_tokens)
        loop.call(tools=ROME_PARIS_TOOLS, max_tokens=16)
        loop.messages.append({"role": "user", "content": "And tomorrow?"})
        loop.call(tools=ROME_PARIS_TOOLS, max_tokens=16)
        return loop, before

    seed, (loop, before) = first_run(run)
    return _assert_one_sequence_of_what_the_client_got(served, f"{rid}-{seed}", loop, before)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("client", CLIENTS)
def test_openai_sdk_tool_loop_on_qwen3_is_one_sequence(qwen3: Served, client: str, stream: bool) -> None:
    """Two forced tool calls, an answer, a follow-up. Before, Qwen3's template rendered the reply with its think
    block as the last message and without one after it: every continuing call was served as sent
    (`template_mismatch`) and the rollout was 4 sequences."""
    _tool_loop(qwen3, new_id("qwen3-tools"), client, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("client", CLIENTS)
def test_multi_turn_text_loop_on_qwen3_is_one_sequence(qwen3: Served, client: str, stream: bool) -> None:
    """Three user turns, each answered (a random model's answer is its reasoning, cut at the limit): the template
    drops an earlier turn's reasoning once a user message follows it."""
    rid = new_id("qwen3-text")
    before = _counts(qwen3.gateway)
    loop = _Loop(qwen3, rid, client, stream, seed=1)
    for follow_up in ("And tomorrow?", "And the day after?", None):
        loop.call(max_tokens=12)
        if follow_up:
            loop.messages.append({"role": "user", "content": follow_up})
    _assert_one_sequence_of_what_the_client_got(qwen3, rid, loop, before)
    received = [
        (r.message.content or "") + ((r.message.model_extra or {}).get("reasoning") or "") for r in loop.replies
    ]
    assert not "".join(received).isascii(), received  # multi-byte text among what the sampled ids decoded to


class _TrainerScores:
    """A recorded rollout as `artgw train` scores it (trainer/data.py, batch.py, logprobs.py) under the base model:
    the grammar masks it rebuilds, and each trained token's ratio to the logprob vLLM recorded (1: on-policy)."""

    def __init__(self, recorded: dict[str, Any], model_dir: Path) -> None:
        self.trajectory = msgspec.convert(recorded, Trajectory)
        self.grammar = GrammarMasks.for_model(str(model_dir))  # what `artgw train` builds
        masks, self.untrained = constrained_masks(self.trajectory, self.grammar)
        self.constrained_calls = len(masks)
        sequences = sequences_from_trajectory(0, self.trajectory.sequences, self.untrained, masks)
        width = max(len(s.token_ids) for s in sequences)
        batch = pack_sequences(sequences, max_tokens_per_row=width, pad_id=0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

        def logprobs(allowed_index: torch.Tensor | None, bitmask: torch.Tensor | None) -> torch.Tensor:
            with torch.no_grad():
                scored = policy_token_logprobs(
                    model, batch.input_ids, batch.position_ids, batch.attention_mask, batch.labels,
                    batch.loss_mask, chunk_size=1024, allowed_index=allowed_index, allowed_bitmask=bitmask,
                )  # fmt: skip
            return scored[batch.loss_mask]

        vllm = batch.sampled_logprobs[batch.loss_mask]
        grammar_rows = batch.allowed_index if batch.allowed_bitmask is not None else None
        masked = logprobs(grammar_rows, batch.allowed_bitmask)
        self.ratio = torch.exp(masked - vllm)
        self.max_difference = float((masked - vllm).abs().max())
        self.unmasked_ratio = torch.exp(logprobs(None, None) - vllm)
        # The trained tokens whose grammar row allowed less than the whole vocabulary.
        rows = batch.allowed_index[batch.loss_mask]
        bitmask = batch.allowed_bitmask if batch.allowed_bitmask is not None else torch.full((1, 1), -1)
        self.constrained = (rows >= 0) & (bitmask != -1).any(-1)[rows.clamp(min=0)]


def test_a_forced_call_after_a_reasoning_block_trains_on_policy_on_qwen3(
    qwen3: Served, family_model: Callable[[str], Path]
) -> None:
    """The trainer's own path (trainer/data.py, batch.py, logprobs.py) on a rollout of two forced calls, named then
    `required`, each sampled after a reasoning block (thinking on): vLLM applies the call's grammar only once the
    reasoning has ended (`</think>`, or `<tool_call>` implicitly), and the trainer must too for the base model's
    logprobs to be vLLM's (ratio 1). Before, the trainer refused Qwen3's reasoning parser: the calls were context."""
    model_dir = family_model("qwen3")
    token = qwen3.tokenizer.convert_tokens_to_ids
    # Each call's reasoning end a little less favoured than `"` and `}`: a few reasoning tokens, then the call. The
    # named call's reasoning ends at `<tool_call>` (implicitly: the call's first token), the `required` one's at
    # `</think>`; one call for `required` (else a favoured `<tool_call>` starts another until the limit).
    ends = [token("<tool_call>"), token("</think>")]
    forced = [{}, {"tool_choice": "required", "parallel_tool_calls": False}]
    rid = new_id("qwen3-on-policy")

    def run(seed: int) -> dict[str, Any]:
        loop = _Loop(qwen3, f"{rid}-{seed}", "sdk message", stream=False, seed=seed)
        for end, fields in zip(ends, forced, strict=True):
            bias = {**qwen3.forced_bias, str(token("</think>")): 0, str(end): 19}
            loop.forced_call(max_tokens=64, extra_body={"logit_bias": bias}, **fields)
        recorded = one_sequence(qwen3.gateway, f"{rid}-{seed}", 2)
        for end, call in zip(ends, recorded["calls"], strict=True):
            ids = sampled_by_call(recorded)[call["id"]]
            if ids.index(end) == 0 or set(ids[: ids.index(end)]) & {token("</think>"), token("<tool_call>")}:
                raise ValueError(f"a call's reasoning did not end at {end} after a token or more: another seed")
        return recorded

    seed, recorded = first_run(run)
    scores = _TrainerScores(recorded, model_dir)
    assert not scores.untrained and scores.constrained_calls == 2, scores.untrained
    ratio, constrained = scores.ratio, scores.constrained
    summary = {
        "tokens": len(ratio),
        "free (reasoning)": int((~constrained).sum()),
        "ratio": round(float(ratio.mean()), 4),
        "constrained ratio": round(float(ratio[constrained].mean()), 4),
        "unmasked constrained ratio": round(float(scores.unmasked_ratio[constrained].mean()), 4),
    }
    print(f"\nQwen3 forced calls after reasoning (seed {seed}): {summary}")
    assert summary["free (reasoning)"] >= 4 and int(constrained.sum()) >= 20, summary  # 2 per call: reasoning, its end
    assert 0.99 <= summary["ratio"] <= 1.01 and 0.99 <= summary["constrained ratio"] <= 1.01, summary
    assert scores.max_difference < 0.05, summary  # token by token: float noise, no renormalization
    assert summary["unmasked constrained ratio"] < 0.5, summary  # the masks are what makes it 1
    trajectory, grammar = scores.trajectory, scores.grammar
    # Where the grammar starts matters: applied from the first token (as without a reasoning parser), it rejects
    # the reasoning the model sampled.
    (recorded_sequence,) = trajectory.sequences
    requests = {c.id: c.grammar_request for c in trajectory.calls}
    for call_id, (start, end) in zip(recorded_sequence.call_ids, recorded_sequence.sampled_spans, strict=True):
        ids = recorded_sequence.token_ids
        with pytest.raises(ValueError, match="rejects sampled token"):
            grammar.for_call({**(requests[call_id] or {}), "include_reasoning": False}, ids[start:end], ids[:start])


def _anthropic_loop(served: Served, rid: str, stream: bool) -> None:
    """Anthropic's Python SDK: two forced tool_use turns, then an answer, each reply sent back whole: one
    sequence, both continuing calls spliced."""

    def run(seed: int) -> tuple[list[Any], dict[str, float]]:
        before = _counts(served.gateway)  # a failed seed's calls are not this run's
        body, tokens = served.forced_bias_body, served.forced_tokens
        return anthropic_tool_loop(
            served.gateway.url, f"{rid}-{seed}", seed, stream, extra_body=body, max_tokens=tokens
        ), before

    seed, (replies, before) = first_run(run)
    recorded = one_sequence(served.gateway, f"{rid}-{seed}", 3)
    assert [r.stop_reason for r in replies[:2]] == ["tool_use", "tool_use"]
    assert {c["api"] for c in recorded["calls"]} == {"messages"}
    after = _counts(served.gateway)
    assert {how: after[how] - was for how, was in before.items()} == {
        "spliced": 2,
        "template_mismatch": 0,
        "render_failed": 0,
    }


def _agents_sdk_run(served: Served) -> None:
    """The Agents SDK at its defaults (Responses API): its forced tool call and the answer after the tool's
    result are one sequence."""
    rid, env = app_env(served.gateway)
    # Responses' token limit: a field the SDK's extra_body overrides (its model settings say 64)
    extra = {**served.forced_bias_body, "max_output_tokens": served.forced_tokens}
    run = run_client("agents_sdk_tool_agent", {**env, "APP_EXTRA_BODY": json.dumps(extra)})
    assert run["asked"] and run["asked"][-1] in ("Paris", "Rome")
    recorded = poll(lambda: rollout(served.gateway, rid), 60, "the rollout")
    assert {c["api"] for c in recorded["calls"]} == {"responses"}
    tool_turn, answer_turn = [c for c in recorded["calls"] if c["status"] == "ok"][-2:]
    # Each failed seed (a call cut at max_tokens) is a rollout's first call again: a sequence of its own.
    assert recorded["sequences"][-1]["call_ids"] == [tool_turn["id"], answer_turn["id"]], recorded["sequences"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_messages_tool_loop_on_qwen3_is_one_sequence(qwen3: Served, stream: bool) -> None:
    """Each reply sent back whole, a thinking block too where the model reasoned: the gateway leaves it out of
    the prompt, as the template does."""
    _anthropic_loop(qwen3, new_id("qwen3-messages"), stream)


def test_openai_agents_sdk_run_on_qwen3_is_one_sequence(qwen3: Served) -> None:
    """Reasoning items sent back as the SDK keeps them."""
    _agents_sdk_run(qwen3)


def _text_loop(served: Served, rid: str, stream: bool) -> dict[str, Any]:
    """Three user turns, each answered: one sequence, every continuing call spliced. Returns the recording."""
    before = _counts(served.gateway)
    loop = _Loop(served, rid, "reasoning dropped", stream, seed=1)
    for follow_up in ("And tomorrow?", "And the day after?", None):
        loop.call(max_tokens=12)
        if follow_up:
            loop.messages.append({"role": "user", "content": follow_up})
    return _assert_one_sequence_of_what_the_client_got(served, rid, loop, before)


# -- Llama 3.1: its template trims each message's content and renders no tools ------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_multi_turn_text_loop_on_llama3_1_is_one_sequence(llama3_1: Served, stream: bool) -> None:
    """On the template npm's Llama 3.1 package carries: each message's content `| trim`med, a BOS before the first
    turn, `<|eot_id|>` ending each."""
    _text_loop(llama3_1, new_id("llama-text"), stream)


# -- Mistral (tekken): mistral_common renders the prompt; no history that ends with an assistant turn renders -----


def test_serve_picks_mistrals_parsers_and_answers_a_forced_call_as_tool_calls(mistral: Served) -> None:
    """vLLM's `auto` tokenizer mode finds tekken.json only beside consolidated*.safetensors: the gateway passes
    `--tokenizer-mode mistral` itself, with the mistral tool-call parser."""
    log = mistral.gateway.log()
    assert "vLLM's parsers: tool calls mistral, reasoning none (" in log, log[-3000:]
    started = re.search(r"starting vLLM: (.*) \(log: ", log)
    assert started is not None, log[-3000:]
    assert "--tool-call-parser mistral --tokenizer-mode mistral" in started.group(1)
    client = openai.OpenAI(base_url=mistral.gateway.base_url, api_key="unused")
    reply = client.chat.completions.create(
        model="my-agent",
        messages=ROME_PARIS_QUESTION,  # type: ignore[arg-type]
        tools=ROME_PARIS_TOOLS,  # type: ignore[arg-type]
        tool_choice=FORCED,  # type: ignore[arg-type]
        max_tokens=200,
        extra_body={"logit_bias": mistral.forced_bias},
    )
    calls = reply.choices[0].message.tool_calls
    assert calls, reply.model_dump_json()
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments)["city"] in {"Paris", "Rome"}  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_multi_turn_text_loop_on_mistral_is_one_sequence(mistral: Served, stream: bool) -> None:
    """Before, the splice rendered the history through the reply, which mistral_common refuses (a last assistant
    message must be a prefix): every continuing call was served as sent (`render_failed`). The rollout trains
    on-policy: the trainer's logprobs of its sampled tokens are vLLM's (before, the trainer could not start on a
    tekken model: its grammar masks failed on MistralCommonBackend)."""
    recorded = _text_loop(mistral, new_id("mistral-text"), stream)
    if not stream:  # the same tokens either way: scored once
        scores = _TrainerScores(recorded, mistral.model)
        print(f"\nMistral text loop: {len(scores.ratio)} tokens, ratio {float(scores.ratio.mean()):.4f}")
        assert 0.99 <= float(scores.ratio.mean()) <= 1.01 and scores.max_difference < 0.05


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_sdk_tool_loop_on_mistral_is_one_sequence(mistral: Served, stream: bool) -> None:
    """mistral_common, which renders Mistral's prompts (there is no Jinja template), renders no history that ends
    with an assistant turn, nor an assistant message with both text and tool calls: before, the call after a
    tool call was served as sent (`render_failed`) and started a new sequence. The splice now renders the request
    with a text reply in the tool-call reply's place and checks that the request's own render ends with what
    follows that text, token for token. Streamed, a spliced forced call's arguments could begin with the `:` before
    their object (seed 6; the test below); its call ids were derender's 16 hex digits whole (Mistral's are 9)."""
    _tool_loop(mistral, new_id("mistral-tools"), "reasoning dropped", stream)


def test_anthropic_messages_tool_loop_on_mistral_is_one_sequence(mistral: Served) -> None:
    _anthropic_loop(mistral, new_id("mistral-messages"), stream=False)


def test_openai_agents_sdk_run_on_mistral_is_one_sequence(mistral: Served) -> None:
    _agents_sdk_run(mistral)


async def test_a_streamed_forced_call_on_mistral_keeps_its_arguments_json_wherever_a_derendered_run_begins(
    mistral: Served,
) -> None:
    """A spliced stream derenders the tokens that arrived together in one request (gateway/continuation.py
    `DerenderedStream`), so its runs begin wherever a derender round trip ended. vLLM's Mistral parser streams a
    forced call's arguments from where the run that opens its object began: before, a run that began between
    `"arguments"` and its `:` gave the client arguments `:\\n{"city": "Paris"}` (the streamed tool loop, seed 6).
    Here the engine's own derender reads the call in two runs split there (a generate stream that waits for the
    first run's derender before it sends the second)."""
    started = re.search(r"starting vLLM: .* --port (\d+)", mistral.gateway.log())
    assert started is not None, mistral.gateway.log()[-3000:]
    engine_url = f"http://127.0.0.1:{started.group(1)}"
    tekken = mistral.tokenizer.tekken
    runs = [
        tekken.encode(text, bos=False, eos=False)
        for text in ('[{"name": "get_weather", "arguments"', ' \t:\n{"city": "Paris"}}]')
    ]
    runs[-1].append(tekken.eos_id)
    first_derendered = asyncio.Event()

    async def generate(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await answer.prepare(request)
        for i, ids in enumerate(runs):
            choice = {"index": 0, "token_ids": ids, "finish_reason": "stop" if i else None}
            await answer.write(b"data: " + msgspec.json.encode({"choices": [choice]}) + b"\n\n")
            await first_derendered.wait()
        await answer.write(b"data: [DONE]\n\n")
        return answer

    async def derender(request: web.Request) -> web.Response:  # the engine's own, after the first run
        async with session.post(
            engine_url + DERENDER_PATH, data=await request.read(), headers={"content-type": "application/json"}
        ) as answer:
            body = await answer.read()
        first_derendered.set()
        return web.Response(body=body, status=answer.status, content_type="application/json")

    chat = {"model": served_base_name(str(mistral.model)), "messages": ROME_PARIS_QUESTION, "tools": ROME_PARIS_TOOLS}
    async with aiohttp.ClientSession() as session, serving({GENERATE_PATH: generate, DERENDER_PATH: derender}) as url:
        splice = Splice([1], {}, {**chat, "tool_choice": FORCED}, chat["model"])
        async with session.post(url + GENERATE_PATH, json={}) as answer:
            stream = DerenderedStream(
                Splicer(session, url, aiohttp.ClientTimeout(total=60)), answer, splice, logprobs=False
            )
            body = b"".join([chunk async for chunk in stream.iter_any()])
    events = [json.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: {")]
    calls = [call for event in events for call in event["choices"][0]["delta"].get("tool_calls") or ()]
    assert calls and calls[0]["function"]["name"] == "get_weather", events
    assert json.loads("".join(call["function"].get("arguments", "") for call in calls)) == {"city": "Paris"}, events
