"""Creating and reading groups: validation, idempotency (group_id / Idempotency-Key), the checks on each
rollout, and handing RULER groups to the scorer. The life cycle itself is the store's (store/groups.py)."""

from __future__ import annotations

import hashlib
import math
import statistics
import uuid
from typing import Any

import msgspec
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

import ruler
from gateway.adapters import AdapterRegistry
from gateway.auth import ADMIN, Caller
from gateway.errors import OpenAIError, invalid_request, model_not_found
from gateway.groups.checks import GroupCheck
from gateway.groups.policy import Refused, RulerPolicy
from gateway.groups.scorer import Scorer, criteria_of, no_signal
from gateway.metrics import GatewayMetrics
from gateway.promotion.graders import WebhookGrader
from gateway.proxy import EVAL_ROLLOUT_PREFIX
from gateway.rollouts import RolloutService
from store.api import GroupCreate, GroupOut, GroupPage, GroupRolloutOut, RulerIn
from store.groups import (
    GroupRow,
    NewGroup,
    NewMember,
    group_key,
    insert_group,
    list_group_ids,
    load_groups,
    taken_refs,
)
from store.records import RolloutKey
from store.rollouts import check_limit, decode_cursor_pair, encode_cursor_pair
from store.trajectories import Trajectory
from store.types import GROUP_ID, GROUP_STATES


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


def group_out(row: GroupRow) -> GroupOut:
    """A stored group as `/v1/art/groups` answers it: its rewards' mean and spread once every member has one."""
    rewards = [m.reward for m in row.members if m.reward is not None]
    complete = len(rewards) == len(row.members)
    return GroupOut(
        id=row.name,  # as its owner named it: the store's key (`<owner>/<id>`) is never shown
        group_id=row.name,
        model=row.model,
        state=row.state,
        failure_reason=row.failure_reason,
        no_signal=row.no_signal,
        reward_mean=statistics.fmean(rewards) if complete else None,
        reward_std=statistics.pstdev(rewards) if complete else None,
        rollouts=[
            GroupRolloutOut(
                m.rollout_ref,
                m.reward,
                m.caller_reward,
                m.ruler_score,
                m.ruler_explanation,
                m.metrics,
                m.ruler_criteria,
                m.ruler_spread,
                m.checks,
            )
            for m in row.members
        ],
        ruler=row.ruler,
        judge_usage=row.judge_usage,
        metadata=row.metadata,
        trained_step=row.trained_step,
        created_at=row.created_at,
        updated_at=row.updated_at,
        judge_spread=row.judge_spread,
        judge_agreement=row.judge_agreement,
        owner=row.owner,
    )


def public_ruler(spec: RulerIn) -> dict[str, Any]:
    """What is stored and shown of a RULER request: the judges' names and the sampling parameters a caller
    may set (policy.py: never an endpoint or a key), and never a webhook check's headers (a group judged again
    after a restart sends its checks none)."""
    shown: dict[str, Any] = {
        "judge_model": spec.judge_model,
        "rubric": spec.rubric or ruler.DEFAULT_RUBRIC,
        "litellm_params": spec.litellm_params,
    }
    if spec.judges:
        shown["judges"] = [{"judge_model": j.judge_model, "litellm_params": j.litellm_params} for j in spec.judges]
    if spec.samples > 1:
        shown["samples"] = spec.samples
    if spec.criteria:
        shown["criteria"] = msgspec.to_builtins(spec.criteria)
    if spec.checks:
        shown["checks"] = [_public_check(check) for check in spec.checks]
    if spec.max_spread is not None:
        shown["max_spread"] = spec.max_spread
    return shown


def _public_check(check: dict[str, Any]) -> dict[str, Any]:
    grader = check.get("grader")
    if isinstance(grader, dict) and "headers" in grader:
        return {**check, "grader": {k: v for k, v in grader.items() if k != "headers"}}
    return check


def request_hash(spec: GroupCreate) -> str:
    """What makes two requests "the same group": everything but the id, secrets left out."""
    data = msgspec.to_builtins(spec)
    if spec.ruler is not None:
        data["ruler"] = public_ruler(spec.ruler)
    data.pop("group_id", None)
    return hashlib.sha256(msgspec.json.encode(data, order="sorted")).hexdigest()


