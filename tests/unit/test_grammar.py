"""trainer/grammar.py: the grammar vLLM sampled under, rebuilt from the request, replayed over sampled tokens.

With the tiny model's tokenizer and real xgrammar. The specs are checked against vLLM 0.32's own request path
(the engine's tool parser plugin, ChatCompletionRequest and xgrammar validation); the masks against what each
grammar allows.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from engine.supervisor import TOOL_PARSER, TOOL_PARSER_PLUGIN
from engine.tool_grammar import SAFE_INTEGER, bounded_integers
from trainer.grammar import GrammarMasks, GrammarSpec, grammar_spec

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": CITY_SCHEMA}}
LOOKUP = {  # not strict: vLLM constrains its call envelope, not its arguments
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}

# Integers with and without bounds, at several depths (engine/tool_grammar.py bounds the unbounded ones).
COUNTS_SCHEMA = {
    "type": "object",
    "properties": {
        "days": {"type": "integer"},
        "hours": {"type": ["integer", "null"], "minimum": 0},
        "list": {"type": "array", "items": {"$ref": "#/$defs/small"}},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "ratio": {"type": "number"},
    },
    "required": ["days"],
    "additionalProperties": False,
    "$defs": {"small": {"type": "integer", "maximum": 10}},
}
COUNT = {"type": "function", "function": {"name": "count", "strict": True, "parameters": COUNTS_SCHEMA}}


def named(tool: str) -> dict[str, Any]:
    return {"tools": [WEATHER, LOOKUP], "tool_choice": {"type": "function", "function": {"name": tool}}}


NAMED = named("get_weather")
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'

# One request of each kind vLLM treats differently.
REQUESTS: dict[str, dict[str, Any]] = {
    "named": NAMED,
    "named_not_strict": named("lookup"),
    "named_integers": {"tools": [COUNT], "tool_choice": {"type": "function", "function": {"name": "count"}}},
    "named_not_ascii": {  # its name's characters span tokens: pinned up to the last whole one
        "tools": [{"type": "function", "function": {"name": "météo_東京", "strict": True, "parameters": CITY_SCHEMA}}],
        "tool_choice": {"type": "function", "function": {"name": "météo_東京"}},
    },
    "required": {"tools": [WEATHER, LOOKUP], "tool_choice": "required"},
    "required_single_call": {"tools": [WEATHER, LOOKUP], "tool_choice": "required", "parallel_tool_calls": False},
    "auto_strict_tool": {"tools": [WEATHER, LOOKUP]},
    "auto_single_call": {"tools": [LOOKUP], "tool_choice": "auto", "parallel_tool_calls": False},
    "auto_strict_tool_and_json": {"tools": [WEATHER], "response_format": {"type": "json_object"}},
    "auto_not_strict": {"tools": [LOOKUP], "tool_choice": "auto"},
    "tool_choice_none": {"tools": [WEATHER], "tool_choice": "none"},
    "json_schema": {"response_format": CITY_FORMAT},
    "json_object": {"response_format": {"type": "json_object"}},
    "text": {"response_format": {"type": "text"}},
    "regex": {"structured_outputs": {"regex": "[0-9]+"}},
    "choice": {"structured_outputs": {"choice": ["yes", 'no "way"\n']}},
    "ebnf": {"structured_outputs": {"grammar": 'root ::= "ab" | "cd"'}},
    "lark": {"structured_outputs": {"grammar": 'start: "ab" | "cd"'}},
    "schema_for_guidance": {"structured_outputs": {"json": {"type": "integer", "multipleOf": 3}}},
    "guided_json_removed": {"guided_json": CITY_SCHEMA},
    "plain": {},
}


@pytest.fixture(scope="module")
def masks(tokenizer: Any) -> GrammarMasks:
    return GrammarMasks(tokenizer, len(tokenizer))  # the tiny model's vocab_size is its tokenizer's


def ids(tokenizer: Any, text: str, *, eos: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])


def allowed(row: torch.Tensor, vocab: int) -> set[int]:
    """The token ids a bitmask row allows (bit t % 32 of word t // 32)."""
    return {t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1}


def allowed_text(tokenizer: Any, row: torch.Tensor) -> set[str]:
    return {tokenizer.decode([t]) for t in allowed(row, len(tokenizer))}


def vllm_spec(body: dict[str, Any], tokenizer: Any) -> tuple[str, str, bool] | None:
    """What vLLM 0.32 compiles for `body` with the gateway's engine flags: (kind, spec, xgrammar takes it)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.exceptions import VLLMValidationError
    from vllm.parser.parser_manager import ParserManager
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar
    from vllm.v1.structured_output.request import get_structured_output_key

    ToolParserManager.import_tool_parser(str(TOOL_PARSER_PLUGIN))
    parser = ParserManager.get_parser(tool_parser_name=TOOL_PARSER, enable_auto_tools=True, tokenizer=tokenizer)
    request = ChatCompletionRequest.model_validate(body)
    if request.tools and request.tool_choice != "none":
        request = parser(tokenizer, request.tools).adjust_request(request)
    params = request.to_sampling_params(16, {})
    if params.structured_outputs is None:
        return None
    try:
        validate_xgrammar_grammar(params)  # turns `choice` into its grammar, as the engine does
        xgrammar = True
    except VLLMValidationError:
        xgrammar = False
    kind, spec = get_structured_output_key(params.structured_outputs)
    return kind.name, spec, xgrammar


@pytest.mark.parametrize("name", list(REQUESTS))
def test_spec_is_what_vllm_compiles(name: str, tokenizer: Any) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **REQUESTS[name]}
    theirs = vllm_spec(copy.deepcopy(body), tokenizer)
    ours = grammar_spec(copy.deepcopy(body), tokenizer)
    if theirs is None or not theirs[2]:  # no grammar, or another backend's
        assert ours is None
        return
    kind, spec, _ = theirs
    assert ours is not None
    expected = {"JSON": "json", "JSON_OBJECT": "json", "REGEX": "regex", "STRUCTURAL_TAG": "structural_tag"}
    expected["GRAMMAR"] = "lark" if name == "lark" else "ebnf"
    assert ours.kind == expected[kind]
    if kind == "JSON_OBJECT":
        assert json.loads(ours.text) == {"type": "object"}
    elif kind in ("JSON", "STRUCTURAL_TAG"):
        assert json.loads(ours.text) == json.loads(spec)
    else:
        assert ours.text == spec


def test_named_tool_call_masks_every_position(tokenizer: Any, masks: GrammarMasks) -> None:
    sampled = ids(tokenizer, WEATHER_CALL)
    bitmask = masks.for_call(NAMED, sampled)
    assert bitmask is not None
    assert bitmask.dtype == torch.int32 and tuple(bitmask.shape) == (len(sampled), (len(tokenizer) + 31) // 32)
    for position, token in enumerate(sampled):
        assert token in allowed(bitmask[position], len(tokenizer)), position
    # The first token opens the envelope: only pieces of `<tool_call>`; no free text, no stop.
    assert allowed_text(tokenizer, bitmask[0]) <= {"<tool_call>", *("<tool_call>"[:k] for k in range(1, 11))}
    # The forced call closes with `}`, then the only way on is the stop token.
    assert allowed(bitmask[-1], len(tokenizer)) == {tokenizer.eos_token_id}


def test_a_forced_calls_constant_text_is_sampled_in_the_tokenizers_spelling(
    tokenizer: Any, masks: GrammarMasks
) -> None:
    """#42: the envelope of a named call is the tokens the tokenizer spells it in, one allowed at each position
    (before: every spelling, `<`, `tool`, `_`, ...: a random model spent 27 tokens on a head the tokenizer
    spells in 14, and ran out of tokens at 48). The text at the arguments' edge stays text, so the model may
    merge it with them as the tokenizer does (` {"`)."""
    sampled = ids(tokenizer, WEATHER_CALL)
    rows = masks.for_call(NAMED, sampled)
    assert rows is not None
    head = len(ids(tokenizer, '<tool_call>\n{"name": "get_weather", "arguments":', eos=False))
    compact = tokenizer.convert_tokens_to_ids('{"')  # the envelope without the newline (vLLM's second form)
    for position in range(head):
        expected = {sampled[position], compact} if position == 1 else {sampled[position]}
        assert allowed(rows[position], len(tokenizer)) == expected, position
    assert allowed_text(tokenizer, rows[head]) == {" ", ' {"'}
    # After the arguments' closing `}`: `\n` and `</tool_call>` as their tokens, then only the stop token.
    assert [allowed_text(tokenizer, row) for row in rows[-3:]] == [{"\n"}, {"</tool_call>"}, {tokenizer.eos_token}]


def test_forced_calls_of_other_tools_compiled_by_one_compiler_keep_their_own_tokens(tokenizer: Any) -> None:
    """vLLM compiles every request's grammar with one caching xgrammar compiler, whose cross-grammar cache of
    token masks does not tell token edges apart by their ids (engine/tool_grammar.py, _NO_SHARED_MASKS): each
    forced call's rows must be what its grammar alone allows, whatever was compiled before it (before the opt-out,
    a call of `note` after one of `get_weather` allowed `get` where `note` begins, and vLLM failed it)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    shared, alone = xgr.GrammarCompiler(info), xgr.GrammarCompiler(info, cache_enabled=False)
    for name in ("get_weather", "note", "lookup", "get_weather"):
        tool = {"type": "function", "function": {"name": name, "strict": True, "parameters": CITY_SCHEMA}}
        spec = grammar_spec(
            {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": name}}}, tokenizer
        )
        assert spec is not None
        sampled = ids(tokenizer, WEATHER_CALL.replace("get_weather", name))
        rows = []
        for compiler in (shared, alone):
            matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(spec.text))
            bitmask = xgr.allocate_token_bitmask(len(sampled), len(tokenizer))
            for position, token in enumerate(sampled):
                matcher.fill_next_token_bitmask(bitmask, position)
                assert matcher.accept_token(token), (name, position)
            rows.append(bitmask)
        assert torch.equal(*rows), name


