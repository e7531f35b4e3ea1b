"""The wire types of the gateway's `/v1/art` API that its clients read and send (client/, the CLI, the demo, the
trainer): the server's own structs, in the shared room so that a client loads no web server."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from store.adapters import AdapterEvent, AdapterRow
from store.groups import CheckOutcome
from store.judge_report import RubricAgreement
from store.keys import ApiKey, Scope
from store.promotions import EvaluationRow, PromotionRow
from store.types import GroupState, Promotion, StepMetrics

# ---------------------------------------------------------------- models and adapters


class ModelList(msgspec.Struct, frozen=True):
    data: list[str]
    object: str = "list"


class ModelStatus(msgspec.Struct, frozen=True):
    name: str
    base_model: str | None  # the name vLLM serves the base weights under
    base_model_path: str | None  # the weights' path or hub id, as the engine loaded them (what a trainer loads)
    served_step: int  # what `NAME` serves: the promoted step
    loaded_steps: list[int]
    groups: dict[GroupState, int]  # state -> count
    steps: list[AdapterRow]  # newest first
    latest_step: int = 0  # what `NAME@latest` serves: the newest committed step
    promotion: Promotion = "always"
    canary_step: int | None = None  # the candidate serving a share of `NAME`'s rollouts, while a canary runs
    canary_share: float = 0.0
    # step -> the active rollouts pinned to it (their first call's step; called within --pin-hold): kept loaded
    pinned_rollouts: dict[int, int] = {}
    promotions: list[PromotionRow] = []  # promotions and rollbacks, newest first
    evaluations: list[EvaluationRow] = []  # the gate's results, newest step first
    judge_flags: list[RubricAgreement] = []  # RULER rubrics that disagree with the callers (judge-report)
    adapter_events: list[AdapterEvent] = []  # loads into the engine, unloads, refused loads: newest first
    retired: bool = False
    object: str = "art.model"


# Bounds of an adapter load: the store keeps `step` in a 32-bit INTEGER column (SQLite and PostgreSQL), and the
# rest is kept to what a trainer sends, so no admin input can fail only after the engine has loaded it.
MAX_STEP = 2**31 - 1
MAX_PATH = 4096  # PATH_MAX on Linux
MAX_GROUPS_PER_STEP = 10_000
MAX_ID = 256


class AdapterLoad(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a trainer posts once a step's checkpoint is on disk."""

    step: Annotated[int, msgspec.Meta(le=MAX_STEP)]  # >= 1 is checked by hand: its message explains step 0
    # directory with adapter_config.json + weights, readable by the engine
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH)]
    # the groups this step trained: marked trained once the adapter serves
    group_ids: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=MAX_ID)]], msgspec.Meta(max_length=MAX_GROUPS_PER_STEP)
    ] = []
    lease_owner: Annotated[str, msgspec.Meta(max_length=MAX_ID)] = ""
    metrics: StepMetrics | None = None


# ---------------------------------------------------------------- keys (admin)
# `POST /v1/art/keys` takes a KeyCreate and answers a KeyCreated; `GET /v1/art/keys` answers a KeyList;
# `DELETE /v1/art/keys/{id}` answers the revoked key's store.keys.ApiKey.

KeyName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
PerMinute = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]


class KeyCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/art/keys`: who the key is for and what it may do."""

    name: KeyName
    models: Annotated[list[KeyName], msgspec.Meta(min_length=1, max_length=1000)] | None = None  # None: every model
    scopes: Annotated[list[Scope], msgspec.Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["infer"])
    rpm: PerMinute | None = None  # requests per minute (per replica); None: no limit
    tpm: PerMinute | None = None  # prompt + completion tokens per minute (per replica); None: no limit
    # Other keys (their ids) whose rollouts, groups and stored Responses this key may read, list and continue
    # (a follow-up is its own), never add to, group, reward or delete; none by default: a key reads its own.
    read_keys: Annotated[list[str], msgspec.Meta(max_length=1000)] = []


class KeyCreated(msgspec.Struct, frozen=True):
    """The new key, with its secret: shown this once, stored only as a hash."""

    id: str
    key: str
    name: str
    models: list[str] | None
    scopes: list[Scope]
    rpm: int | None
    tpm: int | None
    created_at: float
    object: str = "art.api_key"
    read_keys: list[str] = []  # the keys whose things it may read, besides its own


class KeyList(msgspec.Struct, frozen=True):
    """`GET /v1/art/keys`: the keys, secrets left out."""

    data: list[ApiKey]
    object: str = "list"


# ---------------------------------------------------------------- groups
# `POST /v1/art/groups` takes a GroupCreate and answers a GroupOut (201 made, 200 the same request again);
# `GET /v1/art/groups/{id}` answers a GroupOut; `GET /v1/art/groups` a GroupPage.


class RolloutIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One member of a posted group, with the caller's reward (None: RULER scores it)."""

    rollout_id: str  # a rollout id, or "<rollout id>/<choice>" for one choice of an n > 1 call
    reward: float | None = None
    metrics: dict[str, float] | None = None


MAX_JUDGES = 8
MAX_SAMPLES = 16
MAX_CRITERIA = 16
MAX_CHECKS = 16


class JudgeIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One judge of a panel: a judge the gateway's operator named, and the sampling parameters a caller may set
    (the gateway refuses any other: endpoints, keys and headers are the operator's)."""

    judge_model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    litellm_params: dict[str, Any] = {}


class CriterionIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A part of the task the judges score on its own; the score is the criteria's weighted mean."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Annotated[str, msgspec.Meta(min_length=1, max_length=2000)]
    weight: Annotated[float, msgspec.Meta(ge=0, le=1000)] = 1.0


class RulerIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Who scores a posted group's members (RULER): one judge (`judge_model`) or a panel (`judges`), each
    `samples` times in permuted orders, on the whole task or on `criteria`, with rule `checks` beside them."""

    judge_model: str | None = None  # a judge the gateway's operator named (its --judges-file)
    rubric: str | None = None
    litellm_params: dict[str, Any] = {}  # sampling only (temperature, max_tokens, ...): the gateway refuses others
    judges: Annotated[list[JudgeIn], msgspec.Meta(max_length=MAX_JUDGES)] = []  # instead of judge_model
    samples: Annotated[int, msgspec.Meta(ge=1, le=MAX_SAMPLES)] = 1  # judgements per judge, each its own order
    criteria: Annotated[list[CriterionIn], msgspec.Meta(max_length=MAX_CRITERIA)] = []
    # The eval sets' graders (exact, regex, json_schema, tool_call, webhook) with `on_fail` and `weight`:
    # decoded by the gateway (gateway/groups/checks.py GroupCheck), where the graders live.
    checks: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_CHECKS)] = []
    # Judgements that disagree more than this (the group's mean spread of scores) fail the group: not trained.
    max_spread: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None


class GroupCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/art/groups`: the attempts at one task, to be compared by GRPO (idempotent by `group_id`)."""

    model: str
    rollouts: list[RolloutIn]
    ruler: RulerIn | None = None
    group_id: str | None = None
    metadata: dict[str, Any] | None = None


class GroupRolloutOut(msgspec.Struct, frozen=True):
    """A group's member as the gateway keeps it: the reward trained on, and who gave it."""

    rollout_id: str
    reward: float | None
    caller_reward: float | None
    ruler_score: float | None
    ruler_explanation: str | None
    metrics: dict[str, float] | None
    ruler_criteria: dict[str, float] | None = None  # each criterion's score (the judges' aggregate)
    ruler_spread: float | None = None  # how much the judgements disagree on it (std of its scores)
    checks: list[CheckOutcome] | None = None  # each rule check: passed, and what failing did


class GroupOut(msgspec.Struct, frozen=True):
    """A group and where it stands: scoring, ready, trained (at `trained_step`), failed."""

    id: str
    group_id: str  # the same as `id`, under the name a request gives it
    model: str
    state: GroupState
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
    judge_spread: float | None = None  # a panel's judgements: their mean disagreement over the group
    judge_agreement: float | None = None  # ... and their mean pairwise Spearman correlation
    owner: str = ""  # whose rollouts it groups: the key that made it ("" for none: the admin's, --auth off's)


class GroupPage(msgspec.Struct, frozen=True):
    """One page of `GET /v1/art/groups`, oldest first; `next_cursor` asks for the next (None: the last page)."""

    data: list[GroupOut]
    next_cursor: str | None
    object: str = "list"
