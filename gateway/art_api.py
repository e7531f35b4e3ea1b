"""`/v1/art/...`: ART's own endpoints. Thin handlers: parse, call a service, return."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.datastructures import State
from litestar.params import Parameter

from gateway.adapters import AdapterLoad, ModelStatus
from gateway.errors import OpenAIError, decode_body
from gateway.groups import GroupOut, GroupPage, parse_group_create
from gateway.rollouts import RolloutPage
from store.trajectories import Trajectory


def _state(request: Request[Any, Any, State]) -> Any:
    return request.app.state.gateway


@get("/v1/art/rollouts/{rollout_id:str}")
async def get_rollout(request: Request[Any, Any, State], rollout_id: str) -> Trajectory:
    return await _state(request).rollouts.get(rollout_id)


@get("/v1/art/rollouts/{rollout_id:str}/{choice:int}")
async def get_rollout_choice(request: Request[Any, Any, State], rollout_id: str, choice: int) -> Trajectory:
    """The rollout `"<rollout_id>/<choice>"`: one choice of its n > 1 call."""
    return await _state(request).rollouts.get(rollout_id, choice=choice)


@get("/v1/art/rollouts")
async def list_rollouts(
    request: Request[Any, Any, State],
    model: str | None = None,
    since: float | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> RolloutPage:
    return await _state(request).rollouts.page(model=model, since=since, limit=limit, cursor=cursor)


@post("/v1/art/groups")
async def create_group(request: Request[Any, Any, State]) -> Response[GroupOut]:
    spec = parse_group_create(await request.body())
    group, created = await _state(request).groups.create(spec, request.headers.get("Idempotency-Key"))
    return Response(group, status_code=201 if created else 200)


@get("/v1/art/groups/{group_id:str}")
async def get_group(request: Request[Any, Any, State], group_id: str) -> GroupOut:
    return await _state(request).groups.get(group_id)


@get("/v1/art/groups")
async def list_groups(
    request: Request[Any, Any, State],
    model: str | None = None,
    group_state: str | None = Parameter(query="state", default=None),  # `state` is Litestar's own kwarg
    limit: int = 100,
    cursor: str | None = None,
) -> GroupPage:
    return await _state(request).groups.page(model=model, state=group_state, limit=limit, cursor=cursor)


def require_admin(request: Request[Any, Any, State]) -> None:
    """Admin endpoints: the bearer admin key; with none configured, only clients on this machine."""
    key = _state(request).settings.admin_key
    if key is None:
        host = request.client.host if request.client else ""
        if host not in ("127.0.0.1", "::1", "localhost"):
            raise OpenAIError(403, "Admin endpoints need --admin-key when called from another host.")
        return
    if request.headers.get("Authorization") != f"Bearer {key}":
        raise OpenAIError(401, "Admin endpoints need `Authorization: Bearer <admin key>`.", code="invalid_admin_key")


@post("/v1/art/models/{name:str}/adapters", status_code=200)
async def load_adapter(request: Request[Any, Any, State], name: str) -> ModelStatus:
    """A trainer's new step: load it beside the old one, point `name` at it, mark its groups trained."""
    require_admin(request)
    spec = decode_body(await request.body(), AdapterLoad)
    return await _state(request).adapters.load(name, spec)


@get("/v1/art/models/{name:str}")
async def model_status(request: Request[Any, Any, State], name: str) -> ModelStatus:
    return await _state(request).adapters.status(name)


routes = [
    get_rollout,
    get_rollout_choice,
    list_rollouts,
    create_group,
    get_group,
    list_groups,
    load_adapter,
    model_status,
]
