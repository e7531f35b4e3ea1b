"""The wire format of `/v1/art/groups`: what clients post and what they get back."""

from __future__ import annotations

import statistics
from typing import Any

import msgspec

from store.groups import GroupRow
from store.types import GroupState


class RolloutIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rollout_id: str  # a rollout id, or "<rollout id>/<choice>" for one choice of an n > 1 call
    reward: float | None = None
    metrics: dict[str, float] | None = None


class RulerIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    judge_model: str  # any litellm model: "openai/gpt-4o", "hosted_vllm/<name>", ...
    rubric: str | None = None
    litellm_params: dict[str, Any] = {}  # passed to litellm as is; secrets are never stored or echoed


class GroupCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str
    rollouts: list[RolloutIn]
    ruler: RulerIn | None = None
    group_id: str | None = None
    metadata: dict[str, Any] | None = None


class GroupRolloutOut(msgspec.Struct, frozen=True):
    rollout_id: str
    reward: float | None
    caller_reward: float | None
    ruler_score: float | None
    ruler_explanation: str | None
    metrics: dict[str, float] | None


class GroupOut(msgspec.Struct, frozen=True):
    id: str
    group_id: str  # the same as `id`, under the name a request gives it
    model: str
    state: GroupState
    failure_reason: str | None
    no_signal: bool | None  # every reward equal: kept, but GRPO learns nothing from it
    reward_mean: float | None
    reward_std: float | None
    rollouts: list[GroupRolloutOut]
    ruler: dict[str, Any] | None
    judge_usage: dict[str, Any] | None
    metadata: dict[str, Any] | None
    trained_step: int | None
    created_at: float
    updated_at: float
    object: str = "art.group"


class GroupPage(msgspec.Struct, frozen=True):
    data: list[GroupOut]
    next_cursor: str | None
    object: str = "list"


def group_out(row: GroupRow) -> GroupOut:
    rewards = [m.reward for m in row.members if m.reward is not None]
    complete = len(rewards) == len(row.members)
    return GroupOut(
        id=row.id,
        group_id=row.id,
        model=row.model,
        state=row.state,
        failure_reason=row.failure_reason,
        no_signal=row.no_signal,
        reward_mean=statistics.fmean(rewards) if complete else None,
        reward_std=statistics.pstdev(rewards) if complete else None,
        rollouts=[
            GroupRolloutOut(m.rollout_ref, m.reward, m.caller_reward, m.ruler_score, m.ruler_explanation, m.metrics)
            for m in row.members
        ],
        ruler=row.ruler,
        judge_usage=row.judge_usage,
        metadata=row.metadata,
        trained_step=row.trained_step,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )
