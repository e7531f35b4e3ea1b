"""The trainer's configuration: flat, every knob with a one-line comment, saved into every checkpoint."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainer.loss import AdvantageScale, LossConfig, Normalization


@dataclass(frozen=True)
class TrainConfig:
    # -- what to train, where things are
    model: str  # the trainable model name the gateway serves (groups are claimed for it)
    base_model: str  # path or hub id of the base weights (the same vLLM serves)
    db: str  # SQLAlchemy URL of the gateway's store
    gateway: str = "http://127.0.0.1:8000"  # where to post new adapters
    admin_key: str | None = None  # the gateway's admin key (None: gateway on this machine, no key)
    checkpoints: Path = Path("data/checkpoints")  # CHECKPOINTS/<model>/<step>/
    # -- batching policy
    groups_per_step: int = 4  # groups per optimizer step
    min_groups_per_step: int = 1  # after max_wait_seconds, train with this many if that is all there is
    max_wait_seconds: float = 30.0  # how long to wait for groups_per_step groups
    max_staleness: int = 8  # drop groups sampled this many adapter steps ago or more; 0 = keep all
    lease_seconds: float = 600.0  # a claim returns to `ready` if not committed within this long
    max_steps: int | None = None  # stop after this many committed steps (None: run until stopped)
    # -- LoRA (defaults vLLM loads: no DoRA, no modules_to_save, rank <= the engine's --max-lora-rank)
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # -- optimizer
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    gradient_checkpointing: bool = False
    # -- GRPO
    scale_rewards: AdvantageScale = "group"  # advantages divided by the std of: group | batch | none
    normalization: Normalization = "grpo"  # grpo (per trajectory) | dr_grpo | dapo (per token)
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    tis_cap: float | None = 2.0  # truncated importance-sampling cap; None = off
    beta: float = 0.0  # KL to the base model (adapter disabled), k3 estimator; 0 = off
    mask_truncated: bool = False  # no loss on completions the length limit cut (finish_reason "length")
    # Tokens sampled under a grammar (named/required tool_choice, JSON response_format, guided decoding) are
    # context unless this is set: vLLM reports their logprobs after the grammar's mask, so their importance
    # ratio against the unmasked policy is off by the mask's renormalization (often 100x and more).
    train_constrained: bool = False
    # -- batch layout
    # Packing width. Attention inside a packed row costs (row tokens)^2 under the block mask, so rows stay
    # narrow; a sequence longer than this gets a row of its own (never truncated).
    pack_tokens_per_row: int = 512
    rows_per_micro_batch: int = 8  # gradient accumulation unit
    # -- misc
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    pause_before_commit: float = 0.0  # seconds to sleep between checkpoint and commit (crash tests)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.groups_per_step < 1 or not 1 <= self.min_groups_per_step <= self.groups_per_step:
            raise ValueError("need 1 <= min_groups_per_step <= groups_per_step")
        if self.lora_rank < 1 or self.learning_rate <= 0:
            raise ValueError("lora_rank must be >= 1 and learning_rate > 0")
        if self.max_staleness < 0 or self.lease_seconds <= 0:
            raise ValueError("max_staleness must be >= 0 and lease_seconds > 0")
        self.loss()  # validates the GRPO knobs

    def loss(self) -> LossConfig:
        return LossConfig(
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            tis_cap=self.tis_cap,
            normalization=self.normalization,
            beta=self.beta,
        )

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["checkpoints"] = str(self.checkpoints)
        data["admin_key"] = None  # never written to disk
        return data
