"""`artgw demo`'s settings (`DemoConfig`) and the presets of its two models, apart from the demo itself: every `artgw`
command builds its parser from them, and the demo's own imports (the client, the store's API, SQLAlchemy: ~0.5 s of
CPU) are for `artgw demo` alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

TaskName = Literal["larger", "sum"]  # the real model's tasks (artgw/real_task.py)
DEFAULT_TASK: TaskName = "larger"
DemoModel = Literal["tiny", "smollm2"]
# What the real model's run changes (measured on this 2-core machine: bench/README.md): fewer, longer steps; its
# trained weights move with a smaller learning rate than the toy's random ones. By step ~7 most groups agree (the
# policy is near-deterministic, and no-signal rounds make no step): more steps add little.
SMOLLM2_PRESET: dict[str, Any] = {
    "steps": 10,
    "groups_per_step": 4,
    "attempts": 8,
    "eval_scenarios": 32,
    "eval_samples": 4,
    "eval_every": 0,
    "learning_rate": 2e-3,
}
QUICK: dict[str, dict[str, Any]] = {
    "tiny": {"steps": 8, "eval_scenarios": 32, "eval_samples": 2, "eval_every": 0},
    "smollm2": {"steps": 4, "eval_scenarios": 16, "eval_samples": 2, "eval_every": 0},
}


@dataclass
class DemoConfig:
    out: Path = Path("demo-out")
    data_dir: Path = Path("data/demo")  # the model's directory, and runs/<time>/ (store, checkpoints, logs) per run
    model: DemoModel = field(default="tiny", metadata={"env": "ARTGW_DEMO_MODEL"})  # not the trainer's ARTGW_MODEL
    task: TaskName = DEFAULT_TASK  # the real model's
    steps: int = 16  # GRPO steps
    groups_per_step: int = 8  # scenarios per step
    attempts: int = 8  # attempts per scenario (the group GRPO compares)
    eval_scenarios: int = 64  # held-out scenarios
    eval_samples: int = 4  # sampled attempts per held-out scenario (plus one greedy)
    eval_every: int = 4  # also evaluate every N steps (0: before and after only)
    train_minutes: float = 0.0  # take no step after this many minutes of training (0: all `steps`)
    learning_rate: float = 5e-3
    lora_rank: int = 8
    lora_alpha: int = 16
    seed: int = 0
    trainer_args: tuple[str, ...] = ()  # more `artgw train` options, e.g. ("--beta", "0.05")
    concurrency: int = 16
    port: int = 0  # 0: a free port
    engine_port: int = 0
    startup_timeout: float = 600.0
    step_timeout: float = 300.0  # longest wait for one trainer step to be served

    @classmethod
    def preset(cls, quick: bool = False, **overrides: Any) -> DemoConfig:
        """The model's defaults (and --quick's), under what was given."""
        model = overrides.get("model", "tiny")
        values: dict[str, Any] = dict(SMOLLM2_PRESET) if model == "smollm2" else {}
        if quick:
            values.update(QUICK.get(model, {}))
        values.update(overrides)
        return cls(**values)

    @classmethod
    def quick(cls, **overrides: Any) -> DemoConfig:
        return cls.preset(quick=True, **overrides)