def test_a_tool_calls_arguments_have_no_free_whitespace(tokenizer: Any, masks: GrammarMasks) -> None:
    """Spaced as `json.dumps` spaces them (engine/tool_parser.py): one space after `:` and `,`, none elsewhere."""
    for padded in ('{ "city": "Rome"}', '{"city":  "Rome"}', '{"city":"Rome"}', '{"city": "Rome" }'):
        with pytest.raises(ValueError, match="rejects"):
            masks.for_call(NAMED, ids(tokenizer, WEATHER_CALL.replace('{"city": "Rome"}', padded)))
    sampled = ids(tokenizer, WEATHER_CALL)
    bitmask = masks.for_call(NAMED, sampled)
    assert bitmask is not None
    after_colon = [tokenizer.decode([t]) for t in sampled].index('":') + 1
    assert all(p.startswith(' "') or p == " " for p in allowed_text(tokenizer, bitmask[after_colon]))


def test_structural_positions_allow_only_what_the_schema_allows(tokenizer: Any, masks: GrammarMasks) -> None:
    text = '{"city": "Rome"}'
    sampled = ids(tokenizer, text)
    bitmask = masks.for_call({"response_format": CITY_FORMAT}, sampled)
    assert bitmask is not None
    pieces = [tokenizer.decode([t]) for t in sampled]
    # After `{"` of an object with one property: only pieces of that property's name.
    after_brace = pieces.index('{"') + 1
    names = allowed_text(tokenizer, bitmask[after_brace])
    assert "city" in names and all('city"'.startswith(p) or p.startswith('city"') for p in names), names
    # At the enum's value: only pieces of its values.
    value = pieces.index("Rome")
    assert allowed_text(tokenizer, bitmask[value]) <= {v[:k] for v in ("Paris", "Rome") for k in range(1, 6)}
    # JSON allows whitespace between tokens, unless the engine disables it.
    assert " " in allowed_text(tokenizer, bitmask[pieces.index('":') + 1])
    compact = GrammarMasks(tokenizer, len(tokenizer), disable_any_whitespace=True)
    compact_ids = ids(tokenizer, '{"city":"Rome"}')
    rows = compact.for_call({"response_format": CITY_FORMAT}, compact_ids)
    assert rows is not None
    colon = [tokenizer.decode([t]) for t in compact_ids].index('":') + 1
    assert " " not in allowed_text(tokenizer, rows[colon])


