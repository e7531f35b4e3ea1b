"""Groups and their life cycle: one state machine, every transition in this module.

A group is several recorded attempts at one task with their rewards: the unit GRPO compares.

    scoring ──scored──▶ ready ──claim──▶ training ──mark_trained / finish_without_update──▶ trained
       │                  ▲                 │  │
       └──scoring_failed──┼──▶ failed ◀─drop┘  │ (a lease that runs out: claimable again)
                          └────release─────────┘
    trained ──retrain_lost──▶ ready (its step's checkpoint no longer loads: the trainer resumed before it)

`scoring`: RULER is judging it (the gateway's scorer); `ready`: every reward known; `training`: claimed
by a trainer under a lease; `trained`: a committed adapter step learned from it (or it had no signal);
`failed`: with the reason. Each transition is one guarded UPDATE (`WHERE state IN <allowed sources>`,
and the lease owner where a trainer holds it), so a group is trained at most once into a model's line of
adapters and never lost: when a trainer resumes past steps whose checkpoints no longer load, their update is in
no adapter it builds on, and their groups are trained again (`retrain_lost`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from store.access import Grant
from store.db import keyset_page
from store.errors import Conflict
from store.records import RolloutKey
from store.tables import group_members, groups
from store.types import GroupState

# Which states each state may be entered from: the whole life cycle in one table.
TRANSITIONS: dict[GroupState, tuple[GroupState, ...]] = {
    "scoring": (),  # only by creation
    "ready": ("scoring", "training", "trained"),  # scored; released by a step that failed; its step was lost
    "training": ("ready", "training"),  # claimed; re-claimed once the previous claim's lease ran out
    "trained": ("training",),
    "failed": ("scoring", "training"),  # the judge failed; the trainer dropped it (too stale)
}


class LeaseLost(Conflict):
    """The groups of a step are no longer claimed by the trainer that trained them."""

    code = "lease_lost"


def group_key(owner: str, group_id: str) -> str:
    """The store's id of `owner`'s group `group_id`. Group ids are a namespace per owner, as rollout ids are: two
    keys' `g1` are two groups, and neither can tell of the other's. A client's id never holds a `/`
    (store.types.GROUP_ID), so `<owner>/<id>` meets no other owner's; the owner "" (the admin's, --auth off's)
    keeps its ids as they are. Everything inside (the trainer's claims, the scorer) names a group by this key."""
    return f"{owner}/{group_id}" if owner else group_id


def group_name(owner: str, key: str) -> str:
    """The id `owner` gave the group stored under `key` (group_key's inverse): what its owner sees."""
    return key.removeprefix(f"{owner}/") if owner else key


class CheckOutcome(msgspec.Struct, frozen=True):
    """One rule check of a RULER group on one rollout: did it pass, and what failing it did to the reward."""

    check: str  # the grader's type: exact, regex, json_schema, tool_call, webhook
    passed: bool
    on_fail: Literal["zero", "subtract"]
    weight: float  # what a failed `subtract` check takes off
    error: str | None = None  # a check that could not run (a webhook down) counts as failed, and says why


class MemberRow(msgspec.Struct, frozen=True):
    position: int
    rollout_ref: str  # "rid" or "rid/<choice>"
    rollout_id: str
    choice: int | None
    reward: float | None  # what GRPO uses; None while scoring
    caller_reward: float | None
    ruler_score: float | None
    ruler_explanation: str | None
    metrics: dict[str, float] | None
    ruler_criteria: dict[str, float] | None = None  # criterion -> score (the judges' aggregate)
    ruler_spread: float | None = None  # how much the judgements disagree on it
    checks: list[CheckOutcome] | None = None  # the group's rule checks on it
    rollout_owner: str = ""  # whose rollout id `rollout_id` is (its group's owner)

    @property
    def rollout_key(self) -> RolloutKey:
        return RolloutKey(self.rollout_owner, self.rollout_id)


class MemberScore(msgspec.Struct, frozen=True):
    """What scoring gives one member: the reward GRPO uses (the judges' score after the checks) and how it came
    to be."""

    position: int
    reward: float
    ruler_score: float
    explanation: str
    criteria: dict[str, float] | None = None
    spread: float | None = None
    checks: list[CheckOutcome] | None = None


class GroupRow(msgspec.Struct, frozen=True):
    id: str
    model: str
    state: GroupState
    failure_reason: str | None
    request_hash: str
    metadata: dict[str, Any] | None
    ruler: dict[str, Any] | None  # judge model, rubric, non-secret litellm params
    judge_usage: dict[str, Any] | None
    no_signal: bool | None
    created_at: float
    updated_at: float
    lease_owner: str | None
    lease_expires_at: float | None
    trained_step: int | None
    judge_spread: float | None = None  # RULER panels: the judgements' mean disagreement over the group
    judge_agreement: float | None = None  # ... and their mean pairwise Spearman correlation
    members: list[MemberRow] = []
    owner: str = ""  # the owner whose rollouts it groups (the key that made it; "" for none)

    @property
    def name(self) -> str:
        """Its id as its owner gave it (`id` is the store's key: group_key)."""
        return group_name(self.owner, self.id)


class NewMember(msgspec.Struct, frozen=True):
    position: int
    rollout_ref: str
    rollout_id: str
    choice: int | None
    reward: float | None
    caller_reward: float | None
    metrics: dict[str, float] | None


class NewGroup(msgspec.Struct, frozen=True):
    id: str  # the store's key: group_key(owner, the id the caller gave it)
    model: str
    state: GroupState  # `scoring` (RULER will judge it) or `ready` (caller rewards)
    request_hash: str  # same id + other content = a conflict
    metadata: dict[str, Any] | None
    ruler: dict[str, Any] | None
    no_signal: bool | None
    members: list[NewMember]
    owner: str  # whose rollouts its members are (store.access.Grant.namespace of the key that makes it)


def _plain(row: sa.Row[Any]) -> dict[str, Any]:
    return {str(k): v for k, v in row._asdict().items()}


# ---------------------------------------------------------------- creating and reading


async def insert_group(conn: AsyncConnection, group: NewGroup) -> None:
    """Create a group; IntegrityError if its id or one of its rollout refs is taken."""
    assert group.state in ("scoring", "ready"), "a group is born scoring or ready"
    now = time.time()
    row = msgspec.to_builtins(group)
    members = row.pop("members")
    await conn.execute(sa.insert(groups), [{**row, "created_at": now, "updated_at": now}])
    await conn.execute(
        sa.insert(group_members), [{**m, "group_id": group.id, "rollout_owner": group.owner} for m in members]
    )


async def load_groups(conn: AsyncConnection, group_ids: Sequence[str], *, grant: Grant) -> list[GroupRow]:
    """Groups of the models and owner `grant` covers with their members, in the order of `group_ids` (unknown
    ids, and groups of other models or owners, are left out)."""
    if not group_ids:
        return []
    query = sa.select(groups).where(
        groups.c.id.in_(group_ids), grant.where(groups.c.model), grant.where_owner(groups.c.owner)
    )
    rows = {r.id: _plain(r) for r in await conn.execute(query)}
    members: dict[str, list[MemberRow]] = {gid: [] for gid in rows}
    query = (
        sa.select(group_members)
        .where(group_members.c.group_id.in_(list(rows)))
        .order_by(group_members.c.group_id, group_members.c.position)
    )
    for m in await conn.execute(query):
        data = _plain(m)
        members[data.pop("group_id")].append(msgspec.convert(data, MemberRow))
    return [msgspec.convert({**rows[g], "members": members[g]}, GroupRow) for g in group_ids if g in rows]


class Membership(msgspec.Struct, frozen=True):
    """A rollout (or one choice of it) in a group: what it was rewarded and how (an export's `groups`)."""

    group_id: str
    rollout_ref: str
    reward: float | None
    caller_reward: float | None
    ruler_score: float | None
    ruler_criteria: dict[str, float] | None
    ruler_spread: float | None
    checks: list[CheckOutcome] | None


async def memberships(conn: AsyncConnection, rollouts: Sequence[RolloutKey]) -> dict[RolloutKey, list[Membership]]:
    """rollout -> the groups it (or a choice of it) is in, with the members' rewards."""
    if not rollouts:
        return {}
    key = (group_members.c.rollout_owner, group_members.c.rollout_id)
    columns = [*key, *(group_members.c[name] for name in Membership.__struct_fields__)]
    query = sa.select(*columns).where(sa.tuple_(*key).in_(sorted(set(rollouts)))).order_by(group_members.c.rollout_ref)
    found: dict[RolloutKey, list[Membership]] = {}
    for row in await conn.execute(query):
        data = _plain(row)
        rollout = RolloutKey(data.pop("rollout_owner"), data.pop("rollout_id"))
        data["group_id"] = group_name(rollout.owner, data["group_id"])  # a group's owner is its members'
        found.setdefault(rollout, []).append(msgspec.convert(data, Membership))
    return found


async def taken_refs(conn: AsyncConnection, owner: str, rollout_ids: Sequence[str]) -> dict[str, str]:
    """rollout_ref -> group id (as `owner` named it), for every member of any group that uses one of these
    rollouts of `owner`'s."""
    query = sa.select(group_members.c.rollout_ref, group_members.c.group_id).where(
        group_members.c.rollout_owner == owner, group_members.c.rollout_id.in_(rollout_ids)
    )
    return {ref: group_name(owner, key) for ref, key in await conn.execute(query)}


async def list_group_ids(
    conn: AsyncConnection,
    *,
    model: str | None,
    state: GroupState | None,
    limit: int,
    after: tuple[float, str] | None,
    grant: Grant,
    newest_first: bool = False,
) -> list[tuple[float, str]]:
    """(created_at, id) of a page of groups of the models `grant` covers, oldest first (`newest_first`: the
    other way); `after`: the last key of the previous page."""
    key = (groups.c.created_at, groups.c.id)
    query = keyset_page(sa.select(*key), key, after, limit, newest_first).where(
        grant.where(groups.c.model), grant.where_owner(groups.c.owner)
    )
    if model is not None:
        query = query.where(groups.c.model == model)
    if state is not None:
        query = query.where(groups.c.state == state)
    return [(row.created_at, row.id) for row in await conn.execute(query)]


async def scoring_group_ids(conn: AsyncConnection) -> list[str]:
    return list((await conn.execute(sa.select(groups.c.id).where(groups.c.state == "scoring"))).scalars())


async def count_by_state(conn: AsyncConnection) -> dict[tuple[str, GroupState], int]:
    query = sa.select(groups.c.model, groups.c.state, sa.func.count()).group_by(groups.c.model, groups.c.state)
    return {(model, state): n for model, state, n in await conn.execute(query)}


# ---------------------------------------------------------------- transitions


async def _move(
    conn: AsyncConnection,
    group_ids: Sequence[str],
    to: GroupState,
    *,
    source: Sequence[GroupState] | None = None,
    owner: str | None = None,
    where: sa.ColumnElement[bool] | None = None,
    **values: Any,
) -> list[str]:
    """The one guarded UPDATE behind every transition; returns the ids that moved.

    `source` narrows the states allowed by TRANSITIONS; `owner` requires the trainer's lease.
    """
    allowed = [s for s in TRANSITIONS[to] if source is None or s in source]
    assert allowed, f"no transition to {to} from {source}"
    if not group_ids:
        return []
    condition = sa.and_(groups.c.id.in_(group_ids), groups.c.state.in_(allowed))
    if owner is not None:
        condition = sa.and_(condition, groups.c.lease_owner == owner)
    if where is not None:
        condition = sa.and_(condition, where)
    result = await conn.execute(
        sa.update(groups).where(condition).values(state=to, updated_at=time.time(), **values).returning(groups.c.id)
    )
    return list(result.scalars())


async def scored(
    conn: AsyncConnection,
    group_id: str,
    scores: Sequence[MemberScore],
    judge_usage: dict[str, Any],
    no_signal: bool,
    *,
    judge_spread: float | None = None,
    judge_agreement: float | None = None,
    dropped: str | None = None,
) -> None:
    """scoring → ready: RULER's scores become the rewards (→ failed, scores kept, when `dropped` says why the
    group must not be trained: its judges disagree too much)."""
    for score in scores:
        await conn.execute(
            sa.update(group_members)
            .where(group_members.c.group_id == group_id, group_members.c.position == score.position)
            .values(
                reward=score.reward,
                ruler_score=score.ruler_score,
                ruler_explanation=score.explanation,
                ruler_criteria=score.criteria,
                ruler_spread=score.spread,
                checks=msgspec.to_builtins(score.checks) if score.checks is not None else None,
            )
        )
    await _move(
        conn,
        [group_id],
        "ready" if dropped is None else "failed",
        source=("scoring",),
        judge_usage=judge_usage,
        no_signal=no_signal,
        judge_spread=judge_spread,
        judge_agreement=judge_agreement,
        failure_reason=dropped,
    )


async def scoring_failed(conn: AsyncConnection, group_id: str, reason: str, judge_usage: dict[str, Any] | None) -> None:
    """scoring → failed, with the reason."""
    await _move(conn, [group_id], "failed", source=("scoring",), failure_reason=reason, judge_usage=judge_usage)


def _claimable(now: float) -> sa.ColumnElement[bool]:
    # Ready, or claimed by a trainer whose lease ran out (it died): claimable again.
    return sa.or_(groups.c.state == "ready", sa.and_(groups.c.state == "training", groups.c.lease_expires_at < now))


async def claim_groups(
    conn: AsyncConnection, *, model: str, owner: str, lease_seconds: float, limit: int, now: float
) -> list[str]:
    """ready (or training with an expired lease at `now`, epoch seconds) → training: claim up to `limit` groups,
    oldest first, leased until `now + lease_seconds`.

    On PostgreSQL the candidates are locked with `FOR UPDATE SKIP LOCKED`, so concurrent trainers
    never wait on or double-claim a group; on SQLite the single writer serializes claims, and the
    guarded UPDATE ... RETURNING reports only what this claim really took.
    """
    candidates = (
        sa.select(groups.c.id)
        .where(groups.c.model == model, _claimable(now))
        .order_by(groups.c.created_at, groups.c.id)
        .limit(limit)
    )
    if conn.dialect.name == "postgresql":
        candidates = candidates.with_for_update(skip_locked=True)
    ids = list((await conn.execute(candidates)).scalars())
    taken = set(
        await _move(
            conn, ids, "training", where=_claimable(now), lease_owner=owner, lease_expires_at=now + lease_seconds
        )
    )
    return [gid for gid in ids if gid in taken]


async def renew_lease(
    conn: AsyncConnection, group_ids: Sequence[str], owner: str, lease_seconds: float, *, now: float
) -> int:
    """Keep a claim alive until `now + lease_seconds` (no state change); how many groups it still holds."""
    result = await conn.execute(
        sa.update(groups)
        .where(groups.c.id.in_(group_ids), groups.c.state == "training", groups.c.lease_owner == owner)
        .values(lease_expires_at=now + lease_seconds)
    )
    return result.rowcount


_NO_LEASE = {"lease_owner": None, "lease_expires_at": None}


async def release_groups(conn: AsyncConnection, group_ids: Sequence[str], owner: str) -> None:
    """training → ready: a failed step gives its groups back for the next claim."""
    await _move(conn, group_ids, "ready", source=("training",), owner=owner, **_NO_LEASE)


async def release_earlier_attempts(conn: AsyncConnection, models: Sequence[str], prefix: str, owner: str) -> list[str]:
    """training → ready for the groups of `models` whose lease owner starts with `prefix` but is not `owner`:
    what an earlier attempt of the same launch claimed before it died (its lease would hold them until it ends).
    Returns their ids."""
    result = await conn.execute(
        sa.update(groups)
        .where(
            groups.c.model.in_(models),
            groups.c.state == "training",
            groups.c.lease_owner.startswith(prefix, autoescape=True),
            groups.c.lease_owner != owner,
        )
        .values(state="ready", updated_at=time.time(), **_NO_LEASE)
        .returning(groups.c.id)
    )
    return list(result.scalars())


async def retrain_lost(conn: AsyncConnection, model: str, kept: int) -> list[str]:
    """trained → ready for `model`'s groups trained by a step after `kept` (0: the base weights): a trainer resumes
    from step `kept` because the newer ones' checkpoints no longer load, so their update is lost with them and their
    groups are trained again. Returns their ids."""
    lost = sa.select(groups.c.id).where(
        groups.c.model == model, groups.c.state == "trained", groups.c.trained_step > kept
    )
    ids = list((await conn.execute(lost)).scalars())
    return await _move(conn, ids, "ready", source=("trained",), trained_step=None, **_NO_LEASE)


async def drop_groups(conn: AsyncConnection, group_ids: Sequence[str], owner: str, reason: str) -> None:
    """training → failed: claimed groups the trainer will not train (too stale), with the reason."""
    await _move(conn, group_ids, "failed", source=("training",), owner=owner, failure_reason=reason, **_NO_LEASE)


async def finish_without_update(conn: AsyncConnection, group_ids: Sequence[str], owner: str, step: int) -> int:
    """training → trained without a new adapter: no learning signal (every advantage 0)."""
    return len(await _move(conn, group_ids, "trained", owner=owner, trained_step=step, **_NO_LEASE))


async def mark_trained(conn: AsyncConnection, group_ids: Sequence[str], owner: str, step: int) -> None:
    """training → trained by the step that serves now; LeaseLost unless every group is still ours.

    Called only inside the adapter commit (store/adapters.py::commit_step), in its transaction.
    """
    moved = await _move(conn, group_ids, "trained", owner=owner, trained_step=step, **_NO_LEASE)
    if len(moved) != len(group_ids):
        raise LeaseLost(f"{len(group_ids) - len(moved)} of {len(group_ids)} groups are no longer claimed")
