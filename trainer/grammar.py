"""The grammar vLLM sampled a call under, rebuilt from the recorded request, as per-token allowed-token masks.

vLLM applies a structured-output grammar's bitmask to the logits before it samples and before it computes the
logprobs it reports, so a constrained token's recorded logprob is a log-softmax over the allowed tokens only.
For the importance ratio to compare like with like, the trainer applies the same masks to its own logits.

This module mirrors vLLM 0.32 with its default `auto` structured-output backend (xgrammar) and the gateway's
engine flags (`--enable-auto-tool-choice`, the gateway's tool parser plugin `artgw_hermes`, engine/tool_parser.py:
vLLM's hermes parser with compact call arguments, and the family's reasoning parser, store/families.py: none, or
qwen3). A model whose family has vLLM run other parsers (llama3_json, mistral, another reasoning parser) is refused
here: its constrained calls are trained as context, with a warning naming the parser, rather than scored under a
grammar vLLM did not apply.

- the request's constraint: `response_format` json_object / json_schema / structural_tag overrides the same
  field of `structured_outputs` (vllm/entrypoints/generate/base/protocol.py,
  structured_outputs_from_response_format); `structured_outputs.choice` becomes an EBNF grammar
  (vllm/v1/structured_output/utils.py, choice_as_grammar). The removed `guided_*` fields are ignored by vLLM.
- tool calls (vllm/parser/abstract_parser.py, _apply_structural_tag; vllm/tool_parsers/structural_tag_registry.py):
  with VLLM_ENFORCE_STRICT_TOOL_CALLING on (the default), a named or `required` tool_choice, or `auto` when a
  tool is `strict` or `parallel_tool_calls` is false, is sampled under hermes' structural tag: `<tool_call>`
  envelopes whose arguments follow the tool's schema when the tool is strict, any JSON otherwise, spaced as
  `json.dumps` spaces them and with unbounded integers bounded to JSON's safe integers, and under a named or
  `required` tool_choice the envelope's constant text as the tokens the tokenizer spells it in (the plugin's
  changes, engine/tool_grammar.py, which both import). With it off,
  named / `required` use the JSON schema of vllm/tool_parsers/utils.py (get_json_schema_from_tools).
- compilation (vllm/v1/structured_output/backend_xgrammar.py): TokenizerInfo.from_huggingface with the model's
  vocab size; JSON schemas with any whitespace (compact with `--structured-outputs-config.disable_any_whitespace`);
  the matcher's stop tokens are the request's stop_token_ids, the tokenizer's eos and the generation config's
  eos ids (SamplingParams.all_stop_token_ids). Schemas xgrammar does not support go to another backend
  (has_xgrammar_unsupported_json_features).
- masking (vllm/v1/structured_output/__init__.py): each step's row is the matcher's bitmask before the sampled
  token is accepted; the stop token ending the output is accepted by the grammar (the only tokens it allows once
  complete); after the grammar terminates (ignore_eos) nothing is masked.
- reasoning (the same file's _get_constraint_bounds and accept_tokens; vllm/parser/qwen3.py, whose parser engine
  vllm/parser/engine/parser_engine.py gives is_reasoning_end and find_reasoning_end): with a reasoning parser the
  grammar starts where the reasoning block ends. Constrained from the first token when the request sets
  `include_reasoning: false`, or the prompt already ends reasoning (chat_completion/protocol.py,
  resolve_reasoning_ended: thinking off renders `<think>\n\n</think>\n\n`); otherwise the tokens up to the
  reasoning's end are sampled free and unmasked. Its end is the first sampled `</think>` (never fed to the
  grammar, which starts with the next token) or a token that ends it implicitly, `<tool_call>` (fed to the grammar
  as the call's first token, itself sampled free).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import xgrammar as xgr
from torch import Tensor
from xgrammar import structural_tag as st

from engine.tool_grammar import arguments_grammar, pinned_calls
from store.families import HERMES, HERMES_ONLY, EngineParsers, parsers_for_model

if TYPE_CHECKING:
    from xgrammar.openai_tool_call_schema import ToolParam

log = logging.getLogger("artgw.trainer")

__all__ = ["GrammarMasks", "GrammarSpec", "grammar_spec"]

# The string formats xgrammar implements; a schema with another goes to guidance (vLLM's list).
_XGRAMMAR_STRING_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# StructuredOutputsParams' constraints, in the order vLLM picks the one that applies (get_structured_output_key).
_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class _ReasoningMarkers(NamedTuple):
    """A reasoning parser's markers as vLLM's structured-output gate reads them (its parser engine's config)."""

    start: str  # opens a reasoning block (in a prompt: reasoning has not ended)
    end: str  # ends it; not fed to the grammar
    implicit_ends: tuple[str, ...]  # content tokens that also end it: fed to the grammar, sampled free
    turn_boundaries: tuple[str, ...]  # where the prompt scan for an earlier end stops


# The reasoning parsers mirrored here, by vLLM's name (qwen3: vllm/parser/qwen3.py, Qwen3Parser and qwen3_config).
_REASONING: dict[str, _ReasoningMarkers] = {
    "qwen3": _ReasoningMarkers("<think>", "</think>", ("<tool_call>",), ("<|im_start|>", "<|im_end|>")),
}


class _ReasoningGate:
    """Where vLLM starts a call's grammar under a reasoning parser, in token ids (the module's doc, `reasoning`)."""

    def __init__(self, markers: _ReasoningMarkers, vocab: dict[str, int]) -> None:
        self.start_id = vocab[markers.start]
        self.end_id = vocab[markers.end]
        self.end_ids = {self.end_id, *(vocab[t] for t in markers.implicit_ends)}
        self.boundary_ids = {vocab[t] for t in markers.turn_boundaries if t in vocab}  # vLLM skips a missing one

    @classmethod
    def for_parser(cls, name: str, tokenizer: Any) -> _ReasoningGate | None:
        """None: the parser is not mirrored, or a marker is not one token of this vocabulary (vLLM's gate then
        falls back to text matching, not mirrored either)."""
        markers = _REASONING.get(name)
        if markers is None:
            return None
        vocab = tokenizer.get_vocab()
        if not all(t in vocab for t in (markers.start, markers.end, *markers.implicit_ends)):
            return None
        return cls(markers, vocab)

    def bounds(self, request: dict[str, Any], prompt: list[int], sampled: list[int]) -> tuple[int, int]:
        """(first sampled position fed to the grammar, first position masked); (n, n): none (reasoning never ends)."""
        if request.get("include_reasoning") is False or self._ended_in(prompt, _thinking(request)):
            return 0, 0
        for position, token in enumerate(sampled):
            if token == self.end_id:
                return position + 1, position + 1
            if token in self.end_ids:  # an implicit end: the grammar's first token, sampled before it applied
                return position, position + 1
        return len(sampled), len(sampled)

    def _ended_in(self, prompt: list[int], thinking: bool) -> bool:
        """vLLM's is_reasoning_end on the prompt: an end after the last start within the last turn, or thinking off."""
        for token in reversed(prompt):
            if token in self.end_ids:
                return True
            if token == self.start_id:
                if thinking:  # with thinking off, <think> does not open reasoning (the config's CONTENT state)
                    return False
                break
            if token in self.boundary_ids:
                break
        return not thinking


def _thinking(request: dict[str, Any]) -> bool:
    """Whether the request renders and parses with thinking on: the reasoning parser's `enable_thinking`, from
    `chat_template_kwargs`, else `reasoning_effort` (vLLM's build_chat_params), else on."""
    kwargs = request.get("chat_template_kwargs") or {}
    if "enable_thinking" in kwargs:
        return bool(kwargs["enable_thinking"])
    effort = request.get("reasoning_effort")
    return effort != "none" if effort is not None else True


class GrammarSpec(NamedTuple):
    """What vLLM compiles: the kind of grammar and its text (the compile cache's key)."""

    kind: Literal["json", "regex", "ebnf", "lark", "structural_tag"]
    text: str


def grammar_spec(request: dict[str, Any], tokenizer: Any, *, strict_tool_calling: bool = True) -> GrammarSpec | None:
    """The grammar vLLM compiles for a chat or completions request as sent to it; None when it samples under none,
    or under a grammar of a backend other than xgrammar (a JSON schema with features xgrammar lacks).

    `tokenizer`: the model's, which spells a forced call's constant text (the plugin's pinned_calls).
    `strict_tool_calling`: vLLM's VLLM_ENFORCE_STRICT_TOOL_CALLING (on unless the engine's environment turns it off).
    """
    structured = _structured_outputs(request)
    own = _constraint_spec(structured)
    tools = request.get("tools") or []
    tool_choice = request["tool_choice"] if "tool_choice" in request else ("auto" if tools else "none")
    if not tools or tool_choice in (None, "none"):
        return own
    if tool_choice == "auto" and structured is not None and own is None:
        return None  # vLLM leaves the tools unconstrained and hands the output to guidance
    single_call = request.get("parallel_tool_calls") is False
    if strict_tool_calling:
        tag = _hermes_tag(tools, tool_choice, single_call, structured, tokenizer)
        return GrammarSpec("structural_tag", tag) if tag is not None else own
    if structured is not None and "structural_tag" in structured:
        return own  # the parser keeps a structural tag the client gave
    schema = _tool_calls_schema(tools, tool_choice, single_call)
    return _constraint_spec({"json": schema}) if schema is not None else own


class GrammarMasks:
    """Built once per trainer (per tokenizer); compiled grammars are cached by their spec.

    `eos_token_ids`: the model's generation-config eos ids, which vLLM stops on beside the tokenizer's eos.
    `strict_tool_calling` and `disable_any_whitespace`: the engine's VLLM_ENFORCE_STRICT_TOOL_CALLING and
    `--structured-outputs-config.disable_any_whitespace`.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        eos_token_ids: Iterable[int] = (),
        strict_tool_calling: bool = True,
        disable_any_whitespace: bool = False,
        parsers: EngineParsers = HERMES_ONLY,
        cache_size: int = 256,
    ) -> None:
        self.vocab_size = vocab_size
        self.parsers = parsers
        reasoning = parsers.reasoning_parser
        self._reasoning = _ReasoningGate.for_parser(reasoning, tokenizer) if reasoning is not None else None
        self._refused: set[str] = set()  # the refusals already logged (once each)
        self.strict_tool_calling = strict_tool_calling
        self.disable_any_whitespace = disable_any_whitespace
        self._stop_ids = {*eos_token_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])}
        self._tokenizer = tokenizer
        self._compiled = functools.lru_cache(maxsize=cache_size)(self._compile)

    @classmethod
    def for_model(cls, path: str) -> GrammarMasks:
        """The masks for the model at `path` (a directory or hub id) as vLLM serves it: its tokenizer, its
        vocabulary size (the logits' width, which may exceed the tokenizer's) and its generation config's eos ids."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        tokenizer = AutoTokenizer.from_pretrained(path)
        vocab_size = AutoConfig.from_pretrained(path).get_text_config().vocab_size
        try:
            eos = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:  # no generation_config.json: vLLM stops on the tokenizer's eos alone
            eos = None
        eos_ids = [eos] if isinstance(eos, int) else list(eos or ())
        return cls(tokenizer, vocab_size, eos_token_ids=eos_ids, parsers=parsers_for_model(path))

    def for_call(
        self, request: dict[str, Any], sampled_token_ids: list[int], prompt_token_ids: list[int] | None = None
    ) -> Tensor | None:
        """(n, ceil(vocab_size / 32)) int32: row i = the tokens the grammar allowed when sampled_token_ids[i]
        was sampled (xgrammar's bitmask layout: bit j % 32 of word j // 32); all allowed before the grammar starts
        (a reasoning block: the module's doc). `prompt_token_ids`: what the call was sampled after (vLLM reads
        there whether reasoning has already ended). None when the request samples under
        no grammar, or under one that cannot be rebuilt here (another backend's, or one xgrammar fails to
        compile): the caller then treats those tokens as context. ValueError when the grammar rejects a
        sampled token (the request does not describe what vLLM sampled under). None too, with a warning, when
        the model's parsers are ones this module does not mirror (`refusal`)."""
        spec = grammar_spec(request, self._tokenizer, strict_tool_calling=self.strict_tool_calling)
        if spec is None:
            return None
        refusal = self.refusal(request)
        if refusal is not None:
            if refusal not in self._refused:
                self._refused.add(refusal)
                log.warning("constrained calls trained as context: %s", refusal)
            return None
        compiled = self._compiled(spec)
        if compiled is None:
            return None
        stops = self._stop_ids | set(request.get("stop_token_ids") or ())
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stops))
        masks = xgr.allocate_token_bitmask(len(sampled_token_ids), self.vocab_size)  # all allowed
        fed, masked = (0, 0)
        if self._reasoning is not None:
            fed, masked = self._reasoning.bounds(request, list(prompt_token_ids or ()), sampled_token_ids)
        for position in range(fed, len(sampled_token_ids)):
            token = sampled_token_ids[position]
            if matcher.is_terminated():
                break  # past the accepted stop token (ignore_eos): vLLM neither feeds nor masks any more tokens
            if position >= masked:
                matcher.fill_next_token_bitmask(masks, position)
            if not matcher.accept_token(token):
                raise ValueError(f"the grammar rejects sampled token {token} at position {position} ({spec.kind})")
        return masks

    def refusal(self, request: dict[str, Any]) -> str | None:
        """Why the grammar of `request` (sampled under one) cannot be rebuilt for this model's parsers; None: it can."""
        parsers = self.parsers
        if parsers.reasoning_parser is not None and self._reasoning is None:
            return (
                f"with --reasoning-parser {parsers.reasoning_parser} vLLM starts the grammar where the reasoning "
                f"block ends, which is rebuilt here for {', '.join(_REASONING)} (on a vocabulary with its markers) only"
            )
        tools = request.get("tools") or []
        tool_choice = request.get("tool_choice", "auto" if tools else "none")
        if tools and tool_choice not in (None, "none") and parsers.tool_call_parser != HERMES:
            return (
                f"a tool call's grammar is rebuilt for the hermes parser only, and this model's is "
                f"{parsers.tool_call_parser} ({parsers.why})"
            )
        if self._compiler is None:
            return f"xgrammar cannot read this model's tokenizer ({type(self._tokenizer).__name__})"
        return None

    @functools.cached_property
    def _compiler(self) -> xgr.GrammarCompiler | None:
        """xgrammar's compiler for this vocabulary, built for the first grammar (reading a 150k-token vocabulary
        takes seconds); None where xgrammar cannot read the tokenizer (mistral_common's tekken, which vLLM reads
        its own way, not mirrored here)."""
        try:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size)
        except ValueError:
            return None
        return xgr.GrammarCompiler(info)

    def cache_info(self) -> Any:
        """The compile cache's hits and misses (functools' CacheInfo)."""
        return self._compiled.cache_info()

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar | None:
        compiler = self._compiler
        assert compiler is not None, "refused before (`refusal`)"
        try:
            if spec.kind == "json":
                compact = self.disable_any_whitespace
                separators = (",", ":") if compact else None
                return compiler.compile_json_schema(spec.text, any_whitespace=not compact, separators=separators)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "ebnf":
                return compiler.compile_grammar(spec.text)
            if spec.kind == "lark":
                return compiler.compile_lark(spec.text)
            legacy = json.loads(spec.text)
            if "structures" in legacy:  # the deprecated {"structures", "triggers"} form
                items = [
                    xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                    for s in legacy["structures"]
                ]
                return compiler.compile_structural_tag(items, legacy["triggers"])
            return compiler.compile_structural_tag(spec.text)
        except Exception:  # vLLM's auto backend falls back to guidance for what xgrammar cannot compile
            return None


