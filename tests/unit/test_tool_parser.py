"""engine/tool_parser.py, the engine's tool parser plugin (issue 42), run as vLLM runs it: loaded from its file,
looked up by name, on the tiny model's tokenizer. vLLM 0.32's hermes parser dropped every call of a reply cut
inside its last call, and ended a call at a `</tool_call>` inside a string argument (no call, non-streamed; a
call with broken arguments, streamed)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.supervisor import TOOL_PARSER, TOOL_PARSER_PLUGIN

TOOLS = [{"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}]


def call(arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'note', 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def parse(tokenizer: Any) -> Any:
    """A fresh parser per reply (vLLM makes one per choice), and the request it parses for."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    ToolParserManager.import_tool_parser(str(TOOL_PARSER_PLUGIN))
    parser = ToolParserManager.get_tool_parser(TOOL_PARSER)
    request = ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"}
    )
    return lambda: (parser(tokenizer, request.tools), request)


def test_the_complete_calls_of_a_reply_cut_in_its_last_call_are_returned(parse: Any) -> None:
    parser, request = parse()
    cut = call({"n": 1}) + call({"n": 2}) + '<tool_call>\n{"name": "note", "arguments": {"n'
    result = parser.extract_tool_calls(cut, request)
    assert result.tools_called and result.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls] == [
        ("note", {"n": 1}),
        ("note", {"n": 2}),
    ]


def test_text_before_the_calls_stays_the_content_and_no_complete_call_leaves_the_text(parse: Any) -> None:
    parser, request = parse()
    result = parser.extract_tool_calls("Let me note. " + call({"n": 1}), request)
    assert result.content == "Let me note. " and len(result.tool_calls) == 1
    cut = '<tool_call>\n{"name": "note", "arguments": {"n'
    result = parse()[0].extract_tool_calls(cut, request)
    assert not result.tools_called and result.content == cut


@pytest.mark.parametrize("text", ["a </tool_call> b", 'quote \\" then </tool_call><tool_call>', "</tool_"])
def test_a_string_argument_with_the_markers_is_parsed(parse: Any, text: str) -> None:
    arguments = {"text": json.loads(f'"{text}"'), "n": 2}
    output = call(arguments) + call({"n": 3})
    parser, request = parse()
    result = parser.extract_tool_calls(output, request)
    assert [json.loads(c.function.arguments) for c in result.tool_calls] == [arguments, {"n": 3}]
    # Streamed, one character at a time: the same calls, whole.
    parser, request = parse()
    streamed: dict[int, str] = {}
    for end in range(1, len(output) + 1):
        delta = parser.extract_tool_calls_streaming(
            output[: end - 1], output[:end], output[end - 1], [], [], [], request
        )
        for tool_call in (delta.tool_calls if delta else None) or []:
            streamed[tool_call.index] = streamed.get(tool_call.index, "") + (tool_call.function.arguments or "")
    assert [json.loads(streamed[i]) for i in sorted(streamed)] == [arguments, {"n": 3}]