def _check_ruler(spec: RulerIn, policy: RulerPolicy) -> None:
    """400 for a panel that cannot run: no judge or two ways of naming one, a judge or a judge parameter the
    operator does not allow, criteria that clash, a check that does not decode or posts where it may not."""
    if (spec.judge_model is None) == (not spec.judges):
        raise invalid_request(
            "Name the judge with `judge_model`, or a panel with `judges`: one of the two.",
            param="ruler.judges" if spec.judges else "ruler.judge_model",
            code="invalid_judges",
        )
    try:
        policy.panel(spec)
    except Refused as exc:
        raise invalid_request(exc.message, param=f"ruler.{exc.field}", code=exc.code) from None
    try:
        ruler.check_criteria(criteria_of(spec))
    except ValueError as exc:
        raise invalid_request(f"`ruler.criteria`: {exc}.", param="ruler.criteria") from None
    for i, check in enumerate(spec.checks):
        try:
            grader = msgspec.convert(check, GroupCheck).grader
        except msgspec.ValidationError as exc:
            raise invalid_request(f"`ruler.checks[{i}]`: {exc}.", param=f"ruler.checks[{i}]") from None
        if isinstance(grader, WebhookGrader) and not policy.allows_webhook(grader.url):
            # The same answer whatever is at the address: refusing tells nothing about the network.
            raise invalid_request(
                "A group check's webhook may post only to an endpoint this gateway's operator allows "
                "(--group-webhook); this `url` is not at or under one.",
                param=f"ruler.checks[{i}].grader.url",
                code="webhook_not_allowed",
            )


