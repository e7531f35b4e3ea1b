"""The adapter registry: which LoRA step each trainable model serves.

A trainable model `NAME` is served by vLLM either as the base model (step 0,
before any training) or as the LoRA adapter `NAME@<step>`. A request for
`NAME` goes to the newest step, `NAME@K` pins step K, and the base model's own
name reaches the base weights.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import anyio
import httpx
import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.errors import OpenAIError, invalid_request, model_not_found
from store.adapters import (
    AdapterRow,
    adapter_history,
    commit_step,
    loaded_adapters,
    record_failure,
    set_status,
)
from store.groups import LeaseLost, count_by_state
from store.types import GroupState, StepMetrics

log = logging.getLogger("artgw.adapters")

_PINNED = re.compile(r"^(?P<name>.+)@(?P<step>\d+)$")


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes and what it records."""

    upstream_model: str  # the name vLLM serves (base model or LoRA adapter)
    model: str | None  # the trainable model name, None for the base model
    step: int | None  # adapter step that serves it; 0 = base weights; None for the base model


@dataclass
class TrainableModel:
    name: str
    served_step: int = 0  # 0 = the base weights, no adapter yet
    loaded_steps: set[int] = field(default_factory=set)  # adapters vLLM has loaded, by step


def adapter_name(model: str, step: int) -> str:
    return f"{model}@{step}"


class AdapterRegistry:
    """In-memory view of the served adapters; the store keeps the history."""

    def __init__(self, base_model: str | None, trainable: list[str]) -> None:
        self.base_model = base_model  # None until a running engine has told us
        self.models = {name: TrainableModel(name) for name in trainable}

    def resolve(self, requested: str) -> Route:
        """Map the `model` field of a request to the engine's model name."""
        if self.base_model is None:
            raise OpenAIError(503, "The engine is starting; retry shortly.", code="engine_unavailable")
        model = self.models.get(requested)
        if model is not None:
            return self._route(model, model.served_step)
        pinned = _PINNED.match(requested)
        if pinned is not None and (model := self.models.get(pinned["name"])) is not None:
            step = int(pinned["step"])
            if step == 0 or step in model.loaded_steps:
                return self._route(model, step)
        if requested == self.base_model:
            return Route(self.base_model, None, None)
        raise model_not_found(requested)

    def _route(self, model: TrainableModel, step: int) -> Route:
        assert self.base_model is not None
        upstream = self.base_model if step == 0 else adapter_name(model.name, step)
        return Route(upstream, model.name, step)

    def served_steps(self) -> dict[str, int]:
        return {name: model.served_step for name, model in self.models.items()}

    def model_list(self) -> dict[str, Any]:
        """The body of `GET /v1/models`."""
        data = [
            {"id": model_id, "object": "model", "created": 0, "owned_by": "artgw", "root": root}
            for model_id, root in self.model_ids()
        ]
        return {"object": "list", "data": data}

    def model_card(self, model_id: str) -> dict[str, Any]:
        """The body of `GET /v1/models/{id}` (404 `model_not_found` for a model the gateway does not serve)."""
        for card in self.model_list()["data"]:
            if card["id"] == model_id:
                return card  # type: ignore[no-any-return]
        raise model_not_found(model_id)

    def model_ids(self) -> list[tuple[str, str]]:
        """(id, root) pairs for `GET /v1/models`: trainable names, their loaded steps, the base."""
        if self.base_model is None:
            return []
        out: list[tuple[str, str]] = []
        for model in self.models.values():
            out.append((model.name, self.base_model))
            out.extend((adapter_name(model.name, s), self.base_model) for s in sorted(model.loaded_steps))
        out.append((self.base_model, self.base_model))
        return out


# ---------------------------------------------------------------- loading adapters into the engine


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


class ModelStatus(msgspec.Struct, frozen=True):
    name: str
    base_model: str | None
    served_step: int
    loaded_steps: list[int]
    groups: dict[GroupState, int]  # state -> count
    steps: list[AdapterRow]  # newest first
    object: str = "art.model"


