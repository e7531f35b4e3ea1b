"""`/v1/art/...`: ART's own endpoints. Thin handlers: parse, call an injected service, return."""

from __future__ import annotations

import math
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.openapi import ResponseSpec
from litestar.params import Parameter

from gateway.adapters import AdapterService, PromoteRequest
from gateway.auth import ADMIN as ADMIN_CALLER
from gateway.auth import Caller
from gateway.errors import decode_body, invalid_request
from gateway.groups.service import GroupService
from gateway.guards import RouteAccess, admin_only, scoped
from gateway.judge_report import JudgeReportService
from gateway.keys import KeyService
from gateway.openapi import IDEMPOTENCY_KEY_PARAMETER, documented, errors, struct_schema
from gateway.promotion.decision import AdminAsked, decide
from gateway.promotion.graders import EvalSetCreate
from gateway.promotion.service import PromotionService
from gateway.rollouts import RolloutService
from store.api import (
    AdapterLoad,
    GroupCreate,
    GroupOut,
    GroupPage,
    KeyCreate,
    KeyCreated,
    KeyList,
    ModelList,
    ModelStatus,
)
from store.calls import RolloutFilter
from store.judge_report import JudgeReport
from store.keys import ApiKey
from store.promotions import EvalSetRow
from store.records import APIS, CALL_STATUSES
from store.rollouts import MAX_PAGE, RolloutPage
from store.trajectories import Trajectory
from store.types import GROUP_STATES

# The bodies are read raw and decoded with OpenAI-shaped 400s (decode_body): gateway/openapi.py describes them.
# Query bounds the store checks (its 400 names the param), documented here only: Litestar parses as before.
PAGE_LIMIT = Parameter(default=100, schema_extra={"minimum": 1, "maximum": MAX_PAGE})
GROUP_EXAMPLE = {"model": "my-agent", "rollouts": [{"rollout_id": "task-42-a", "reward": 1.0}]}
KEY_EXAMPLE = {"name": "support-bot", "models": ["my-agent"], "scopes": ["infer", "reward"], "rpm": 600}
# What each route needs: a client key with a scope (the admin key has them all), or the admin key.
READ = RouteAccess(guards=[scoped], opt={"scope": "read"})
REWARD = RouteAccess(guards=[scoped], opt={"scope": "reward"})
ADMIN = RouteAccess(guards=[admin_only])


class ModelCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/art/models`: a new trainable model on the same base."""

    name: str


class RewardIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/art/rewards`."""

    rollout_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    reward: float

    def __post_init__(self) -> None:
        if not math.isfinite(self.reward):
            raise ValueError("`reward` must be a finite number")


class RewardOut(msgspec.Struct, frozen=True):
    rollout_id: str
    reward: float
    object: str = "art.reward"


class EvalSetList(msgspec.Struct, frozen=True):
    data: list[EvalSetRow]
    object: str = "list"


EVAL_SET_EXAMPLE = {
    "name": "smoke",
    "samples": 4,
    "scenarios": [
        {
            "messages": [{"role": "user", "content": "Did motion 7 pass? yes or no"}],
            "grader": {"type": "exact", "value": "yes"},
        }
    ],
}


@get("/v1/art/rollouts/{rollout_id:str}", responses=errors(400, 401, 403, 404, 500, 503), **READ)
async def get_rollout(
    rollouts: RolloutService, caller: Caller, rollout_id: str, owner: str | None = None
) -> Trajectory:
    """The caller's rollout `rollout_id` (rollout ids are per key); the admin key reads key `owner`'s."""
    return await rollouts.get(rollout_id, caller=caller, owner=owner)


@get("/v1/art/rollouts/{rollout_id:str}/{choice:int}", responses=errors(400, 401, 403, 404, 500, 503), **READ)
async def get_rollout_choice(
    rollouts: RolloutService, caller: Caller, rollout_id: str, choice: int, owner: str | None = None
) -> Trajectory:
    """The rollout `"<rollout_id>/<choice>"`: one choice of its n > 1 call (`owner`: as for the whole one)."""
    return await rollouts.get(rollout_id, choice=choice, caller=caller, owner=owner)


@get("/v1/art/rollouts", responses=errors(400, 401, 403, 500, 503), **READ)
async def list_rollouts(
    rollouts: RolloutService,
    caller: Caller,
    model: str | None = None,
    since: float | None = None,
    limit: int = PAGE_LIMIT,
    cursor: str | None = None,
    key_id: str | None = None,
    status: str | None = Parameter(default=None, schema_extra={"enum": list(CALL_STATUSES)}),
    api: str | None = Parameter(default=None, schema_extra={"enum": list(APIS)}),
    group_id: str | None = None,
) -> RolloutPage:
    """Rollouts of the key's models, oldest first; `key_id`: only those made with that API key; `status`: with a
    call that ended so; `api`: with a call of that API; `group_id`: the members of that group of the key's."""
    # Plain strings: RolloutFilter says which values `status` and `api` may take, in OpenAI's error shape.
    where = RolloutFilter(
        model=model,
        since=since,
        key_id=key_id,
        status=status,  # type: ignore[arg-type]
        api=api,  # type: ignore[arg-type]
        group_id=group_id,
    )
    return await rollouts.page(where, limit=limit, cursor=cursor, caller=caller)


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
async def create_group(request: Request[Any, Any, Any], groups: GroupService, caller: Caller) -> Response[GroupOut]:
    spec = decode_body(await request.body(), GroupCreate)
    group, created = await groups.create(spec, request.headers.get("Idempotency-Key"), caller)
    return Response(group, status_code=201 if created else 200)