def _structured_outputs(request: dict[str, Any]) -> dict[str, Any] | None:
    """The request's one structured-output constraint ({field: value}), `response_format` applied; None: none."""
    fields = {k: v for k, v in (request.get("structured_outputs") or {}).items() if k in _CONSTRAINTS}
    response_format = request.get("response_format")
    if not isinstance(response_format, dict):
        response_format = {}
    kind = response_format.get("type")
    if kind == "json_object":
        fields["json_object"] = True
    elif kind == "json_schema":
        fields["json"] = (response_format.get("json_schema") or {}).get("schema")
    elif kind == "structural_tag":
        fields["structural_tag"] = json.dumps(response_format)
    chosen = [(k, fields[k]) for k in _CONSTRAINTS if fields.get(k) is not None]
    return dict(chosen[:1]) or None  # vLLM refuses a request with two


def _constraint_spec(structured: dict[str, Any] | None) -> GrammarSpec | None:
    if not structured:
        return None
    ((kind, value),) = structured.items()
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        if _needs_other_backend(schema):
            return None
        return GrammarSpec("json", value if isinstance(value, str) else json.dumps(value))
    if kind == "json_object":
        return GrammarSpec("json", '{"type": "object"}')
    if kind == "regex":
        return GrammarSpec("regex", value)
    if kind == "choice":
        return GrammarSpec("ebnf", _choice_grammar(value))
    if kind == "grammar":
        return GrammarSpec("lark" if _is_lark(value) else "ebnf", value)
    return GrammarSpec("structural_tag", value)


