"""Checkpoints: a step's adapter and optimizer state on disk (what vLLM loads), where a model resumes from, and
going back to a committed step.

CHECKPOINTS/<model>/<step>/ holds adapter_config.json + adapter_model.safetensors (PEFT's, what the engine
loads), optimizer.pt and step.json. A directory is complete or absent (written beside, then renamed). Only a
*committed* step (the gateway served it: store/adapters.py) is ever resumed from; newer ones are discarded.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from store.adapters import AdapterRow
from store.types import StepMetrics
from trainer import distributed
from trainer.config import TrainConfig
from trainer.console import console
from trainer.model import Policy, load_policy, make_optimizer


def checkpoint_dir(config: TrainConfig, name: str, step: int) -> Path:
    return config.checkpoints / name / str(step)


def save_checkpoint(
    model: Any, optimizer: torch.optim.Optimizer, config: TrainConfig, name: str, step: int, metrics: StepMetrics
) -> Path:
    out = checkpoint_dir(config, name, step)
    tmp = out.with_name(f".{step}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # adapter_config.json + adapter_model.safetensors: what vLLM loads
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    saved = {"model": name, "step": step, "metrics": msgspec.to_builtins(metrics), "config": config.to_json()}
    (tmp / "step.json").write_text(json.dumps(saved, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # a checkpoint dir is complete or absent
    return out


def discard_uncommitted(config: TrainConfig, name: str, committed: int) -> list[int]:
    """`name`'s checkpoints newer than its last committed step never served: their groups will be trained again."""
    root = config.checkpoints / name
    dropped = []
    for path in root.glob("*") if root.exists() else []:
        step = path.name.lstrip(".").removesuffix(".tmp")
        if step.isdigit() and (int(step) > committed or path.name.endswith(".tmp")):
            shutil.rmtree(path, ignore_errors=True)
            dropped.append(int(step))
    return sorted(dropped)


def resume_point(name: str, committed: Sequence[AdapterRow]) -> tuple[int, AdapterRow | None]:
    """Where a model's training resumes, given its committed steps (newest first): the number of the newest (the
    next step is one more), and the newest whose checkpoint loads (None: the base weights). A damaged or missing
    checkpoint is skipped with a one-line warning, never a traceback."""
    for row in committed:
        problem = unreadable(Path(row.path))
        if problem is None:
            return committed[0].step, row
        warning = f"[yellow]{name}: step {row.step}'s checkpoint {row.path} does not load ({problem})"
        console.print(warning, soft_wrap=True)
    if committed:
        console.print(f"[yellow]{name}: no committed checkpoint loads; resuming from the base weights", soft_wrap=True)
    return (committed[0].step if committed else 0), None


def restore(
    config: TrainConfig, device: torch.device, committed: AdapterRow | None
) -> tuple[Policy, torch.optim.Optimizer]:
    """A model's policy and optimizer as its committed step left them (a fresh LoRA before step 1). An optimizer
    state that does not load starts fresh, with a warning: the adapter is what matters."""
    adapter = Path(committed.path) if committed is not None else None
    model = load_policy(config, device, adapter)
    distributed.broadcast_parameters(model)  # several processes: every rank starts the step from rank 0's
    optimizer = make_optimizer(model, config)
    if adapter is not None and (adapter / "optimizer.pt").exists():
        try:
            optimizer.load_state_dict(torch.load(adapter / "optimizer.pt", map_location=device))
        except Exception as exc:  # a damaged file: torch raises whatever its unpickler met
            warning = f"[yellow]{adapter}/optimizer.pt does not load ({_one_line(exc)}): optimizer state fresh"
            console.print(warning, soft_wrap=True)
            optimizer = make_optimizer(model, config)
    return Policy.of(model, config, device), optimizer


def unreadable(adapter: Path) -> str | None:
    """Why a checkpoint's adapter cannot be loaded (a config that isn't JSON, weights missing or cut short), or
    None. Every tensor is read: a truncated file passes a header check."""
    from safetensors import safe_open

    try:
        if not isinstance(json.loads((adapter / "adapter_config.json").read_text()), dict):
            return "adapter_config.json is not a JSON object"
        with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as weights:
            for key in weights.keys():
                weights.get_tensor(key)
    except Exception as exc:  # OSError, JSONDecodeError, SafetensorError, ...: all say "not this checkpoint"
        return _one_line(exc)
    return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
