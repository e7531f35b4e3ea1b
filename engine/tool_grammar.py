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
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import GrammarFormat

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