@pytest.mark.parametrize(
    ("request_", "text"),
    [
        (REQUESTS["required"], WEATHER_CALL + '<tool_call>{"name": "lookup", "arguments": {"q": [1, 2]}}</tool_call>'),
        (REQUESTS["auto_strict_tool"], "Let me check. " + WEATHER_CALL),
        (REQUESTS["auto_strict_tool"], "No tool needed."),
        (REQUESTS["auto_strict_tool_and_json"], '{"answer": 42}'),
        (REQUESTS["json_object"], '{"any": ["thing", 1, null]}'),
        (REQUESTS["regex"], "2024"),
        (REQUESTS["choice"], 'no "way"\n'),
        (REQUESTS["ebnf"], "cd"),
        (REQUESTS["lark"], "ab"),
    ],
    ids=["required", "auto_with_call", "auto_text", "auto_or_json", "json_object", "regex", "choice", "ebnf", "lark"],
)
def test_every_sampled_token_is_allowed_by_its_own_row(
    request_: dict[str, Any], text: str, tokenizer: Any, masks: GrammarMasks
) -> None:
    sampled = ids(tokenizer, text)
    bitmask = masks.for_call(request_, sampled)
    assert bitmask is not None and bitmask.shape[0] == len(sampled)
    for position, token in enumerate(sampled):
        assert token in allowed(bitmask[position], len(tokenizer)), position
    assert tokenizer.eos_token_id in allowed(bitmask[-1], len(tokenizer))