def _choice_grammar(choices: list[str]) -> str:
    """vLLM's EBNF for `choice`: one quoted literal per choice."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch

    return "root ::= " + " | ".join('"' + "".join(map(escape, c)) + '"' for c in choices)


def _is_lark(grammar: str) -> bool:
    """vLLM's test: a grammar with no `::=` rule (comments aside) is Lark, otherwise EBNF."""
    return not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.split("\n"))


def _needs_other_backend(schema: Any) -> bool:
    """Whether vLLM's auto backend hands this JSON schema to guidance: features xgrammar does not implement."""
    if isinstance(schema, list):
        return any(_needs_other_backend(item) for item in schema if isinstance(item, dict))
    if not isinstance(schema, dict):
        return False
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else {t for t in declared or () if isinstance(t, str)}

    def bounded(s: dict[str, Any]) -> bool:  # pattern or format together with a length bound
        return ("pattern" in s or "format" in s) and ("minLength" in s or "maxLength" in s)

    names = schema.get("propertyNames")
    patterns = schema.get("patternProperties")
    if (
        (types & {"integer", "number"} and "multipleOf" in schema)
        or ("array" in types and any(k in schema for k in ("uniqueItems", "contains", "minContains", "maxContains")))
        or ("string" in types and "format" in schema and schema["format"] not in _XGRAMMAR_STRING_FORMATS)
        or ("string" in types and bounded(schema))
        or (
            "object" in types
            and names is not None
            and (
                (isinstance(names, dict) and bounded(names))
                or "patternProperties" in schema
                or "properties" in schema
                or schema.get("unevaluatedProperties", True) is not True
            )
        )
        or ("object" in types and isinstance(patterns, dict) and ("properties" in schema or len(patterns) > 1))
        or (isinstance(schema.get("allOf"), list) and len(schema["allOf"]) >= 2)
    ):
        return True
    return any(_needs_other_backend(v) for v in schema.values() if isinstance(v, dict | list))


def _hermes_tag(
    tools: list[dict[str, Any]], tool_choice: Any, single_call: bool, structured: dict[str, Any] | None, tokenizer: Any
) -> str | None:
    """The structural tag (JSON) vLLM's hermes parser samples tool calls under; None when it sets none."""
    is_auto = tool_choice == "auto"
    functions = [t["function"] for t in tools if t.get("type", "function") == "function"]
    # --tool-strict-level auto, raised to `function` when a single call must be enforced.
    function_level = single_call and not (is_auto and structured is not None)
    if is_auto and not function_level and not any(f.get("strict") is True for f in functions):
        return None
    output = None
    if is_auto and structured is not None:
        # Free text or the structured output, or tool calls: the tools' "required" tag or'ed with the output.
        output = _output_format(structured)
        tool_choice = "required"
    dumped: list[ToolParam | dict[Any, Any]] = [
        {
            "type": "function",
            "function": {
                "name": f["name"],
                "strict": f.get("strict") is True,  # pinned: a tool not marked strict gets free arguments
                **({"parameters": f["parameters"]} if f.get("parameters") is not None else {}),
            },
        }
        for f in functions
    ]
    chosen, _, simplified = xgr.normalize_tool_choice(dumped, tool_choice)
    envelopes = (('<tool_call>\n{"name": "', "}\n</tool_call>"), ('<tool_call>{"name": "', "}</tool_call>"))
    tags = [
        st.TagFormat(
            begin=f'{begin}{tool.function.name}", "arguments": ',
            content=arguments_grammar(_arguments_schema(tool.function)),
            end=end,
        )
        for tool in chosen
        for begin, end in envelopes
    ]
    calls: st.Format
    if simplified == "auto":
        calls = st.TriggeredTagsFormat(triggers=["<tool_call>"], tags=tags, stop_after_first=single_call)
    else:
        calls = st.TagsWithSeparatorFormat(
            tags=tags, separator="", at_least_one=True, stop_after_first=single_call or simplified == "forced"
        )
        calls = pinned_calls(calls, tokenizer)
    tag = st.StructuralTag(format=calls if output is None else st.OrFormat(elements=[calls, output]))
    return json.dumps(tag.model_dump())


