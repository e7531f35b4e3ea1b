"""The trainer's configuration: flat, every knob declared once with its help, saved into every checkpoint.

Each field's `metadata["help"]` is its `artgw train --help` line; artgw/options.py derives the flag
(`--field-name`) and the variable (`ARTGW_FIELD_NAME`) from the name. `__post_init__` rejects bad
values with a message naming the option; nothing is clamped.

This module imports no torch (trainer/loss.py is imported only when the loss config is built), so the
CLI can read these declarations for `--help` and `artgw status` without loading torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    from trainer.loss import LossConfig

# The same values as trainer/loss.py's AdvantageScale and Normalization (tests/unit/test_options.py
# checks it); spelled out here so reading the config does not import torch.
ScaleRewards = Literal["group", "batch", "none"]
NormalizationName = Literal["grpo", "dr_grpo", "dapo"]
LossName = Literal["ppo", "cispo", "gspo"]
Device = Literal["auto", "cpu", "cuda"]
GradientCheckpointing = Literal["auto", "on", "off"]


# Characters W&B refuses in a project name (wandb/sdk/artifacts/_validators.py: INVALID_URL_CHARS).
WANDB_NAME_FORBIDDEN = "/\\#?%:\r\n"


def _number(value: float) -> bool:
    return math.isfinite(value)


# kw_only: `models` has a default (the CLI's "my-agent") while `base_model` and `db` stay required.
@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # -- what to train, where things are
    models: tuple[str, ...] = field(
        default=("my-agent",),
        metadata={
            "help": "a trainable model (the gateway's --model-name) to claim groups for; repeat for several: "
            "one trainer takes turns between them, each with its own LoRA, optimizer and checkpoints",
            "flag": "--model",
            "repeat": True,
        },
    )
    # The CLI asks the gateway (GET /v1/art/models/NAME: base_model_path) when it is not given.
    base_model: str = field(metadata={"help": "path or hub id of the base weights (the same vLLM serves)"})
    # The CLI builds it from --data-dir/--db, declared once on the gateway's Settings.
    db: str = field(metadata={"option": False})
    gateway: str = field(
        default="http://127.0.0.1:8000",
        metadata={"help": "URL of the gateway to talk to (the trainer commits its steps there)"},
    )
    admin_key: str | None = field(
        default=None,
        metadata={"help": "the gateway's admin key; better in the environment (none: the key in --admin-key-file)"},
    )
    checkpoints: Path = field(
        default=Path("data/checkpoints"), metadata={"help": "checkpoint root: CHECKPOINTS/<model>/<step>/"}
    )
    # -- batching policy
    groups_per_step: int = field(default=4, metadata={"help": "groups per optimizer step"})
    min_groups_per_step: int = field(
        default=1,
        metadata={"help": "after --max-wait-seconds, train with this many groups if that is all there is"},
    )
    max_wait_seconds: float = field(
        default=30.0,
        metadata={"help": "how long to wait for --groups-per-step groups", "aliases": ("--max-wait",)},
    )
    max_staleness: int = field(
        default=8, metadata={"help": "drop groups sampled this many adapter steps ago or more (0: keep all)"}
    )
    lease_seconds: float = field(
        default=600.0, metadata={"help": "a claim returns to `ready` if not committed within this long"}
    )
    max_steps: int | None = field(
        default=None,
        metadata={"help": "stop after this many committed steps of each model (none: run until stopped)"},
    )
    # -- LoRA (defaults vLLM loads: no DoRA, no modules_to_save, rank <= the engine's --max-lora-rank)
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank (<= the gateway's --max-lora-rank)"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout, in [0, 1)"})
    target_modules: tuple[str, ...] = field(
        default=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        metadata={"help": "modules that get a LoRA, one shell-quoted string"},
    )
    # -- optimizer
    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1, in [0, 1)"})
    beta2: float = field(default=0.99, metadata={"help": "AdamW beta2, in [0, 1)"})
    grad_clip: float = field(default=1.0, metadata={"help": "max global gradient norm (0: off)"})
    gradient_checkpointing: GradientCheckpointing = field(
        default="auto",
        metadata={
            "help": "recompute the body's activations in the backward pass (memory for ~1/3 more compute); "
            "auto: on for a base of 1B parameters or more (trainer/model.py)"
        },
    )
    # -- GRPO
    scale_rewards: ScaleRewards = field(
        default="group", metadata={"help": "advantages divided by the reward std of the group, the batch, or none"}
    )
    normalization: NormalizationName = field(
        default="grpo", metadata={"help": "loss normalization: grpo (per trajectory), dr_grpo or dapo (per token)"}
    )
    epsilon_low: float = field(default=0.2, metadata={"help": "PPO clip: ratio >= 1 - epsilon_low"})
    epsilon_high: float = field(default=0.28, metadata={"help": "PPO clip: ratio <= 1 + epsilon_high"})
    tis_cap: float | None = field(
        default=2.0,
        metadata={"help": "truncated importance-sampling cap, >= 1 + epsilon_high (none: off)"},
    )
    beta: float = field(default=0.0, metadata={"help": "KL-to-base weight, k3 estimator (0: off)"})
    mask_truncated: bool = field(
        default=False, metadata={"help": "no loss on completions the length limit cut (finish_reason 'length')"}
    )
    loss_name: LossName = field(
        default="ppo",
        metadata={
            "help": "policy loss: ppo (clipped token ratio, TIS-capped), cispo (clipped stop-gradient token weight "
            "times the log-probability) or gspo (clipped sequence-level ratio)",
            "flag": "--loss",
        },
    )
    # vLLM reports the logprobs of tokens sampled under a grammar (named/required tool_choice, JSON
    # response_format, guided decoding) after the grammar's mask; the trainer rebuilds the same grammar from the
    # recorded request and applies the same mask, so both sides compare the same masked distribution.
    train_constrained: bool = field(
        default=True,
        metadata={
            "help": "train tokens sampled under a grammar (named/required tool_choice, JSON response_format, "
            "guided decoding) under the same grammar mask vLLM used; --no-train-constrained makes them context"
        },
    )
    # -- batch layout
    # Packing width. Attention inside a packed row costs (row tokens)^2 under the block mask, so rows stay
    # narrow; a sequence longer than this gets a row of its own (never truncated).
    pack_tokens_per_row: int = field(
        default=512, metadata={"help": "tokens per packed row (a longer sequence gets a row of its own)"}
    )
    # The accumulation unit: the loss's normalizers are computed once over the whole step's batch, so the
    # update does not depend on it (nor on the packing width); only memory and speed do.
    micro_batch_rows: int = field(
        default=8,
        metadata={
            "help": "packed rows per forward/backward pass, at most this times --pack-tokens-per-row positions "
            "(memory only: the update is the same for any value)",
            "aliases": ("--rows-per-micro-batch",),
        },
    )
    logprob_chunk_tokens: int = field(
        default=256,
        metadata={
            "help": "positions per chunk through the output layer: peak memory is this times the vocabulary, "
            "not the batch's tokens times it"
        },
    )
    # -- several processes (torch.distributed: gloo on CPU, NCCL on GPUs); the batch is split by tokens
    nproc_per_node: int = field(
        default=1, metadata={"help": "training processes on this machine (one per GPU); 1: no torch.distributed"}
    )
    nnodes: int = field(default=1, metadata={"help": "machines training together (each runs artgw train)"})
    node_rank: int = field(default=0, metadata={"help": "this machine's index, 0 to --nnodes - 1 (0 claims groups)"})
    master_addr: str = field(
        default="127.0.0.1", metadata={"help": "address of the machine with --node-rank 0, reachable by every node"}
    )
    master_port: int = field(default=29500, metadata={"help": "port torch.distributed meets on at --master-addr"})
    # -- experiment tracking (trainer/tracking.py): W&B reads its own WANDB_* variables too (WANDB_MODE=offline,
    # WANDB_DIR, WANDB_API_KEY, ...); these only say which run
    wandb_project: str | None = field(
        default=None,
        metadata={
            "help": "log each committed step's metrics and adapter to a W&B run in this project (none: off, and "
            "wandb is not imported; WANDB_MODE=offline writes the run under WANDB_DIR for `wandb sync`)"
        },
    )
    wandb_entity: str | None = field(
        default=None,
        metadata={"help": "the W&B team or user that owns --wandb-project (none: WANDB_ENTITY, else your default)"},
    )
    wandb_run_name: str | None = field(
        default=None, metadata={"help": "the W&B run's display name (none: WANDB_NAME, else one W&B makes up)"}
    )
    # -- misc
    seed: int = field(default=0, metadata={"help": "random seed"})
    device: Device = field(default="auto", metadata={"help": "where to train (auto: cuda when there is one)"})
    pause_before_commit: float = field(
        default=0.0, metadata={"help": "seconds to sleep between checkpoint and commit (crash tests)"}
    )
    # A start (imports, the base model, the store) takes seconds here, a minute on a loaded machine.
    startup_dump_seconds: float = field(
        default=180.0,
        metadata={
            "help": "print every thread's stack to stderr if the trainer has not started (its first line) within "
            "this many seconds: where a silent start waits (0: never; one process only)"
        },
    )
    # Out of memory with no swap, a start can thrash for as long as the pressure lasts (trainer/startwatch.py).
    start_memory_stall_seconds: float = field(
        default=60.0,
        metadata={
            "help": "stop with one line (and a failed exit status) if the trainer's start makes no progress for "
            "this many seconds because memory ran out (the machine's or its cgroup's) (0: never; one process only)"
        },
    )
    extra: dict[str, Any] = field(default_factory=dict, metadata={"option": False})

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("give at least one --model")
        for name in self.models:
            # The name is a directory under --checkpoints: nothing that leaves it (the gateway allows no '/').
            if not name or "/" in name or "@" in name or name in (".", "..") or name.strip() != name:
                raise ValueError(f"invalid --model {name!r}: a trainable model's name (no '@' or '/')")
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"--model given twice: {', '.join(self.models)}")
        if self.groups_per_step < 1:
            raise ValueError(f"--groups-per-step must be >= 1, got {self.groups_per_step}")
        if not 1 <= self.min_groups_per_step <= self.groups_per_step:
            raise ValueError(
                f"--min-groups-per-step must be between 1 and --groups-per-step ({self.groups_per_step}), "
                f"got {self.min_groups_per_step}"
            )
        if not self.gateway.startswith(("http://", "https://")):
            raise ValueError(f"--gateway must be an http:// or https:// URL, got {self.gateway!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1 (none: no limit), got {self.max_steps}")
        if self.max_staleness < 0:
            raise ValueError(f"--max-staleness must be >= 0 (0: off), got {self.max_staleness}")
        # `not x >= 0` rather than `x < 0` so NaN is rejected too.
        for flag, value, low in (
            ("--max-wait-seconds", self.max_wait_seconds, 0.0),
            ("--grad-clip", self.grad_clip, 0.0),
            ("--weight-decay", self.weight_decay, 0.0),
            ("--pause-before-commit", self.pause_before_commit, 0.0),
            ("--startup-dump-seconds", self.startup_dump_seconds, 0.0),
            ("--start-memory-stall-seconds", self.start_memory_stall_seconds, 0.0),
        ):
            if not (_number(value) and value >= low):
                raise ValueError(f"{flag} must be >= {low}, got {value}")
        for flag, value in (("--lease-seconds", self.lease_seconds), ("--learning-rate", self.learning_rate)):
            if not (_number(value) and value > 0):
                raise ValueError(f"{flag} must be > 0, got {value}")
        for flag, value in (("--lora-dropout", self.lora_dropout), ("--beta1", self.beta1), ("--beta2", self.beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{flag} must be in [0, 1), got {value}")
        for flag, count in (
            ("--lora-rank", self.lora_rank),
            ("--lora-alpha", self.lora_alpha),
            ("--pack-tokens-per-row", self.pack_tokens_per_row),
            ("--micro-batch-rows", self.micro_batch_rows),
            ("--logprob-chunk-tokens", self.logprob_chunk_tokens),
            ("--nproc-per-node", self.nproc_per_node),
            ("--nnodes", self.nnodes),
        ):
            if count < 1:
                raise ValueError(f"{flag} must be >= 1, got {count}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes = {self.nnodes}), got {self.node_rank}")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"--master-port must be a TCP port (1 to 65535), got {self.master_port}")
        if not self.target_modules:
            raise ValueError("--target-modules must name at least one module")
        for flag, choice, choices in (
            ("--scale-rewards", self.scale_rewards, get_args(ScaleRewards)),
            ("--normalization", self.normalization, get_args(NormalizationName)),
            ("--loss", self.loss_name, get_args(LossName)),
            ("--device", self.device, get_args(Device)),
            ("--gradient-checkpointing", self.gradient_checkpointing, get_args(GradientCheckpointing)),
        ):
            if choice not in choices:
                raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {choice!r}")
        if self.wandb_project is not None:
            # W&B's own rule for a project name (what would appear in its URL).
            if not 1 <= len(self.wandb_project) <= 128 or set(self.wandb_project) & set(WANDB_NAME_FORBIDDEN):
                raise ValueError(
                    f"--wandb-project must be a W&B project name: 1 to 128 characters, none of "
                    f"{' '.join(WANDB_NAME_FORBIDDEN.strip())}, got {self.wandb_project!r}"
                )
        for flag, given in (("--wandb-entity", self.wandb_entity), ("--wandb-run-name", self.wandb_run_name)):
            if given is not None and self.wandb_project is None:
                raise ValueError(f"{flag} names a W&B run: give --wandb-project too (W&B logging is off without it)")
        if self.wandb_entity is not None and (not self.wandb_entity.strip() or "/" in self.wandb_entity):
            raise ValueError(f"--wandb-entity must be a W&B team or user name, got {self.wandb_entity!r}")
        self.loss()  # validates the GRPO knobs (epsilons, tis_cap, beta)

    def loss(self) -> LossConfig:
        from trainer.loss import LossConfig  # torch comes with it: only when a config is really built

        return LossConfig(
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            tis_cap=self.tis_cap,
            normalization=self.normalization,
            beta=self.beta,
            policy=self.loss_name,
        )

    def to_json(self) -> dict[str, Any]:
        """The config as every checkpoint's step.json and the W&B run keep it: no secret (admin key, the store's
        password)."""
        from sqlalchemy.engine import make_url  # only here: --help reads this module

        data = dataclasses.asdict(self)
        data["checkpoints"] = str(self.checkpoints)
        data["admin_key"] = None  # never written to disk
        data["db"] = make_url(self.db).render_as_string(hide_password=True)
        return data