def test_grammar_rows_differ_from_free_text(tokenizer: Any, masks: GrammarMasks) -> None:
    vocab = len(tokenizer)
    regex = masks.for_call(REQUESTS["regex"], ids(tokenizer, "2024"))
    assert regex is not None
    digits = allowed_text(tokenizer, regex[0])
    assert digits and all(piece.isdigit() for piece in digits)  # no stop before the first digit
    assert tokenizer.eos_token_id in allowed(regex[-1], vocab) and len(allowed(regex[-1], vocab)) > 1
    # `required` lets another call follow a call; a named (forced) call does not.
    required = masks.for_call(REQUESTS["required"], ids(tokenizer, WEATHER_CALL))
    assert required is not None
    after_call = allowed_text(tokenizer, required[-1])
    assert "<tool_call>" in after_call and tokenizer.eos_token in after_call
    # Free text before the trigger allows almost everything.
    auto = masks.for_call(REQUESTS["auto_strict_tool"], ids(tokenizer, "Hello"))
    assert auto is not None and len(allowed(auto[0], vocab)) > vocab - 10


def test_eos_ends_the_grammar_and_a_cut_off_output_keeps_its_rows(tokenizer: Any, masks: GrammarMasks) -> None:
    vocab = len(tokenizer)
    whole = ids(tokenizer, '{"city": "Paris"}')
    cut = whole[:3]  # finish_reason "length": the grammar never completed
    rows = masks.for_call({"response_format": CITY_FORMAT}, cut)
    assert rows is not None and rows.shape[0] == 3
    # The request's stop_token_ids stop the grammar too (vLLM's all_stop_token_ids).
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    stops = masks.for_call({"response_format": CITY_FORMAT, "stop_token_ids": [im_start]}, whole)
    assert stops is not None and allowed(stops[-1], vocab) == {tokenizer.eos_token_id, im_start}
    # ignore_eos: vLLM goes on sampling past the accepted stop token, unmasked.
    beyond = masks.for_call({"response_format": CITY_FORMAT}, [*whole, *ids(tokenizer, "more", eos=False)])
    assert beyond is not None
    assert all(len(allowed(row, vocab)) == vocab for row in beyond[len(whole) :])
    # A generation-config eos is a stop token too.
    extra = GrammarMasks(tokenizer, vocab, eos_token_ids=[im_start])
    rows = extra.for_call({"response_format": CITY_FORMAT}, whole)
    assert rows is not None and allowed(rows[-1], vocab) == {tokenizer.eos_token_id, im_start}


@pytest.mark.parametrize(
    "name", ["auto_not_strict", "tool_choice_none", "text", "plain", "guided_json_removed", "schema_for_guidance"]
)
def test_none_when_vllm_samples_under_no_xgrammar_grammar(name: str, tokenizer: Any, masks: GrammarMasks) -> None:
    assert masks.for_call(REQUESTS[name], ids(tokenizer, "42")) is None


def test_none_when_xgrammar_cannot_compile_it(tokenizer: Any, masks: GrammarMasks) -> None:
    assert masks.for_call({"structured_outputs": {"regex": "(unclosed"}}, ids(tokenizer, "x")) is None


def test_a_sequence_the_grammar_rejects_names_its_position(tokenizer: Any, masks: GrammarMasks) -> None:
    london = ids(tokenizer, WEATHER_CALL.replace("Rome", "London"))
    position = next(i for i, t in enumerate(london) if tokenizer.decode([t]).startswith("L"))
    with pytest.raises(ValueError, match=f"position {position}"):
        masks.for_call(NAMED, london)