@get("/v1/art/groups/{group_id:str}", responses=errors(400, 401, 403, 404, 500, 503), **READ)
async def get_group(groups: GroupService, caller: Caller, group_id: str, owner: str | None = None) -> GroupOut:
    """The caller's group `group_id` (group ids are per key, as rollout ids are); the admin key reads key
    `owner`'s."""
    return await groups.get(group_id, caller, owner)


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
async def load_adapter(request: Request[Any, Any, Any], promotions: PromotionService, name: str) -> ModelStatus:
    """A trainer's new step: load it beside the old one, point `name` at it, mark its groups trained."""
    return await promotions.commit(name, decode_body(await request.body(), AdapterLoad))


@get("/v1/art/models/{name:str}", responses=errors(400, 401, 403, 404, 500, 503), **READ)
async def model_status(
    adapters: AdapterService, judge_reports: JudgeReportService, caller: Caller, name: str
) -> ModelStatus:
    status = await adapters.status(name, caller)
    return msgspec.structs.replace(status, judge_flags=await judge_reports.flagged(name))


@get("/v1/art/models/{name:str}/judge-report", responses=errors(400, 401, 403, 404, 500, 503), **READ)
async def get_judge_report(judge_reports: JudgeReportService, caller: Caller, name: str) -> JudgeReport:
    """How RULER's rankings agree with the callers' own rewards in groups that have both, per rubric and judge."""
    return await judge_reports.report(name, caller)


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
async def add_model(request: Request[Any, Any, Any], adapters: AdapterService) -> Response[ModelStatus]:
    """Serve (and train) one more model on the same base; a retired one comes back with its history."""
    status, created = await adapters.add_model(decode_body(await request.body(), ModelCreate).name)
    return Response(status, status_code=201 if created else 200)


@delete("/v1/art/models/{name:str}", status_code=200, responses=errors(400, 401, 403, 404, 500, 503), **ADMIN)
async def retire_model(adapters: AdapterService, name: str) -> ModelStatus:
    """Stop serving and training the model; its adapters leave the engine, its data stays."""
    return await adapters.retire_model(name)


@post(
    "/v1/art/models/{name:str}/promote",
    status_code=200,
    operation_class=documented(body=struct_schema(PromoteRequest), example={"step": 3, "reason": "checked by hand"}),
    responses=errors(400, 401, 403, 404, 408, 409, 413, 500, 502, 503),
    **ADMIN,
)
async def promote_step(request: Request[Any, Any, Any], adapters: AdapterService, name: str) -> ModelStatus:
    """Point `name` at a committed step (0: the base weights), whatever the gate said; recorded with its reason."""
    spec = decode_body(await request.body(), PromoteRequest)
    if spec.step is None:
        raise invalid_request("Give the `step` to promote.", param="step")
    await adapters.promote(name, decide(AdminAsked("promote", spec.step, spec.reason)))
    return await adapters.status(name, ADMIN_CALLER)


@post(
    "/v1/art/models/{name:str}/rollback",
    status_code=200,
    operation_class=documented(body=struct_schema(PromoteRequest), example={"reason": "reward fell"}),
    responses=errors(400, 401, 403, 404, 408, 409, 413, 500, 502, 503),
    **ADMIN,
)
async def rollback_step(request: Request[Any, Any, Any], adapters: AdapterService, name: str) -> ModelStatus:
    """Point `name` back at the step promoted before the current one (or at `step`); recorded with its reason."""
    body = await request.body()
    spec = decode_body(body, PromoteRequest) if body.strip() else PromoteRequest()
    step = spec.step if spec.step is not None else await adapters.rollback_target(name)
    await adapters.promote(name, decide(AdminAsked("rollback", step, spec.reason)))
    return await adapters.status(name, ADMIN_CALLER)


@post(
    "/v1/art/models/{name:str}/evals",
    operation_class=documented(body=struct_schema(EvalSetCreate), example=EVAL_SET_EXAMPLE),
    responses={
        200: ResponseSpec(EvalSetRow, description="A set of that name was replaced"),
        **errors(400, 401, 403, 404, 408, 413, 500, 503),
    },
    **ADMIN,
)
async def put_eval_set(
    request: Request[Any, Any, Any], promotions: PromotionService, name: str
) -> Response[EvalSetRow]:
    """Register (or replace) a named eval set: the gate evaluates each new step of `name` on it."""
    row, created = await promotions.put_set(name, decode_body(await request.body(), EvalSetCreate))
    return Response(row, status_code=201 if created else 200)


@get("/v1/art/models/{name:str}/evals", responses=errors(400, 401, 403, 404, 500, 503), **READ)
async def list_eval_sets(promotions: PromotionService, caller: Caller, name: str) -> EvalSetList:
    caller.check_model(name)
    return EvalSetList(await promotions.sets(name))


@delete(
    "/v1/art/models/{name:str}/evals/{eval_set:str}",
    status_code=204,
    responses=errors(400, 401, 403, 404, 500, 503),
    **ADMIN,
)
async def delete_eval_set(promotions: PromotionService, name: str, eval_set: str) -> None:
    await promotions.delete_set(name, eval_set)


@post(
    "/v1/art/rewards",
    operation_class=documented(body=struct_schema(RewardIn), example={"rollout_id": "task-42-a", "reward": 1.0}),
    responses={
        200: ResponseSpec(RewardOut, description="The same reward was given before"),
        **errors(400, 401, 403, 404, 408, 409, 413, 500, 503),
    },
    **REWARD,
)
async def post_reward(
    request: Request[Any, Any, Any], promotions: PromotionService, caller: Caller
) -> Response[RewardOut]:
    """One rollout's reward, given after the fact: it counts for the step that served the rollout (a canary's
    arms are judged by these and by the groups' rewards). Not trained on: GRPO needs groups."""
    spec = decode_body(await request.body(), RewardIn)
    created = await promotions.record_reward(spec.rollout_id, spec.reward, caller)
    return Response(RewardOut(spec.rollout_id, spec.reward), status_code=201 if created else 200)


@post(
    "/v1/art/keys",
    operation_class=documented(body=struct_schema(KeyCreate), example=KEY_EXAMPLE),
    responses=errors(400, 401, 403, 408, 413, 500, 503),
    **ADMIN,
)
async def create_key(request: Request[Any, Any, Any], keys: KeyService) -> Response[KeyCreated]:
    """A client key; its secret is in this answer only. It reads, groups, rewards and continues only what it
    makes itself; `read_keys` (none by default) names other keys whose rollouts, groups and stored Responses it
    may also read and continue, never change."""
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
    promote_step,
    rollback_step,
    put_eval_set,
    list_eval_sets,
    delete_eval_set,
    post_reward,
    create_key,
    list_keys,
    revoke_key,
    get_judge_report,
]