class GroupService:
    def __init__(
        self,
        engine: AsyncEngine,
        rollouts: RolloutService,
        registry: AdapterRegistry,
        scorer: Scorer,
        *,
        metrics: GatewayMetrics,
        settle_seconds: float = 2.0,
    ) -> None:
        self.engine = engine
        self.rollouts = rollouts
        self.registry = registry
        self.scorer = scorer
        self.metrics = metrics  # what the grouped rollouts assemble into (sequences a call, split causes)
        self.settle_seconds = settle_seconds  # how long a new group waits for its rollouts' last calls

    # ------------------------------------------------------------ create

    async def create(self, spec: GroupCreate, idempotency_key: str | None, caller: Caller) -> tuple[GroupOut, bool]:
        """Create a group (or return the one this same request created before). Returns (group, created)."""
        caller.check_model(spec.model)
        self._validate(spec)
        group_id = spec.group_id or idempotency_key or f"g-{uuid.uuid4().hex}"
        if not GROUP_ID.fullmatch(group_id):
            raise invalid_request("Invalid group_id: 1 to 128 characters from letters, digits and `._:-`.", "group_id")
        digest = request_hash(spec)
        key = group_key(caller.grant.namespace, group_id)  # group ids are per owner, as rollout ids are
        existing = await self._row(key, ADMIN)
        if existing is not None:
            return self._replay(existing, digest), False

        trajectories = await self._check_rollouts(spec, caller)
        members = []
        for position, item in enumerate(spec.rollouts):
            rollout_id, choice = split_ref(item.rollout_id)
            members.append(
                NewMember(
                    position=position,
                    rollout_ref=item.rollout_id,
                    rollout_id=rollout_id,
                    choice=choice,
                    reward=item.reward if spec.ruler is None else None,
                    caller_reward=item.reward,
                    metrics=item.metrics,
                )
            )
        rewards = [r.reward for r in spec.rollouts if r.reward is not None]
        group = NewGroup(
            id=key,
            model=spec.model,
            owner=caller.grant.namespace,  # its members are the caller's rollouts
            state="scoring" if spec.ruler is not None else "ready",
            request_hash=digest,
            metadata=spec.metadata,
            ruler=public_ruler(spec.ruler) if spec.ruler is not None else None,
            no_signal=None if spec.ruler is not None else no_signal(rewards),
            members=members,
        )
        try:
            async with self.engine.begin() as conn:
                await insert_group(conn, group)
        except IntegrityError:
            # A concurrent request took the id or one of the rollouts first.
            existing = await self._row(key, ADMIN)
            if existing is not None:
                return self._replay(existing, digest), False
            raise OpenAIError(
                409, "A rollout of this group was just put in another group.", code="rollout_in_group"
            ) from None
        self.metrics.rollouts_grouped(spec.model, trajectories)
        if spec.ruler is not None:
            self.scorer.start(key, spec.ruler)
        return await self.get(group_id, caller), True

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
            if item.rollout_id.startswith(EVAL_ROLLOUT_PREFIX):
                raise invalid_request(
                    f"`{item.rollout_id}` is an eval rollout of the promotion gate: it is never trained on.",
                    param=f"rollouts[{i}].rollout_id",
                    code="eval_rollout",
                )
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
            _check_ruler(spec.ruler, self.scorer.policy)  # the scorer's: what is accepted is what is judged

    async def _check_rollouts(self, spec: GroupCreate, caller: Caller) -> list[Trajectory]:
        """The members' trajectories, once each is known, of the group's model, trainable and in no group: the
        caller's own rollouts (its namespace's ids; the admin's, without a key, are "")."""
        owner = caller.grant.namespace
        refs = [r.rollout_id for r in spec.rollouts]
        trajectories = []
        rollout_ids = sorted({split_ref(r)[0] for r in refs})
        await self.rollouts.settle([RolloutKey(owner, r) for r in rollout_ids], self.settle_seconds)
        busy = [r for r in rollout_ids if self.rollouts.recorder.in_flight(RolloutKey(owner, r))]
        if busy:
            raise OpenAIError(
                409,
                f"Rollout `{busy[0]}` has a call still in flight: create the group once its calls have returned.",
                code="rollout_in_flight",
            )
        for i, ref in enumerate(refs):
            rollout_id, choice = split_ref(ref)
            trajectory = await self.rollouts.reader.find(rollout_id, owner=owner, grant=caller.grant, choice=choice)
            if trajectory is None:  # never recorded by the caller, or of another key's model: unknown here
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
            trajectories.append(trajectory)
        async with self.engine.connect() as conn:
            taken = await taken_refs(conn, owner, rollout_ids)
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
        return trajectories

    def _replay(self, existing: GroupRow, digest: str) -> GroupOut:
        # The caller's own group (its key is in the caller's namespace): another owner's id is never taken here.
        if existing.request_hash != digest:
            raise OpenAIError(
                409,
                f"Group `{existing.name}` exists with other content: use a new group_id / Idempotency-Key.",
                param="group_id",
                code="group_id_conflict",
            )
        return group_out(existing)

    # ------------------------------------------------------------ read

    async def _row(self, key: str, caller: Caller) -> GroupRow | None:
        async with self.engine.connect() as conn:
            rows = await load_groups(conn, [key], grant=caller.grant)
        return rows[0] if rows else None

    async def get(self, group_id: str, caller: Caller, owner: str | None = None) -> GroupOut:
        """The caller's group `group_id` (`owner`: another owner's, for a caller that may read it; see
        store.access.Grant.owner_of); another owner's id is unknown, as rollout ids are."""
        reads = caller.grant.owner_of(owner)
        row = await self._row(group_key(reads, group_id), caller) if reads is not None else None
        if row is None:
            raise OpenAIError(404, f"No group `{group_id}`.", code="group_not_found")
        return group_out(row)

    async def page(
        self,
        *,
        model: str | None,
        state: str | None,
        limit: int,
        cursor: str | None,
        caller: Caller,
        newest_first: bool = False,
    ) -> GroupPage:
        """A page of groups, of the caller's models only, oldest first (`newest_first`: as the UI lists them)."""
        if state is not None and state not in GROUP_STATES:
            raise invalid_request(f"'state' must be one of {', '.join(GROUP_STATES)}.", param="state")
        check_limit(limit)
        after = decode_cursor_pair(cursor) if cursor else None
        async with self.engine.connect() as conn:
            keys = await list_group_ids(
                conn,
                model=model,
                state=state,  # one of GROUP_STATES: checked above
                limit=limit,
                after=after,
                grant=caller.grant,
                newest_first=newest_first,
            )
            rows = await load_groups(conn, [gid for _, gid in keys], grant=caller.grant)
        next_cursor = encode_cursor_pair(*keys[-1]) if len(keys) == limit else None
        return GroupPage([group_out(r) for r in rows], next_cursor)