def test_strict_tool_calling_off_uses_the_tools_json_schema(tokenizer: Any) -> None:
    masks = GrammarMasks(tokenizer, len(tokenizer), strict_tool_calling=False)
    assert grammar_spec(NAMED, tokenizer, strict_tool_calling=False) == GrammarSpec("json", json.dumps(CITY_SCHEMA))
    rows = masks.for_call(NAMED, ids(tokenizer, '{"city": "Paris"}'))  # bare arguments, no envelope
    assert rows is not None
    with pytest.raises(ValueError, match="position 0"):
        masks.for_call(NAMED, ids(tokenizer, WEATHER_CALL))
    calls = '[{"name": "lookup", "parameters": {"q": "x"}}]'
    assert masks.for_call(REQUESTS["required"], ids(tokenizer, calls)) is not None


def test_each_grammar_is_compiled_once(tokenizer: Any) -> None:
    masks = GrammarMasks(tokenizer, len(tokenizer))
    for city in ("Rome", "Paris", "Rome"):
        masks.for_call(NAMED, ids(tokenizer, WEATHER_CALL.replace("Rome", city)))
    assert (masks.cache_info().misses, masks.cache_info().hits) == (1, 2)
    masks.for_call({"response_format": CITY_FORMAT}, ids(tokenizer, '{"city": "Rome"}'))
    masks.for_call(REQUESTS["plain"], ids(tokenizer, "x"))  # no grammar: nothing compiled
    assert (masks.cache_info().misses, masks.cache_info().hits) == (2, 2)


@pytest.mark.parametrize(
    ("arguments", "valid"),
    [
        ('{"days": 9007199254740991}', True),  # 2**53 - 1: 16 digits
        ('{"days": -9007199254740991}', True),
        ('{"days": 9007199254740992}', False),
        ('{"days": 12345678901234567}', False),  # a 17th digit
        ('{"days": 1, "hours": 9007199254740991, "list": [-9007199254740991, 10], "either": 7}', True),
        ('{"days": 1, "hours": 9007199254740992}', False),
        ('{"days": 1, "list": [-9007199254740992]}', False),  # under $defs, the client's maximum kept
        ('{"days": 1, "either": 9007199254740992}', False),  # in an anyOf
        ('{"days": 1, "hours": -1}', False),  # the client's own bounds are kept
        ('{"days": 1, "list": [11]}', False),
        ('{"days": 1, "hours": null, "either": "x", "ratio": -1234567890123456789.1234567e300}', True),  # number
    ],
)
def test_a_calls_integers_end_within_the_safe_integers(
    arguments: str, valid: bool, tokenizer: Any, masks: GrammarMasks
) -> None:
    """An integer schema without bounds is sampled within JSON's safe integers, so a number ends after at most 16
    digits (engine/tool_grammar.py); the client's bounds and `number`s are as the schema says."""
    sampled = ids(tokenizer, f'<tool_call>\n{{"name": "count", "arguments": {arguments}}}\n</tool_call>')
    if valid:
        assert masks.for_call(REQUESTS["named_integers"], sampled) is not None
    else:
        with pytest.raises(ValueError, match="rejects"):
            masks.for_call(REQUESTS["named_integers"], sampled)


def test_only_integers_without_a_bound_get_one_and_nothing_is_widened() -> None:
    safe = {"minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    kept = [
        {"type": "integer", "minimum": 1, "maximum": 9},
        {"type": "integer", "enum": [2**60]},  # finite already: a bound would refuse the client's value
        {"type": "integer", "const": 3},
        {"type": ["integer", "number"]},  # the bound would cap the number's fraction too
        {"type": "number"},
        {"not": {"type": "integer"}},  # a bound under `not` would widen what the schema accepts
        {"if": {"type": "integer"}, "then": {"type": "integer", "maximum": 5, "minimum": 0}},
    ]
    for schema in kept:
        assert bounded_integers(schema) == schema, schema
    assert bounded_integers({"type": "integer", "exclusiveMinimum": 0}) == {
        "type": "integer",
        "exclusiveMinimum": 0,
        "maximum": SAFE_INTEGER,
    }
    # A client's bound beyond the safe integers leaves that side's other bound off: the schema never empties.
    assert bounded_integers({"type": "integer", "minimum": 2**60}) == {"type": "integer", "minimum": 2**60}
    nested = {
        "type": "array",
        "prefixItems": [{"type": "integer"}],
        "items": {"oneOf": [{"type": ["integer", "null"]}]},
    }
    assert bounded_integers(nested) == {
        "type": "array",
        "prefixItems": [{"type": "integer", **safe}],
        "items": {"oneOf": [{"type": ["integer", "null"], **safe}]},
    }
