"""The grammar a tool call's arguments are sampled under, shared by the engine's tool parser plugin
(engine/tool_parser.py loads this file by its path inside vLLM) and the trainer's rebuild of that grammar
(trainer/grammar.py). xgrammar and the standard library only: vLLM's own image mounts it next to the plugin.

Two changes to the JSON a tool's schema admits, both because a random or untrained model cannot otherwise end a
forced call within a token limit (issue 42):

- compact: spaced as `json.dumps` spaces it (one space after `,` and `:`, none elsewhere; xgrammar's
  any_whitespace=False), the spacing the chat template renders earlier calls with. vLLM's
  `--structured-outputs-config.disable_any_whitespace` does not reach the tool-call structural tag, and under
  free whitespace such a model pads a call with blanks until the limit.
- integers end: an `integer` schema without a bound on a side gets JSON's safe-integer bound there,
  |n| <= 2**53 - 1 (the integers a JavaScript client reads exactly, RFC 7493 §2.2). xgrammar compiles a range
  to a finite pattern that ends the number after at most 16 digits; unbounded, any digit may follow a digit and
  such a model rarely ends it. The client's own bounds are kept, and nothing else the schema accepts changes.
  `number` is left unbounded: xgrammar's only bound on it, a range, also caps its fraction at 6 digits and drops
  exponents, which would refuse numbers the schema accepts.

And a forced call's constant text is sampled in the tokenizer's own spelling (`pinned_calls`): under a named or
`required` tool_choice the envelope `<tool_call>\\n{"name": "get_weather", "arguments": ` and `\\n</tool_call>`
are a fixed sequence of tokens, the ones the tokenizer encodes that text as, where a grammar of text admits every
way of spelling it and such a model spends about twice the tokens on it (27 where the toy's tokenizer takes 14).
The text the client gets is the same; the model, trained on its tokenizer's spelling, is not pushed off it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import (
    AnyTextFormat,
    ConstStringFormat,
    Format,
    GrammarFormat,
    SequenceFormat,
    TagFormat,
    TagsWithSeparatorFormat,
    TokenFormat,
)

SAFE_INTEGER = 2**53 - 1

# Keywords whose value is a subschema or a list of them, or a name -> subschema map. Not `not` or `if`: a bound
# there would widen what the schema accepts. Not `propertyNames`: names are strings.
_SUBSCHEMAS = (
    "items",
    "prefixItems",
    "additionalItems",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "anyOf",
    "oneOf",
    "allOf",
    "then",
    "else",
)
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

# Matches only the empty text; a grammar with it is kept out of xgrammar's cross-grammar cache of token masks (a
# rule with a character budget opts out of it). That cache, on in vLLM's compiler, tells rules apart by their
# shape and not by the ids of their token edges (xgrammar 0.2.8, cpp/grammar_functor.cc HashFsm hashes a token
# edge's index, not its tokens): without this, a forced call of `note` compiled after one of `get_weather` was
# masked with get_weather's tokens and vLLM failed the request ("grammar rejected tokens").
_NO_SHARED_MASKS = AnyTextFormat(max_chars=0)
# hermes' call markers
START, END = "<tool_call>", "</tool_call>"
# What may follow a call's head (the first characters of its JSON arguments) and precede its tail (the last of
# them): the constant text is pinned only as far as its tokens stay the same beside each.
_AFTER_HEAD = ("{", '{"', "{}", "[", "[]", '"', '"a', "-", "0", "1", "t", "f", "n")
_BEFORE_TAIL = ("}", '"}', "1}", "]}", "]", '"', "0", "e", "l")


def arguments_grammar(schema: dict[str, Any] | bool) -> GrammarFormat:
    """The grammar of the arguments `schema` admits: compact, with integers that end (the module's doc)."""
    bounded = json.dumps(bounded_integers(schema))
    return GrammarFormat(grammar=str(xgr.Grammar.from_json_schema(bounded, any_whitespace=False)))


def bounded_integers(schema: Any) -> Any:
    """`schema` (a copy) with each integer schema that lacks a lower or an upper bound given the safe-integer
    bound on that side, at any depth."""
    if isinstance(schema, list):
        return [bounded_integers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = bounded_integers(out[key])
    for key in _NAMED_SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_integers(sub) for name, sub in out[key].items()}
    declared = out.get("type")
    types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else set()
    # A `number` among the types would be bounded too (with xgrammar's fraction cap); enum and const are finite.
    if "integer" not in types or "number" in types or "enum" in out or "const" in out:
        return out
    lower = _bound(out, "minimum", "exclusiveMinimum")
    upper = _bound(out, "maximum", "exclusiveMaximum")
    # Only where the client's other bound leaves room: the bound never empties a schema.
    if lower is None and (upper is None or upper >= -SAFE_INTEGER):
        out["minimum"] = -SAFE_INTEGER
    if upper is None and (lower is None or lower <= SAFE_INTEGER):
        out["maximum"] = SAFE_INTEGER
    return out


def _bound(schema: dict[str, Any], inclusive: str, exclusive: str) -> float | None:
    """The schema's bound on one side (draft 4's boolean `exclusiveMinimum` qualifies `minimum`)."""
    return next((v for v in (schema.get(inclusive), schema.get(exclusive)) if _is_number(v)), None)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def pinned_calls(calls: Format, tokenizer: Any) -> Format:
    """`calls` with each hermes call tag's constant text sampled as the tokens `tokenizer` (the model's, vLLM's
    or transformers') spells it in, where `calls` is the list of forced calls (a named or `required`
    tool_choice: tags with a separator); other formats (`auto`'s triggered tags) are returned as they are. Left as
    text where the markers are not tokens of their own, split from anything beside them (added tokens)."""
    if not isinstance(calls, TagsWithSeparatorFormat):
        return calls
    spell = _Spelling(tokenizer)
    start, end = spell.encode(START), spell.encode(END)
    if not (
        len(start) == 1
        and len(end) == 1
        and spell.encode(f"}}{END}{START}\n") == [*spell.encode("}"), *end, *start, *spell.encode("\n")]
    ):
        return calls
    tags = [_pinned(tag, spell, start[0], end[0]) for tag in calls.tags]
    if any(tag is None for tag in tags):
        return calls  # all or none: the tags of one list begin alike
    return calls.model_copy(update={"tags": tags})


class _Spelling:
    """A tokenizer's spelling of constant text, special tokens not added."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def settled(self, text: str, beside: Sequence[str], *, prefix: bool) -> list[int]:
        """The tokens of `text` (its first ones for `prefix`, else its last) that the tokenizer spells the same in
        each of `beside` (`text` with what may come next to it), the token at the edge always left out; empty
        where no such tokens spell `text`'s own text (nothing normalized away)."""
        own = self.encode(text)
        spellings = [self.encode(b) for b in beside]
        if not prefix:
            own, spellings = own[::-1], [s[::-1] for s in spellings]
        n = len(own) - 1
        for spelling in spellings:
            common = next((i for i, (a, b) in enumerate(zip(own, spelling, strict=False)) if a != b), len(spelling))
            n = min(n, common)
        while n > 0:  # fewer where the last tokens hold part of a character
            settled = own[:n] if prefix else own[:n][::-1]
            spelled = self.decode(settled)
            if text.startswith(spelled) if prefix else text.endswith(spelled):
                return settled
            n -= 1
        return []

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids))


