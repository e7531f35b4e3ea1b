"""Small typed values that cross process boundaries: the trainer's step metrics, the states of things.

A `StepMetrics` is made by the trainer, posted with the adapter-load request, kept in the store with
the step, exported on `/metrics` and printed by `artgw status`: one struct for all four.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

# A rollout's or a group's id, as a client may choose it: 1 to 128 letters, digits and `._:-`, starting with a
# letter or digit. Anchored as JSON Schema wants it (the OpenAPI document gives it); checked with `fullmatch`.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$"
ROLLOUT_ID = re.compile(ID_PATTERN)
GROUP_ID = ROLLOUT_ID  # the same rule

GroupState = Literal["scoring", "ready", "training", "trained", "failed"]
GROUP_STATES: tuple[GroupState, ...] = ("scoring", "ready", "training", "trained", "failed")
# broken: committed and served once, but its checkpoint no longer loads (never served again, nor resumed from)
AdapterStatus = Literal["loaded", "unloaded", "failed", "broken"]
AdapterEventKind = Literal["loaded", "unloaded", "load_failed"]
PromotionAction = Literal["promote", "rollback"]
PromotionActor = Literal["always", "gate", "canary", "admin", "migration"]  # who moved `NAME`
EvaluationStatus = Literal["running", "passed", "failed", "error"]
Promotion = Literal["always", "gated"]  # what `NAME` serves: every committed step, or those the gate passes


class StepMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """One training step, as the trainer measured it. Every field has a default: older rows lack some."""

    loss: float = 0.0
    policy_loss: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    ratio_mean: float = 1.0  # mean importance ratio (policy / sampler) over trained tokens, before the update
    constrained_tokens: int = 0  # trained tokens sampled under a grammar (scored under the same mask)
    constrained_ratio_mean: float = 1.0  # the same mean over those tokens alone
    grad_norm: float = 0.0
    reward_mean: float = 0.0
    reward_std: float = 0.0
    groups: int = 0
    zero_signal_group_fraction: float = 0.0
    zero_advantage_trajectories: int = 0
    trainable_tokens: int = 0
    padding_tokens: int = 0
    rows: int = 0
    trainable_tokens_per_second: float = 0.0
    step_seconds: float = 0.0
    staleness: int = 0
    peak_memory_mb: float = 0.0
    group_ids: list[str] = []
