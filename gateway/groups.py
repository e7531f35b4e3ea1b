"""Groups: several recorded attempts at one task, with rewards, the unit GRPO compares.

A group is created from rollout ids with caller rewards, or with a RULER request
(scored in the background by an LLM judge), or both (RULER's score becomes the
reward, the caller's is kept as a metric). Its life cycle, persisted:
`scoring` → `ready` → `training` → `trained`, or `failed` with the reason.

A rollout reference is a rollout id, or `"<rollout id>/<choice>"` for one choice
of an n > 1 call: one call with n choices is a whole group for single-turn tasks.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
import statistics
import time
import uuid
from typing import Any

import msgspec
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

import ruler
from gateway.adapters import AdapterRegistry
from gateway.errors import OpenAIError, decode_body, invalid_request, model_not_found
from gateway.metrics import GatewayMetrics
from gateway.recorder import Recorder
from gateway.rollouts import RolloutService, decode_cursor_pair, encode_cursor_pair
from store.groups import (
    GroupRow,
    StoreJudgeCache,
    fail_group,
    insert_group,
    list_group_ids,
    load_groups,
    scoring_group_ids,
    set_scores,
    taken_refs,
)

log = logging.getLogger("artgw.groups")

_GROUP_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")
_SECRET_PARAMS = {"api_key", "aws_secret_access_key", "aws_session_token", "azure_ad_token", "vertex_credentials"}
GROUP_STATES = ("scoring", "ready", "training", "trained", "failed")


# ---------------------------------------------------------------- request / response schemas


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
    model: str
    state: str
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


def parse_group_create(body: bytes) -> GroupCreate:
    return decode_body(body, GroupCreate)


def split_ref(ref: str) -> tuple[str, int | None]:
    """`"rid"` → (rid, None); `"rid/3"` → (rid, 3)."""
    rollout_id, _, choice = ref.partition("/")
    if not choice:
        return rollout_id, None
    if not choice.isdigit():
        raise ValueError(ref)
    return rollout_id, int(choice)


def _overlaps(taken_ref: str, rollout_id: str, choice: int | None) -> bool:
    """Whether a member already in a group covers (part of) this rollout reference."""
    taken_id, taken_choice = split_ref(taken_ref)
    return taken_id == rollout_id and (choice is None or taken_choice is None or taken_choice == choice)


def _no_signal(rewards: list[float]) -> bool:
    return max(rewards) - min(rewards) <= 1e-12


def _public_ruler(spec: RulerIn) -> dict[str, Any]:
    """What is stored and shown of a RULER request: never a secret."""
    params = {k: v for k, v in spec.litellm_params.items() if k not in _SECRET_PARAMS}
    return {"judge_model": spec.judge_model, "rubric": spec.rubric or ruler.DEFAULT_RUBRIC, "litellm_params": params}


def _request_hash(spec: GroupCreate) -> str:
    data = msgspec.to_builtins(spec)
    if spec.ruler is not None:
        data["ruler"] = _public_ruler(spec.ruler)
    data.pop("group_id", None)
    return hashlib.sha256(msgspec.json.encode(data, order="sorted")).hexdigest()


def _check_judge(spec: RulerIn) -> None:
    try:
        ruler.check_judge_model(spec.judge_model, spec.litellm_params)
    except ruler.RulerError:
        raise invalid_request(
            f"Unknown judge model `{spec.judge_model}`: name it as litellm does, e.g. `openai/gpt-4o-mini` "
            "or `hosted_vllm/<served name>` with litellm_params.api_base.",
            param="ruler.judge_model",
            code="unknown_judge",
        ) from None


class GroupService:
    def __init__(
        self,
        store: AsyncEngine,
        rollouts: RolloutService,
        registry: AdapterRegistry,
        recorder: Recorder | None,
        *,
        max_concurrent_judges: int = 4,
        settle_seconds: float = 2.0,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.metrics = metrics
        self.store = store
        self.rollouts = rollouts
        self.registry = registry
        self.recorder = recorder
        self.settle_seconds = settle_seconds
        self.judge_slots = asyncio.Semaphore(max_concurrent_judges)
        self.judge_cache = StoreJudgeCache(store)
        self._scoring: dict[str, asyncio.Task[None]] = {}
        self.judge_calls = 0
        self.judge_errors = 0

    # ------------------------------------------------------------ create

    async def create(self, spec: GroupCreate, idempotency_key: str | None = None) -> tuple[GroupOut, bool]:
        """Create a group (or return the one this same request created before). Returns (group, created)."""
        self._validate(spec)
        group_id = spec.group_id or idempotency_key or f"g-{uuid.uuid4().hex}"
        if not _GROUP_ID.match(group_id):
            raise invalid_request("Invalid group_id: 1 to 128 characters from letters, digits and `._:-`.", "group_id")
        request_hash = _request_hash(spec)
        existing = await self.get_row(group_id)
        if existing is not None:
            return self._replay(existing, request_hash), False

        refs = [r.rollout_id for r in spec.rollouts]
        await self._check_rollouts(spec, refs)
        now = time.time()
        rewards = [r.reward for r in spec.rollouts]
        state = "scoring" if spec.ruler is not None else "ready"
        group = {
            "id": group_id,
            "model": spec.model,
            "state": state,
            "request_hash": request_hash,
            "metadata": spec.metadata,
            "ruler": _public_ruler(spec.ruler) if spec.ruler is not None else None,
            "no_signal": None if spec.ruler is not None else _no_signal([r for r in rewards if r is not None]),
            "created_at": now,
            "updated_at": now,
        }
        members = []
        for position, item in enumerate(spec.rollouts):
            rollout_id, choice = split_ref(item.rollout_id)
            members.append(
                {
                    "position": position,
                    "rollout_ref": item.rollout_id,
                    "rollout_id": rollout_id,
                    "choice": choice,
                    "reward": item.reward if spec.ruler is None else None,
                    "caller_reward": item.reward,
                    "metrics": item.metrics,
                }
            )
        try:
            async with self.store.begin() as conn:
                await insert_group(conn, group, members)
        except IntegrityError:
            # A concurrent request took the id or one of the rollouts first.
            existing = await self.get_row(group_id)
            if existing is not None:
                return self._replay(existing, request_hash), False
            raise OpenAIError(
                409, "A rollout of this group was just put in another group.", code="rollout_in_group"
            ) from None
        if spec.ruler is not None:
            self._start_scoring(group_id, spec.ruler)
        row = await self.get_row(group_id)
        assert row is not None
        return group_out(row), True

    def _validate(self, spec: GroupCreate) -> None:
        if spec.model not in self.registry.models:
            raise model_not_found(spec.model)
        if len(spec.rollouts) < 2:
            raise invalid_request(
                "A group needs at least 2 rollouts: GRPO compares attempts at the same task.",
                param="rollouts",
                code="too_few_rollouts",
            )
        seen: set[str] = set()
        for i, item in enumerate(spec.rollouts):
            try:
                split_ref(item.rollout_id)
            except ValueError:
                raise invalid_request(
                    f"`{item.rollout_id}` is not a rollout id or `<rollout id>/<choice index>`.",
                    param=f"rollouts[{i}].rollout_id",
                ) from None
            if item.rollout_id in seen:
                raise invalid_request(
                    f"Rollout `{item.rollout_id}` appears twice in the group.",
                    param=f"rollouts[{i}].rollout_id",
                    code="duplicate_rollout",
                )
            seen.add(item.rollout_id)
            if item.reward is not None and not math.isfinite(item.reward):
                raise invalid_request(
                    f"Reward of `{item.rollout_id}` is not a finite number.",
                    param=f"rollouts[{i}].reward",
                    code="invalid_reward",
                )
            if spec.ruler is None and item.reward is None:
                raise invalid_request(
                    f"Rollout `{item.rollout_id}` has no reward: give every rollout a `reward`, or ask RULER "
                    "to score the group with `ruler`.",
                    param=f"rollouts[{i}].reward",
                    code="missing_reward",
                )
            for name, value in (item.metrics or {}).items():
                if not math.isfinite(value):
                    raise invalid_request(
                        f"Metric `{name}` of `{item.rollout_id}` is not finite.", param=f"rollouts[{i}].metrics"
                    )
        if spec.ruler is not None:
            _check_judge(spec.ruler)

    async def _check_rollouts(self, spec: GroupCreate, refs: list[str]) -> None:
        rollout_ids = sorted({split_ref(r)[0] for r in refs})
        if self.recorder is not None:
            await self.recorder.settled(rollout_ids, self.settle_seconds)
            busy = [r for r in rollout_ids if self.recorder.in_flight(r)]
            if busy:
                raise OpenAIError(
                    409,
                    f"Rollout `{busy[0]}` has a call still in flight: create the group once its calls have returned.",
                    code="rollout_in_flight",
                )
        for i, ref in enumerate(refs):
            rollout_id, choice = split_ref(ref)
            trajectory = await self.rollouts.find(rollout_id, choice=choice)
            if trajectory is None:
                raise invalid_request(
                    f"Unknown rollout `{rollout_id}`: no call with this rollout id has been recorded.",
                    param=f"rollouts[{i}].rollout_id",
                    code="unknown_rollout",
                )
            if trajectory.model != spec.model:
                raise invalid_request(
                    f"Rollout `{rollout_id}` was served by model `{trajectory.model}`, not `{spec.model}`: "
                    "a group's rollouts must all belong to its trainable model.",
                    param=f"rollouts[{i}].rollout_id",
                    code="model_mismatch",
                )
            if not trajectory.sequences:
                raise invalid_request(
                    f"Rollout `{rollout_id}` has no successful call to train on.",
                    param=f"rollouts[{i}].rollout_id",
                    code="empty_rollout",
                )
            if choice is not None and not any(c.n > choice for c in trajectory.calls if c.status == "ok"):
                raise invalid_request(
                    f"Rollout `{rollout_id}` has no call with a choice {choice} (use n > {choice}).",
                    param=f"rollouts[{i}].rollout_id",
                    code="unknown_choice",
                )
        async with self.store.connect() as conn:
            taken = await taken_refs(conn, rollout_ids)
        for i, ref in enumerate(refs):
            rollout_id, choice = split_ref(ref)
            # A whole rollout and one of its choices overlap, as do a rollout used twice.
            clash = [(other, gid) for other, gid in taken.items() if _overlaps(other, rollout_id, choice)]
            if clash:
                raise OpenAIError(
                    409,
                    f"Rollout `{ref}` is already in group `{clash[0][1]}`: a rollout trains at most once.",
                    param=f"rollouts[{i}].rollout_id",
                    code="rollout_in_group",
                )

    def _replay(self, existing: GroupRow, request_hash: str) -> GroupOut:
        if existing.request_hash != request_hash:
            raise OpenAIError(
                409,
                f"Group `{existing.id}` exists with other content: use a new group_id / Idempotency-Key.",
                param="group_id",
                code="group_id_conflict",
            )
        return group_out(existing)

    # ------------------------------------------------------------ read

    async def get_row(self, group_id: str) -> GroupRow | None:
        async with self.store.connect() as conn:
            rows = await load_groups(conn, [group_id])
        return rows[0] if rows else None

    async def get(self, group_id: str) -> GroupOut:
        row = await self.get_row(group_id)
        if row is None:
            raise OpenAIError(404, f"No group `{group_id}`.", code="group_not_found")
        return group_out(row)

    async def page(self, *, model: str | None, state: str | None, limit: int, cursor: str | None) -> GroupPage:
        if state is not None and state not in GROUP_STATES:
            raise invalid_request(f"'state' must be one of {', '.join(GROUP_STATES)}.", param="state")
        if not 1 <= limit <= 1000:
            raise invalid_request("'limit' must be between 1 and 1000.", param="limit")
        after = decode_cursor_pair(cursor) if cursor else None
        async with self.store.connect() as conn:
            keys = await list_group_ids(conn, model=model, state=state, limit=limit, after=after)
            rows = await load_groups(conn, [gid for _, gid in keys])
        next_cursor = encode_cursor_pair(*keys[-1]) if len(keys) == limit else None
        return GroupPage([group_out(r) for r in rows], next_cursor)

    # ------------------------------------------------------------ RULER in the background

    def _start_scoring(self, group_id: str, spec: RulerIn) -> None:
        task = asyncio.create_task(self._score(group_id, spec), name=f"ruler-{group_id}")
        self._scoring[group_id] = task
        task.add_done_callback(lambda _: self._scoring.pop(group_id, None))

    async def resume_scoring(self) -> int:
        """Groups left `scoring` by a previous run are scored again (judge keys come from the environment)."""
        async with self.store.connect() as conn:
            pending = await scoring_group_ids(conn)
        for group_id in pending:
            row = await self.get_row(group_id)
            if row is not None and row.ruler is not None:
                self._start_scoring(group_id, msgspec.convert(row.ruler, RulerIn))
        return len(pending)

    async def _score(self, group_id: str, spec: RulerIn) -> None:
        row = await self.get_row(group_id)
        if row is None:
            return
        usage: dict[str, Any] | None = None
        try:
            trajectories = []
            for member in row.members:
                t = await self.rollouts.get(member.rollout_id, choice=member.choice, settle_seconds=0)
                trajectories.append(ruler.Trajectory(messages=t.messages, tools=t.tools))
            async with self.judge_slots:
                started = time.monotonic()
                result = await ruler.score_group(
                    trajectories,
                    judge_model=spec.judge_model,
                    rubric=spec.rubric or ruler.DEFAULT_RUBRIC,
                    litellm_params=spec.litellm_params,
                    cache=self.judge_cache,
                )
            self.judge_calls += result.usage.judge_calls
            if self.metrics is not None:
                self.metrics.judged(
                    row.model,
                    time.monotonic() - started,
                    result.usage.judge_calls,
                    result.usage.prompt_tokens,
                    result.usage.completion_tokens,
                )
            usage = msgspec.to_builtins(result.usage)
            scores = [(m.position, s.score, s.explanation) for m, s in zip(row.members, result.scores, strict=True)]
            async with self.store.begin() as conn:
                await set_scores(conn, group_id, scores, usage, _no_signal([s for _, s, _ in scores]))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.judge_errors += 1
            if self.metrics is not None:
                self.metrics.judge_errors.labels(row.model).inc()
            reason = f"RULER failed: {exc}" if isinstance(exc, ruler.RulerError) else f"RULER failed: {exc!r}"
            log.warning("group %s: %s", group_id, reason)
            async with self.store.begin() as conn:
                await fail_group(conn, group_id, reason[:2000], usage)

    async def close(self) -> None:
        for task in list(self._scoring.values()):
            task.cancel()
        await asyncio.gather(*self._scoring.values(), return_exceptions=True)