def _arguments_schema(function: Any) -> dict[str, Any] | bool:
    """A call's arguments: the tool's schema when it is strict; any JSON otherwise, or when it has none."""
    if function.strict is False or function.parameters is None:
        return True
    parameters: dict[str, Any] = function.parameters
    return parameters


def _output_format(structured: dict[str, Any]) -> st.Format:
    """A structured-output constraint as a structural tag's format (vLLM's structured_outputs_to_format)."""
    ((kind, value),) = structured.items()
    if kind == "json_object":
        return st.JSONSchemaFormat(json_schema={"type": "object"})
    if kind == "json":
        return st.JSONSchemaFormat(json_schema=json.loads(value) if isinstance(value, str) else value)
    if kind == "regex":
        return st.RegexFormat(pattern=value)
    if kind == "choice":
        return st.OrFormat(elements=[st.ConstStringFormat(value=c) for c in value])
    if kind == "grammar":
        return st.GrammarFormat(grammar=str(xgr.Grammar.from_lark(value)) if _is_lark(value) else value)
    tag = json.loads(value)
    if "structures" in tag:
        return st.TriggeredTagsFormat(
            triggers=tag["triggers"],
            tags=[
                st.TagFormat(begin=s["begin"], content=st.JSONSchemaFormat(json_schema=s["schema"]), end=s["end"])
                for s in tag["structures"]
            ],
        )
    return st.StructuralTag.model_validate(tag).format


def _tool_calls_schema(tools: list[dict[str, Any]], tool_choice: Any, single_call: bool) -> dict[str, Any] | None:
    """The JSON schema of a forced tool call with strict tool calling off: the named tool's arguments, or a list
    of {name, parameters} calls for `required`; None for `auto`."""
    functions = [t["function"] for t in tools if t.get("type", "function") == "function"]
    if isinstance(tool_choice, dict):
        (named,) = [f for f in functions if f["name"] == tool_choice["function"]["name"]]
        return named.get("parameters") or {"type": "object", "properties": {}}
    if tool_choice != "required":
        return None
    defs: dict[str, Any] = {}
    calls = []
    for function in functions:
        parameters = dict(function.get("parameters") or {})
        defs.update(parameters.pop("$defs", None) or {})  # hoisted: vLLM refuses clashing definitions
        calls.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": parameters if function.get("parameters") else {"type": "object", "properties": {}},
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if single_call:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
