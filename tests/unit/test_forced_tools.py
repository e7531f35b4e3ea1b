"""Forced tool calls get their arguments sampled under the tool's schema (#27): `strict_forced_calls` on the chat
request every API becomes, and Responses' OpenAI default (`strict` omitted: strict when the schema allows)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.apis.chat.translate import strict_forced_calls
from gateway.apis.responses.schema import parse_request
from gateway.apis.responses.translate import strict_compatible, to_chat


def tool(name: str, **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}, **function}}


def strict_of(request: dict[str, Any]) -> dict[str, Any]:
    return {t["function"]["name"]: t["function"].get("strict") for t in request["tools"]}


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ({"type": "function", "function": {"name": "a"}}, {"a": True, "b": None, "c": False}),
        ("required", {"a": True, "b": True, "c": True}),
        ("auto", {"a": None, "b": None, "c": False}),
        ("none", {"a": None, "b": None, "c": False}),
        (None, {"a": None, "b": None, "c": False}),
    ],
)
def test_the_forced_tools_are_made_strict(tool_choice: Any, expected: dict[str, Any]) -> None:
    """A forced call's tool is strict even where the client said `strict: false` (autogen's default): its
    arguments must match the schema; tools a call may not make, and unforced calls, are left as sent."""
    request = {"messages": [], "tools": [tool("a"), tool("b"), tool("c", strict=False)]}
    if tool_choice is not None:
        request["tool_choice"] = tool_choice
    made = strict_forced_calls(request)
    assert strict_of(made) == expected
    assert strict_of(request) == {"a": None, "b": None, "c": False}  # the client's request is not changed


OBJECT = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize(
    ("schema", "strict"),
    [
        ({**OBJECT, "additionalProperties": False}, True),
        (OBJECT, False),  # other properties allowed
        ({**OBJECT, "additionalProperties": False, "required": []}, False),  # a property not required
        (
            {
                "type": "object",
                "properties": {"days": {"type": "array", "items": {**OBJECT, "additionalProperties": False}}},
                "required": ["days"],
                "additionalProperties": False,
            },
            True,
        ),
        (
            {
                "type": "object",
                "properties": {"days": {"type": "array", "items": OBJECT}},
                "required": ["days"],
                "additionalProperties": False,
            },
            False,  # an object inside allows other properties
        ),
    ],
)
def test_a_responses_tool_without_strict_is_strict_when_its_schema_allows(schema: dict, strict: bool) -> None:
    assert strict_compatible(schema) is strict
    body = {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": schema}]}
    (function,) = [t["function"] for t in to_chat(parse_request(json.dumps(body).encode()), [])["tools"]]
    assert function.get("strict") is (True if strict else None)