def _pinned(tag: TagFormat, spell: _Spelling, start: int, end: int) -> TagFormat | None:
    """One call `<tool_call>head` arguments `tail</tool_call>` as tokens, arguments, tokens: the markers as
    the tag's begin and end tokens, and the rest of the head and tail as far as their spelling is the same
    whatever the arguments are. The text at the arguments' edge stays text, which the model may merge with
    them as the tokenizer does (`": ` and `{"` are ` {"`). None where the tag is not hermes' envelope."""
    if not (isinstance(tag.begin, str) and isinstance(tag.end, str)):
        return None
    head = spell.settled(tag.begin, [tag.begin + c for c in _AFTER_HEAD], prefix=True)
    tail = spell.settled(tag.end, [c + tag.end for c in _BEFORE_TAIL], prefix=False)
    if not head or not tail or head[0] != start or tail[-1] != end:
        return None
    elements: list[Format] = [_NO_SHARED_MASKS, *(TokenFormat(token=t) for t in head[1:])]
    if rest := tag.begin[len(spell.decode(head)) :]:
        elements.append(ConstStringFormat(value=rest))
    elements.append(tag.content)
    if rest := tag.end[: len(tag.end) - len(spell.decode(tail))]:
        elements.append(ConstStringFormat(value=rest))
    elements += [TokenFormat(token=t) for t in tail[:-1]]
    return TagFormat(
        begin=TokenFormat(token=start), content=SequenceFormat(elements=elements), end=TokenFormat(token=end)
    )
