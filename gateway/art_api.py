"""`/v1/art/...`: ART's own endpoints. Thin handlers: parse, call an injected service, return."""

from __future__ import annotations

from litestar import Request, Response, get, post
from litestar.openapi import ResponseSpec
from litestar.params import Parameter

from gateway.adapters import AdapterLoad, AdapterService, ModelStatus
from gateway.errors import decode_body
from gateway.groups.schemas import GroupCreate, GroupOut, GroupPage
from gateway.groups.service import GroupService
from gateway.guards import admin_only
from gateway.openapi import IDEMPOTENCY_KEY_PARAMETER, documented, errors, struct_schema
from gateway.rollouts import RolloutService
from store.rollouts import MAX_PAGE, RolloutPage
from store.trajectories import Trajectory
from store.types import GROUP_STATES

# The bodies are read raw and decoded with OpenAI-shaped 400s (decode_body): gateway/openapi.py describes them.
# Query bounds the store checks (its 400 names the param), documented here only: Litestar parses as before.
PAGE_LIMIT = Parameter(default=100, schema_extra={"minimum": 1, "maximum": MAX_PAGE})
GROUP_EXAMPLE = {"model": "my-agent", "rollouts": [{"rollout_id": "task-42-a", "reward": 1.0}]}


@get("/v1/art/rollouts/{rollout_id:str}", responses=errors(400, 404, 500, 503))
async def get_rollout(rollouts: RolloutService, rollout_id: str) -> Trajectory:
    return await rollouts.get(rollout_id)


@get("/v1/art/rollouts/{rollout_id:str}/{choice:int}", responses=errors(400, 404, 500, 503))
async def get_rollout_choice(rollouts: RolloutService, rollout_id: str, choice: int) -> Trajectory:
    """The rollout `"<rollout_id>/<choice>"`: one choice of its n > 1 call."""
    return await rollouts.get(rollout_id, choice=choice)


@get("/v1/art/rollouts", responses=errors(400, 500, 503))
async def list_rollouts(
    rollouts: RolloutService,
    model: str | None = None,
    since: float | None = None,
    limit: int = PAGE_LIMIT,
    cursor: str | None = None,
) -> RolloutPage:
    return await rollouts.page(model=model, since=since, limit=limit, cursor=cursor)


@post(
    "/v1/art/groups",
    operation_class=documented(
        body=struct_schema(GroupCreate), example=GROUP_EXAMPLE, headers=(IDEMPOTENCY_KEY_PARAMETER,)
    ),
    responses={
        200: ResponseSpec(GroupOut, description="The same request again (group_id or Idempotency-Key): that group"),
        **errors(400, 404, 408, 409, 413, 500, 503),
    },
)
async def create_group(request: Request, groups: GroupService) -> Response[GroupOut]:
    spec = decode_body(await request.body(), GroupCreate)
    group, created = await groups.create(spec, request.headers.get("Idempotency-Key"))
    return Response(group, status_code=201 if created else 200)


@get("/v1/art/groups/{group_id:str}", responses=errors(400, 404, 500, 503))
async def get_group(groups: GroupService, group_id: str) -> GroupOut:
    return await groups.get(group_id)


@get("/v1/art/groups", responses=errors(400, 500, 503))
async def list_groups(
    groups: GroupService,
    model: str | None = None,
    # `state` is Litestar's own kwarg. `schema_extra` only documents: the service checks and words the 400.
    group_state: str | None = Parameter(query="state", default=None, schema_extra={"enum": list(GROUP_STATES)}),
    limit: int = PAGE_LIMIT,
    cursor: str | None = None,
) -> GroupPage:
    return await groups.page(model=model, state=group_state, limit=limit, cursor=cursor)


@post(
    "/v1/art/models/{name:str}/adapters",
    status_code=200,
    guards=[admin_only],
    operation_class=documented(body=struct_schema(AdapterLoad)),
    responses=errors(400, 401, 403, 404, 408, 409, 413, 500, 502, 503),
)
async def load_adapter(request: Request, adapters: AdapterService, name: str) -> ModelStatus:
    """A trainer's new step: load it beside the old one, point `name` at it, mark its groups trained."""
    return await adapters.load(name, decode_body(await request.body(), AdapterLoad))


@get("/v1/art/models/{name:str}", responses=errors(400, 404, 500, 503))
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
