"""`/v1/art/...`: ART's own endpoints. Thin handlers: parse, call an injected service, return."""

from __future__ import annotations

from litestar import Request, Response, get, post
from litestar.params import Parameter

from gateway.adapters import AdapterLoad, AdapterService, ModelStatus
from gateway.errors import decode_body
from gateway.groups.schemas import GroupCreate, GroupOut, GroupPage
from gateway.groups.service import GroupService
from gateway.guards import admin_only
from gateway.rollouts import RolloutService
from store.rollouts import RolloutPage
from store.trajectories import Trajectory


@get("/v1/art/rollouts/{rollout_id:str}")
async def get_rollout(rollouts: RolloutService, rollout_id: str) -> Trajectory:
    return await rollouts.get(rollout_id)


@get("/v1/art/rollouts/{rollout_id:str}/{choice:int}")
async def get_rollout_choice(rollouts: RolloutService, rollout_id: str, choice: int) -> Trajectory:
    """The rollout `"<rollout_id>/<choice>"`: one choice of its n > 1 call."""
    return await rollouts.get(rollout_id, choice=choice)


@get("/v1/art/rollouts")
async def list_rollouts(
    rollouts: RolloutService,
    model: str | None = None,
    since: float | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> RolloutPage:
    return await rollouts.page(model=model, since=since, limit=limit, cursor=cursor)


@post("/v1/art/groups")
async def create_group(request: Request, groups: GroupService) -> Response[GroupOut]:
    spec = decode_body(await request.body(), GroupCreate)
    group, created = await groups.create(spec, request.headers.get("Idempotency-Key"))
    return Response(group, status_code=201 if created else 200)


@get("/v1/art/groups/{group_id:str}")
async def get_group(groups: GroupService, group_id: str) -> GroupOut:
    return await groups.get(group_id)


@get("/v1/art/groups")
async def list_groups(
    groups: GroupService,
    model: str | None = None,
    group_state: str | None = Parameter(query="state", default=None),  # `state` is Litestar's own kwarg
    limit: int = 100,
    cursor: str | None = None,
) -> GroupPage:
    return await groups.page(model=model, state=group_state, limit=limit, cursor=cursor)


@post("/v1/art/models/{name:str}/adapters", status_code=200, guards=[admin_only])
async def load_adapter(request: Request, adapters: AdapterService, name: str) -> ModelStatus:
    """A trainer's new step: load it beside the old one, point `name` at it, mark its groups trained."""
    return await adapters.load(name, decode_body(await request.body(), AdapterLoad))


@get("/v1/art/models/{name:str}")
async def model_status(adapters: AdapterService, name: str) -> ModelStatus:
    return await adapters.status(name)


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