class AdapterService:
    """Loads adapters into vLLM beside the old ones, moves the alias, unloads old ones later."""

    def __init__(self, registry: AdapterRegistry, client: httpx.AsyncClient, store: AsyncEngine, keep: int = 3):
        self.registry = registry
        self.client = client
        self.store = store
        self.keep = keep  # adapters kept loaded per model: pinned `NAME@K` requests keep working a while
        self._lock = asyncio.Lock()

    def _model(self, name: str) -> TrainableModel:
        model = self.registry.models.get(name)
        if model is None:
            raise model_not_found(name)
        return model

    async def _engine(self, action: str, body: dict[str, Any]) -> tuple[bool, str]:
        try:
            answer = await self.client.post(f"/v1/{action}_lora_adapter", json=body, timeout=120.0)
        except httpx.TransportError as exc:
            return False, f"engine unreachable: {type(exc).__name__}"
        return answer.status_code == 200, answer.text

    async def _load_into_engine(self, name: str, path: str) -> tuple[bool, str]:
        ok, text = await self._engine("load", {"lora_name": name, "lora_path": path})
        if not ok and "already" in text.lower():  # left over from an attempt that did not commit
            await self._engine("unload", {"lora_name": name})
            ok, text = await self._engine("load", {"lora_name": name, "lora_path": path})
        return ok, text

    async def load(self, name: str, spec: AdapterLoad) -> ModelStatus:
        model = self._model(name)
        if spec.step < 1:
            raise invalid_request("'step' must be >= 1 (step 0 is the base model).", param="step")
        if not (Path(spec.path) / "adapter_config.json").is_file():
            raise invalid_request(f"No adapter at `{spec.path}` (adapter_config.json missing).", param="path")
        async with self._lock:
            if spec.step <= model.served_step:
                raise OpenAIError(
                    409, f"Step {spec.step} is not newer than the served step {model.served_step}.", param="step"
                )
            adapter = adapter_name(name, spec.step)
            ok, text = await self._load_into_engine(adapter, spec.path)
            if not ok:
                async with self.store.begin() as conn:
                    await record_failure(
                        conn, model=name, step=spec.step, path=spec.path, metrics=spec.metrics, error=text[:2000]
                    )
                raise OpenAIError(
                    502, f"The engine refused adapter {adapter}: {text[:500]}", code="adapter_load_failed"
                )
            try:
                async with self.store.begin() as conn:
                    await commit_step(
                        conn,
                        model=name,
                        step=spec.step,
                        path=spec.path,
                        metrics=spec.metrics,
                        group_ids=spec.group_ids,
                        lease_owner=spec.lease_owner,
                    )
            except BaseException as exc:
                # Whatever stopped the commit (a lost lease, the store down or locked, a cancelled request),
                # the adapter must not stay loaded: the store says what serves, and a retry loads it again.
                with anyio.CancelScope(shield=True):
                    ok, text = await self._engine("unload", {"lora_name": adapter})
                if not ok:
                    log.error("could not unload %s after its commit failed: %s", adapter, text[:300])
                if isinstance(exc, LeaseLost):
                    raise OpenAIError(409, f"Step not committed: {exc}.", code="lease_lost") from None
                raise
            model.loaded_steps.add(spec.step)
            model.served_step = spec.step  # the alias moves: new requests for `name` get this step
            await self._unload_old(model)
        return await self.status(name)

    async def _unload_old(self, model: TrainableModel) -> None:
        old = sorted(model.loaded_steps)[: -self.keep] if self.keep else sorted(model.loaded_steps)
        done = []
        for step in old:
            ok, _ = await self._engine("unload", {"lora_name": adapter_name(model.name, step)})
            model.loaded_steps.discard(step)
            if ok:
                done.append(step)
        async with self.store.begin() as conn:
            await set_status(conn, model.name, done, "unloaded")

    async def sync_engine(self) -> None:
        """After the engine (re)starts: load what the store says should be serving, newest `keep` per model."""
        async with self.store.connect() as conn:
            rows = await loaded_adapters(conn)
        async with self._lock:
            for row in rows:
                model = self.registry.models.get(row.model)
                if model is None:
                    continue
                newest = sorted(r.step for r in rows if r.model == row.model)[-self.keep :]
                if row.step not in newest:
                    continue
                ok, text = await self._load_into_engine(adapter_name(row.model, row.step), row.path)
                if ok:
                    model.loaded_steps.add(row.step)
                    model.served_step = max(model.served_step, row.step)
                else:
                    log.error("could not reload adapter %s@%s: %s", row.model, row.step, text[:300])

    async def follow_store(self, every: float = 2.0) -> None:
        """Replicas share one engine and one store: pick up steps another replica committed."""
        while True:
            await asyncio.sleep(every)
            try:
                async with self.store.connect() as conn:
                    rows = await loaded_adapters(conn)
            except Exception as exc:  # a store hiccup: try again next round
                log.warning("could not read adapters from the store: %s", exc)
                continue
            if self._lock.locked():  # this replica is committing a step itself
                continue
            for model in self.registry.models.values():
                steps = {r.step for r in rows if r.model == model.name}
                if steps and max(steps) > model.served_step:
                    # Mirror what the committing replica left in the engine, unloads included: a pinned
                    # `NAME@K` must not be routed to an adapter that is gone.
                    model.loaded_steps = steps
                    model.served_step = max(steps)

    async def status(self, name: str) -> ModelStatus:
        model = self._model(name)
        async with self.store.connect() as conn:
            history = await adapter_history(conn, name)
            counts = await count_by_state(conn)
        return ModelStatus(
            name=name,
            base_model=self.registry.base_model,
            served_step=model.served_step,
            loaded_steps=sorted(model.loaded_steps),
            groups={state: n for (m, state), n in counts.items() if m == name},
            steps=history,
        )
