"""`/v1/art/...`: ART's own endpoints (rollouts now; groups, adapters and training later)."""

from __future__ import annotations

from typing import Any

from litestar import Request, get
from litestar.datastructures import State

from gateway.rollouts import RolloutPage
from gateway.trajectories import Trajectory


def _state(request: Request[Any, Any, State]) -> Any:
    return request.app.state.gateway


@get("/v1/art/rollouts/{rollout_id:str}")
async def get_rollout(request: Request[Any, Any, State], rollout_id: str) -> Trajectory:
    return await _state(request).rollouts.get(rollout_id)


@get("/v1/art/rollouts")
async def list_rollouts(
    request: Request[Any, Any, State],
    model: str | None = None,
    since: float | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> RolloutPage:
    return await _state(request).rollouts.page(model=model, since=since, limit=limit, cursor=cursor)


routes = [get_rollout, list_rollouts]
