"""Small typed values that cross process boundaries: the trainer's step metrics and its adapter load (the body
the gateway's `POST /v1/art/models/NAME/adapters` decodes and client/ sends), the states of things.

A `StepMetrics` is made by the trainer, posted with the adapter-load request, kept in the store with
the step, exported on `/metrics` and printed by `artgw status`: one struct for all four.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

GroupState = Literal["scoring", "ready", "training", "trained", "failed"]
GROUP_STATES: tuple[GroupState, ...] = ("scoring", "ready", "training", "trained", "failed")
# broken: committed and served once, but its checkpoint no longer loads (never served again, nor resumed from)
AdapterStatus = Literal["loaded", "unloaded", "failed", "broken"]
AdapterEventKind = Literal["loaded", "unloaded", "load_failed"]
PromotionAction = Literal["promote", "rollback"]
PromotionActor = Literal["always", "gate", "canary", "admin", "migration"]  # who moved `NAME`
EvaluationStatus = Literal["running", "passed", "failed", "error"]


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


# Bounds of an adapter load: the store keeps `step` in a 32-bit INTEGER column (SQLite and PostgreSQL), and the
# rest is kept to what a trainer sends, so no admin input can fail only after the engine has loaded it.
MAX_STEP = 2**31 - 1
MAX_PATH = 4096  # PATH_MAX on Linux
MAX_GROUPS_PER_STEP = 10_000
MAX_ID = 256


class AdapterLoad(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a trainer posts once a step's checkpoint is on disk."""

    step: Annotated[int, msgspec.Meta(le=MAX_STEP)]  # >= 1 is checked by hand: its message explains step 0
    # directory with adapter_config.json + weights, readable by the engine
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH)]
    # the groups this step trained: marked trained once the adapter serves
    group_ids: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=MAX_ID)]], msgspec.Meta(max_length=MAX_GROUPS_PER_STEP)
    ] = []
    lease_owner: Annotated[str, msgspec.Meta(max_length=MAX_ID)] = ""
    metrics: StepMetrics | None = None
