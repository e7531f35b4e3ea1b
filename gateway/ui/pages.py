"""Each page's context, from the services the API uses, with the caller: a key sees only its models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from gateway.adapters import AdapterRegistry, AdapterService
from gateway.auth import Caller
from gateway.errors import invalid_request
from gateway.groups.service import GroupService, split_ref
from gateway.rollouts import RolloutService
from gateway.ui.tokens import decoder_for
from gateway.ui.views import advantages, parse_since, step_charts, token_view
from store.api import GroupOut
from store.calls import RolloutFilter
from store.groups import CheckOutcome
from store.records import APIS, CALL_STATUSES
from store.trajectories import Trajectory
from store.types import GROUP_STATES

PAGE_SIZE = 25
MODEL_GROUPS = 25  # a model's page shows its newest groups; /ui/groups lists them all
VIEWS = ("conversation", "tokens")


def _query(values: dict[str, str | None], more: dict[str, str]) -> str:
    """A list's filters (and `more`) as a query string for its pagination links: the empty ones and the
    default page size left out."""
    pairs = {**values, **more}.items()
    return urlencode({k: v for k, v in pairs if v and not (k == "limit" and v == str(PAGE_SIZE))})


@dataclass(frozen=True, slots=True)
class RolloutForm:
    """The list's form as typed (its pagination links repeat it); `selection()` is what it selects."""

    model: str | None = None
    since: str | None = None
    key_id: str | None = None
    limit: int = PAGE_SIZE
    status: str | None = None  # a call of the rollout ended so
    api: str | None = None  # a call of the rollout was of this API
    group_id: str | None = None

    def query(self, **more: str) -> str:
        """The filters (and `more`) as a query string, for the pagination links."""
        values = {
            "model": self.model,
            "since": self.since,
            "key_id": self.key_id,
            "status": self.status,
            "api": self.api,
            "group_id": self.group_id,
            "limit": str(self.limit),
        }
        return _query(values, more)

    def selection(self) -> RolloutFilter:
        """The store's filter: `since` parsed, `status` and `api` checked (400 for a value out of their lists)."""
        try:
            since = parse_since(self.since)
        except ValueError:
            raise invalid_request("`since`: a date-time such as 2026-11-23T21:00 (UTC).", param="since") from None
        return RolloutFilter(
            model=self.model,
            since=since,
            key_id=self.key_id,
            status=self.status,  # type: ignore[arg-type]  # checked by RolloutFilter
            api=self.api,  # type: ignore[arg-type]
            group_id=self.group_id,
        )


async def rollout_list(
    rollouts: RolloutService, adapters: AdapterService, caller: Caller, filters: RolloutForm, cursor: str | None
) -> dict[str, Any]:
    page = await rollouts.page(
        filters.selection(), limit=filters.limit, cursor=cursor, caller=caller, newest_first=True
    )
    return {
        "page": page,
        "sequences": await rollouts.sequence_counts(page.data, caller=caller),
        "filters": filters,
        "models": adapters.list_models(caller),
        "statuses": CALL_STATUSES,
        "apis": APIS,
        "cursor": cursor,
    }


async def rollout_detail(
    rollouts: RolloutService, registry: AdapterRegistry, caller: Caller, rollout_id: str, view: str, owner: str | None
) -> dict[str, Any]:
    if view not in VIEWS:
        raise invalid_request(f"`view`: one of {', '.join(VIEWS)}.", param="view")
    trajectory = await rollouts.get(rollout_id, caller=caller, owner=owner)
    decoder = await decoder_for(registry.base_model_path)
    return {"t": trajectory, "view": view, "sequences": token_view(trajectory, decoder.pieces)}


async def models_overview(adapters: AdapterService, caller: Caller) -> dict[str, Any]:
    return {"models": [await adapters.status(name, caller) for name in adapters.list_models(caller)]}


async def model_detail(adapters: AdapterService, groups: GroupService, caller: Caller, name: str) -> dict[str, Any]:
    status = await adapters.status(name, caller)
    reward_chart, loss_chart = step_charts(status.steps)
    newest = await groups.page(
        model=name, state=None, limit=MODEL_GROUPS, cursor=None, caller=caller, newest_first=True
    )
    return {
        "m": status,
        "reward_chart": reward_chart,
        "loss_chart": loss_chart,
        "groups": newest.data,
        "group_count": sum(status.groups.values()),
    }


@dataclass(frozen=True, slots=True)
class GroupForm:
    """The group list's form as typed; its pagination links repeat it."""

    model: str | None = None
    state: str | None = None  # checked by GroupService.page
    limit: int = PAGE_SIZE

    def query(self, **more: str) -> str:
        return _query({"model": self.model, "state": self.state, "limit": str(self.limit)}, more)


async def group_list(
    groups: GroupService, adapters: AdapterService, caller: Caller, filters: GroupForm, cursor: str | None
) -> dict[str, Any]:
    """Groups of every model the caller may read, newest first."""
    page = await groups.page(
        model=filters.model,
        state=filters.state,
        limit=filters.limit,
        cursor=cursor,
        caller=caller,
        newest_first=True,
    )
    return {
        "page": page,
        "filters": filters,
        "models": adapters.list_models(caller),
        "states": GROUP_STATES,
        "cursor": cursor,
    }


@dataclass(frozen=True, slots=True)
class Attempt:
    ref: str  # the rollout id, or "<rollout id>/<choice>"
    rollout_id: str
    reward: float | None
    caller_reward: float | None
    ruler_score: float | None
    ruler_explanation: str | None
    advantage: float | None
    trajectory: Trajectory | None  # None: not (yet) in the store
    ruler_criteria: dict[str, float] | None = None
    ruler_spread: float | None = None
    checks: list[CheckOutcome] | None = None

    @property
    def reply(self) -> dict[str, Any] | None:
        """The attempt's last message (its final answer), if recorded."""
        return self.trajectory.messages[-1] if self.trajectory and self.trajectory.messages else None


async def group_detail(
    groups: GroupService, rollouts: RolloutService, caller: Caller, group_id: str, owner: str | None = None
) -> dict[str, Any]:
    group: GroupOut = await groups.get(group_id, caller, owner)
    scores = advantages([member.reward for member in group.rollouts])
    attempts = []
    for member, advantage in zip(group.rollouts, scores, strict=True):
        rollout_id, choice = split_ref(member.rollout_id)
        attempts.append(
            Attempt(
                member.rollout_id,
                rollout_id,
                member.reward,
                member.caller_reward,
                member.ruler_score,
                member.ruler_explanation,
                advantage,
                await rollouts.find(rollout_id, choice=choice, caller=caller, owner=group.owner),
                member.ruler_criteria,
                member.ruler_spread,
                member.checks,
            )
        )
    return {"g": group, "attempts": attempts}
