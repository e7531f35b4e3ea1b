"""The wire types of the gateway's `/v1/art` API that its clients read and send (client/, the CLI, the demo, the
trainer): the server's own structs, in the shared room so that a client loads no web server."""

from __future__ import annotations

from typing import Annotated

import msgspec

from store.adapters import AdapterEvent, AdapterRow
from store.judge_report import RubricAgreement
from store.promotions import EvaluationRow, PromotionRow
from store.types import GroupState, Promotion, StepMetrics


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
