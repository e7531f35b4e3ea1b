"""vLLM's hermes tool parser with two changes, loaded into the engine as a plugin (`--tool-parser-plugin` with
this file, `--tool-call-parser artgw_hermes`). vLLM, xgrammar and its sibling engine/tool_grammar.py only: a
deployment's own vLLM image mounts the two files side by side.

- The grammar: a call's arguments are written as `json.dumps` writes them (one space after `,` and `:`, none
  elsewhere) instead of with free whitespace, and an integer without bounds is bounded to JSON's safe integers
  (engine/tool_grammar.py says why: an untrained model can then end a forced call), and a forced call's
  constant text, `<tool_call>` up to its arguments and after them to `</tool_call>`, is sampled as the tokens the
  tokenizer spells it in (tool_grammar.pinned_calls). trainer/grammar.py rebuilds the same tag with the same
  file.
- The parsing: each call's end is the first `</tool_call>` outside a JSON string, so an argument that contains
  the marker is still parsed; a reply with complete calls and an unfinished last one (cut at the token limit)
  returns the complete calls, where vLLM 0.32 returned none and the raw text as content.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel
from vllm.entrypoints.generate.base.protocol import ExtractedToolCallInformation, FunctionCall, ToolCall
from vllm.logger import init_logger
from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from vllm.tool_parsers.utils import is_complete_json, partial_tag_overlap
from xgrammar.structural_tag import JSONSchemaFormat, TagFormat

logger = init_logger(__name__)

NAME = "artgw_hermes"
# A JSON string (or one still open at the end of the text) or the end marker: the first marker this finds
# outside a string ends the call.
_STRING_OR_END = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\Z)|</tool_call>', re.DOTALL)


def _sibling(name: str) -> ModuleType:
    """A file next to this one, imported by its path: vLLM imports this plugin by its path, not as a package."""
    spec = importlib.util.spec_from_file_location(f"artgw_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool_grammar = _sibling("tool_grammar")


def _compact_arguments(node: Any) -> None:
    """Every call's JSON arguments in a structural tag given the gateway's grammar (tool_grammar), in place."""
    if isinstance(node, TagFormat) and isinstance(node.content, JSONSchemaFormat) and node.content.style == "json":
        node.content = tool_grammar.arguments_grammar(node.content.json_schema)
    elif isinstance(node, BaseModel):
        for name in type(node).model_fields:
            _compact_arguments(getattr(node, name))
    elif isinstance(node, list | tuple):
        for item in node:
            _compact_arguments(item)


class ArtgwHermesToolParser(Hermes2ProToolParser):
    def get_structural_tag(self, request: Any, **kwargs: Any) -> Any:
        tag = super().get_structural_tag(request, **kwargs)
        if tag is not None:
            _compact_arguments(tag.format)
            tag.format = tool_grammar.pinned_calls(tag.format, self.model_tokenizer)
        return tag

    def _extract_tool_call_jsons(self, text: str) -> list[tuple[str, bool]]:
        """(JSON text, complete) of each `<tool_call>` region; streaming uses it too. vLLM's own ends a call at
        the first `</tool_call>`, inside a string argument or not."""
        results: list[tuple[str, bool]] = []
        start = text.find(self.tool_call_start_token)
        while start != -1:
            body = start + len(self.tool_call_start_token)
            end = next((m.start() for m in _STRING_OR_END.finditer(text, body) if m[0] == self.tool_call_end_token), -1)
            if end == -1:
                raw = text[body:]
                if overlap := partial_tag_overlap(raw, self.tool_call_end_token):
                    raw = raw[:-overlap]
                results.append((raw.strip(), is_complete_json(raw.strip())))
                break
            results.append((text[body:end].strip(), True))
            start = text.find(self.tool_call_start_token, end + len(self.tool_call_end_token))
        return results

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        """The complete calls; text before the first is the content. A last call cut short is left out (the
        reply's finish_reason says `length`); with no complete call the text stays the content, as in vLLM."""
        calls = []
        for body, complete in self._extract_tool_call_jsons(model_output):
            if not complete:
                break
            try:
                call = json.loads(body)
                function = FunctionCall(name=call["name"], arguments=json.dumps(call["arguments"], ensure_ascii=False))
            except (ValueError, KeyError, TypeError):
                logger.warning("not a tool call (left out): %r", body[:200])
                continue
            calls.append(ToolCall(type="function", function=function))
        if not calls:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        content = model_output[: model_output.find(self.tool_call_start_token)]
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=content or None)


ToolParserManager.register_module(NAME, module=ArtgwHermesToolParser)
