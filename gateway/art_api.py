"""`/v1/art/...`: ART's own endpoints. Thin handlers: parse, call an injected service, return."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.openapi import ResponseSpec
from litestar.params import Parameter

from gateway.adapters import AdapterLoad, AdapterService, ModelStatus
from gateway.auth import Caller
from gateway.errors import decode_body
from gateway.groups.schemas import GroupCreate, GroupOut, GroupPage
from gateway.groups.service import GroupService
from gateway.guards import admin_only, scoped
from gateway.keys import KeyCreate, KeyCreated, KeyList, KeyService
from gateway.openapi import IDEMPOTENCY_KEY_PARAMETER, documented, errors, struct_schema
from gateway.rollouts import RolloutService
from store.keys import ApiKey
from store.rollouts import MAX_PAGE, RolloutPage
from store.trajectories import Trajectory
from store.types import GROUP_STATES

# The bodies are read raw and decoded with OpenAI-shaped 400s (decode_body): gateway/openapi.py describes them.
# Query bounds the store checks (its 400 names the param), documented here only: Litestar parses as before.
PAGE_LIMIT = Parameter(default=100, schema_extra={"minimum": 1, "maximum": MAX_PAGE})
GROUP_EXAMPLE = {"model": "my-agent", "rollouts": [{"rollout_id": "task-42-a", "reward": 1.0}]}
KEY_EXAMPLE = {"name": "support-bot", "models": ["my-agent"], "scopes": ["infer", "reward"], "rpm": 600}
# What each route needs: a client key with a scope (the admin key has them all), or the admin key.
READ = {"guards": [scoped], "opt": {"scope": "read"}}
REWARD = {"guards": [scoped], "opt": {"scope": "reward"}}
ADMIN = {"guards": [admin_only]}


class ModelCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/art/models`: a new trainable model on the same base."""

    name: str


class ModelList(msgspec.Struct, frozen=True):
    data: list[str]
    object: str = "list"


@get("/v1/art/rollouts/{rollout_id:str}", responses=errors(400, 401, 403, 404, 500, 503), **READ)
async def get_rollout(rollouts: RolloutService, caller: Caller, rollout_id: str) -> Trajectory:
    return await rollouts.get(rollout_id, caller=caller)


@get("/v1/art/rollouts/{rollout_id:str}/{choice:int}", responses=errors(400, 401, 403, 404, 500, 503), **READ)
async def get_rollout_choice(rollouts: RolloutService, caller: Caller, rollout_id: str, choice: int) -> Trajectory:
    """The rollout `"<rollout_id>/<choice>"`: one choice of its n > 1 call."""
    return await rollouts.get(rollout_id, choice=choice, caller=caller)


@get("/v1/art/rollouts", responses=errors(400, 401, 403, 500, 503), **READ)
async def list_rollouts(
    rollouts: RolloutService,
    caller: Caller,
    model: str | None = None,
    since: float | None = None,
    limit: int = PAGE_LIMIT,
    cursor: str | None = None,
    key_id: str | None = None,
) -> RolloutPage:
    """Rollouts of the key's models, oldest first; `key_id`: only those made with that API key."""
    return await rollouts.page(model=model, since=since, limit=limit, cursor=cursor, key_id=key_id, caller=caller)


@post(
    "/v1/art/groups",
    operation_class=documented(
        body=struct_schema(GroupCreate), example=GROUP_EXAMPLE, headers=(IDEMPOTENCY_KEY_PARAMETER,)
    ),
    responses={
        200: ResponseSpec(GroupOut, description="The same request again (group_id or Idempotency-Key): that group"),
        **errors(400, 401, 403, 404, 408, 409, 413, 500, 503),
    },
    **REWARD,
)
async def create_group(request: Request, groups: GroupService, caller: Caller) -> Response[GroupOut]:
    spec = decode_body(await request.body(), GroupCreate)
    group, created = await groups.create(spec, request.headers.get("Idempotency-Key"), caller)
    return Response(group, status_code=201 if created else 200)


@get("/v1/art/groups/{group_id:str}", responses=errors(400, 401, 403, 404, 500, 503), **READ)
async def get_group(groups: GroupService, caller: Caller, group_id: str) -> GroupOut:
    return await groups.get(group_id, caller)


@get("/v1/art/groups", responses=errors(400, 401, 403, 500, 503), **READ)
async def list_groups(
    groups: GroupService,
    caller: Caller,
    model: str | None = None,
    # `state` is Litestar's own kwarg. `schema_extra` only documents: the service checks and words the 400.
    group_state: str | None = Parameter(query="state", default=None, schema_extra={"enum": list(GROUP_STATES)}),
    limit: int = PAGE_LIMIT,
    cursor: str | None = None,
) -> GroupPage:
    return await groups.page(model=model, state=group_state, limit=limit, cursor=cursor, caller=caller)


@post(
    "/v1/art/models/{name:str}/adapters",
    status_code=200,
    operation_class=documented(body=struct_schema(AdapterLoad)),
    responses=errors(400, 401, 403, 404, 408, 409, 413, 500, 502, 503),
    **ADMIN,
)
async def load_adapter(request: Request, adapters: AdapterService, name: str) -> ModelStatus:
    """A trainer's new step: load it beside the old one, point `name` at it, mark its groups trained."""
    return await adapters.load(name, decode_body(await request.body(), AdapterLoad))


@get("/v1/art/models/{name:str}", responses=errors(400, 401, 403, 404, 500, 503), **READ)
async def model_status(adapters: AdapterService, caller: Caller, name: str) -> ModelStatus:
    return await adapters.status(name, caller)


@get("/v1/art/models", responses=errors(400, 401, 403), **READ)
async def list_models(adapters: AdapterService, caller: Caller) -> ModelList:
    """The trainable models the key covers."""
    return ModelList(adapters.list_models(caller))


@post(
    "/v1/art/models",
    operation_class=documented(body=struct_schema(ModelCreate), example={"name": "support-agent"}),
    responses={
        200: ResponseSpec(ModelStatus, description="The model was already served: its status"),
        **errors(400, 401, 403, 408, 413, 500, 503),
    },
    **ADMIN,
)
async def add_model(request: Request, adapters: AdapterService) -> Response[ModelStatus]:
    """Serve (and train) one more model on the same base; a retired one comes back with its history."""
    status, created = await adapters.add_model(decode_body(await request.body(), ModelCreate).name)
    return Response(status, status_code=201 if created else 200)


@delete("/v1/art/models/{name:str}", status_code=200, responses=errors(400, 401, 403, 404, 500, 503), **ADMIN)
async def retire_model(adapters: AdapterService, name: str) -> ModelStatus:
    """Stop serving and training the model; its adapters leave the engine, its data stays."""
    return await adapters.retire_model(name)


@post(
    "/v1/art/keys",
    operation_class=documented(body=struct_schema(KeyCreate), example=KEY_EXAMPLE),
    responses=errors(400, 401, 403, 408, 413, 500, 503),
    **ADMIN,
)
async def create_key(request: Request, keys: KeyService) -> Response[KeyCreated]:
    """A client key; its secret is in this answer only."""
    return Response(await keys.create(decode_body(await request.body(), KeyCreate)), status_code=201)


@get("/v1/art/keys", responses=errors(400, 401, 403, 500, 503), **ADMIN)
async def list_keys(keys: KeyService, include_revoked: bool = False) -> KeyList:
    return await keys.list_all(include_revoked)


@delete("/v1/art/keys/{key_id:str}", status_code=200, responses=errors(400, 401, 403, 404, 500, 503), **ADMIN)
async def revoke_key(keys: KeyService, key_id: str) -> ApiKey:
    """Revoke at once on this replica, on every other within about a second."""
    return await keys.revoke(key_id)


routes = [
    get_rollout,
    get_rollout_choice,
    list_rollouts,
    create_group,
    get_group,
    list_groups,
    load_adapter,
    model_status,
    list_models,
    add_model,
    retire_model,
    create_key,
    list_keys,
    revoke_key,
]
