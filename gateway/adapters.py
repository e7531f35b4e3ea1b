"""The adapter registry: which LoRA step each trainable model serves.

A trainable model `NAME` is served by vLLM either as the base model (step 0,
before any training) or as the LoRA adapter `NAME@<step>`. A request for
`NAME` goes to the promoted step, `NAME@latest` to the newest committed one,
`NAME@K` pins step K, and the base model's own name reaches the base weights.
With `--promotion always` every committed step is promoted at once; with
`gated`, gateway/promotion/ decides (eval sets, or an admin's promote/rollback).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import anyio
import httpx
import msgspec
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from engine.answers import EngineAnswerError, ModelList, read
from engine.pool import Engine, EnginePool
from gateway.auth import ADMIN, Caller
from gateway.errors import OpenAIError, invalid_request, model_not_found
from gateway.promotion.decision import Committed, Decision, decide
from gateway.settings import MODEL_NAME_RULE, valid_model_name
from store.adapters import (
    AdapterRow,
    adapter_event_history,
    adapter_history,
    commit_step,
    committed_step,
    loaded_adapters,
    record_failure,
    set_status,
)
from store.api import AdapterLoad, ModelStatus
from store.groups import LeaseLost, count_by_state
from store.models import active_models, add_models
from store.models import retire_model as retire_in_store
from store.promotions import (
    PromotionRow,
    evaluations_of,
    promoted_steps,
    promotion_history,
    record_promotion,
    running_canaries,
)
from store.types import Promotion

log = logging.getLogger("artgw.adapters")

_PINNED = re.compile(r"^(?P<name>.+)@(?P<step>\d+|latest)$")


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes and what it records."""

    upstream_model: str  # the name vLLM serves (base model or LoRA adapter)
    model: str | None  # the trainable model name, None for the base model
    step: int | None  # adapter step that serves it; 0 = base weights; None for the base model


@dataclass(frozen=True, slots=True)
class Pin:
    """The model and step that served a rollout's first call: its later calls to `model` go there too."""

    model: str
    step: int


def adapter_problem(path: str) -> str | None:
    """Why an adapter directory cannot be served, or None: a config that is not a JSON object, weights cut short
    or with a header that does not read. Checked before the engine is asked, because vLLM may take a damaged
    file and fail only at the first call (a 404 naming its internal alias). The safetensors header and the
    file's size are checked, not the values; weights that are not there are left to the engine to refuse."""
    directory = Path(path)
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"adapter_config.json does not read ({type(exc).__name__})"
    if not isinstance(config, dict):
        return "adapter_config.json is not a JSON object"
    weights = directory / "adapter_model.safetensors"
    if not weights.exists():
        return None
    try:
        size = weights.stat().st_size
        with weights.open("rb") as f:
            (header_bytes,) = struct.unpack("<Q", f.read(8))
            if header_bytes > size - 8:
                return f"adapter_model.safetensors is cut short ({size} bytes, a header of {header_bytes})"
            header = json.loads(f.read(header_bytes))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        return f"adapter_model.safetensors does not read ({type(exc).__name__})"
    if 8 + header_bytes + end > size:
        return f"adapter_model.safetensors is cut short ({size} of {8 + header_bytes + end} bytes)"
    return None


@dataclass
class TrainableModel:
    name: str
    served_step: int = 0  # the promoted step, what `NAME` serves; 0 = the base weights
    latest_step: int = 0  # the newest committed step, what `NAME@latest` serves
    canary_step: int | None = None  # a candidate serving a share of `NAME`'s rollouts (--canary), if any
    loaded_steps: set[int] = field(default_factory=set)  # adapters vLLM has loaded, by step
    broken_steps: set[int] = field(default_factory=set)  # committed steps whose checkpoint no longer loads
    # Held from a store commit that changes what this model serves to the update of the fields above that
    # follows it, and by its status reads, so that a status never shows the store ahead of them (a promotion
    # row with the old served step). Never held across an engine call.
    changing: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)
    # Bumped by each change this replica makes to the fields above: a store read by `follow_store` that was
    # under way meanwhile may predate it, and is not applied (the next round reads again).
    changed: int = 0


def adapter_name(model: str, step: int) -> str:
    return f"{model}@{step}"


def _pinned_step(model: TrainableModel, pin: Pin | None) -> int | None:
    """The step of `model` the rollout is pinned to, if it still serves (the base weights always do)."""
    if pin is None or pin.model != model.name or not (pin.step == 0 or pin.step in model.loaded_steps):
        return None
    return pin.step


def canary_bucket(rollout_id: str) -> float:
    """A stable number in [0, 1) for a rollout id: below the canary share, the rollout is on the canary."""
    return int.from_bytes(hashlib.sha256(rollout_id.encode()).digest()[:8], "big") / 2**64


class AdapterRegistry:
    """In-memory view of the served adapters; the store keeps the history."""

    def __init__(
        self,
        base_model: str | None,
        trainable: list[str],
        base_model_path: str | None = None,
        canary_share: float = 0.0,
    ) -> None:
        self.base_model = base_model  # None until a running engine has told us
        self.base_model_path = base_model_path  # the weights' path or hub id (a trainer loads the same)
        self.models = {name: TrainableModel(name) for name in trainable}
        self.canary_share = canary_share  # of `NAME`'s rollouts, served by its canary step while one runs

    def resolve(self, requested: str, caller: Caller, rollout_id: str | None = None, pin: Pin | None = None) -> Route:
        """Map the `model` field of a request to the engine's model name. A model the caller's key does not
        cover is `model_not_found`, exactly like one that does not exist. `pin`: the step the rollout's first
        call was served by, where `NAME` goes while it is loaded; else `rollout_id` says which arm of a canary
        the call is on (every call of a rollout on the same one)."""
        if self.base_model is None:
            raise OpenAIError(503, "The engine is starting; retry shortly.", code="engine_unavailable")
        route = self._find(requested, rollout_id, pin)
        if route is None or not caller.covers(route.model or route.upstream_model):
            raise model_not_found(requested)
        return route

    def _find(self, requested: str, rollout_id: str | None = None, pin: Pin | None = None) -> Route | None:
        assert self.base_model is not None
        model = self.models.get(requested)
        if model is not None:
            if (step := _pinned_step(model, pin)) is not None:
                return self._route(model, step)  # the rollout's step, whatever was promoted since
            canary = model.canary_step
            if canary is not None and canary in model.loaded_steps and rollout_id is not None:
                if canary_bucket(rollout_id) < self.canary_share:
                    return self._route(model, canary)
            return self._route(model, model.served_step)
        named = _PINNED.match(requested)
        if named is not None and (model := self.models.get(named["name"])) is not None:
            if named["step"] == "latest":
                if (step := _pinned_step(model, pin)) is not None:
                    return self._route(model, step)  # as for `NAME`: the rollout's step
                step = model.latest_step
            else:
                step = int(named["step"])  # an explicit step wins
            if step == 0 or step in model.loaded_steps:
                return self._route(model, step)
        if requested == self.base_model:
            return Route(self.base_model, None, None)
        return None

    def _route(self, model: TrainableModel, step: int) -> Route:
        assert self.base_model is not None
        upstream = self.base_model if step == 0 else adapter_name(model.name, step)
        return Route(upstream, model.name, step)

    def canaries(self) -> dict[str, float]:
        """model -> the share of its rollouts its canary step serves, for models with a canary running."""
        return {name: self.canary_share for name, m in self.models.items() if m.canary_step is not None}

    def broken_steps(self) -> dict[str, int]:
        """Each model's committed steps found broken (their checkpoint no longer loads)."""
        return {name: len(model.broken_steps) for name, model in self.models.items()}

    def served_steps(self) -> dict[str, tuple[int, int]]:
        """model -> (promoted step, newest step)."""
        return {name: (model.served_step, model.latest_step) for name, model in self.models.items()}

    def model_list(self, caller: Caller) -> dict[str, Any]:
        """The body of `GET /v1/models`: what the caller's key may use."""
        data = [
            {"id": model_id, "object": "model", "created": 0, "owned_by": "artgw", "root": root}
            for model_id, root in self.model_ids(caller)
        ]
        return {"object": "list", "data": data}

    def model_card(self, model_id: str, caller: Caller) -> dict[str, Any]:
        """The body of `GET /v1/models/{id}` (404 `model_not_found` for a model the gateway does not serve)."""
        for card in self.model_list(caller)["data"]:
            if card["id"] == model_id:
                return card  # type: ignore[no-any-return]
        raise model_not_found(model_id)

    def model_ids(self, caller: Caller) -> list[tuple[str, str]]:
        """(id, root) pairs for `GET /v1/models`: trainable names, their loaded steps, the base."""
        if self.base_model is None:
            return []
        out: list[tuple[str, str]] = []
        for model in self.models.values():
            if not caller.covers(model.name):
                continue
            out.append((model.name, self.base_model))
            out.append((f"{model.name}@latest", self.base_model))
            out.extend((adapter_name(model.name, s), self.base_model) for s in sorted(model.loaded_steps))
        if caller.covers(self.base_model):
            out.append((self.base_model, self.base_model))
        return out


# ---------------------------------------------------------------- loading adapters into the engine


class PromoteRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/art/models/{name}/promote` (step required) and `.../rollback` (none: the step promoted before)."""

    step: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] | None = None
    reason: Annotated[str, msgspec.Meta(max_length=2000)] | None = None


class AdapterService:
    """Loads adapters into vLLM beside the old ones, moves the alias, unloads old ones later."""

    def __init__(
        self,
        registry: AdapterRegistry,
        client: httpx.AsyncClient,
        store: AsyncEngine,
        engines: EnginePool,
        keep: int = 3,
        promotion: Promotion = "always",
        held_steps: Callable[[str], dict[int, int]] = lambda _: {},
    ):
        self.registry = registry
        self.client = client
        self.store = store
        self.engines = engines  # every step is loaded on each engine in rotation before calls are routed to it
        self.keep = keep  # adapters kept loaded per model besides the promoted one: pinned `NAME@K` keep working
        self.promotion = promotion
        # model -> {step: active rollouts pinned to it} (gateway/rollouts.py RolloutOwners): kept loaded.
        self.held_steps = held_steps
        self._lock = asyncio.Lock()

    def _model(self, name: str) -> TrainableModel:
        model = self.registry.models.get(name)
        if model is None:
            raise model_not_found(name)
        return model

    async def _engine(self, engine: Engine, action: str, body: dict[str, Any]) -> tuple[bool, str]:
        try:
            answer = await self.client.post(f"{engine.url}/v1/{action}_lora_adapter", json=body, timeout=120.0)
        except httpx.TransportError as exc:
            return False, f"engine unreachable: {type(exc).__name__}"
        return answer.status_code == 200, answer.text

    async def _held(self, engine: Engine, wait: float = 30.0) -> set[str] | None:
        """The LoRA adapters `engine` lists at `/v1/models` (vLLM's entries with a parent), None if it does not
        answer: what it holds, whatever its load API said."""
        try:
            answer = await self.client.get(f"{engine.url}/v1/models", timeout=wait)
            if answer.status_code != 200:
                return None
            return {card.id for card in read(answer.content, ModelList).data if card.parent}
        except (httpx.HTTPError, EngineAnswerError):
            return None

    async def _load_on(self, engine: Engine, name: str, path: str) -> str | None:
        """Load adapter `name` on one engine and check that it lists it: None when it holds it, else why not."""
        load = {"lora_name": name, "lora_path": path}
        ok, text = await self._engine(engine, "load", load)
        if not ok and "already" in text.lower():  # left over from an attempt that did not commit
            await self._engine(engine, "unload", {"lora_name": name})
            ok, text = await self._engine(engine, "load", load)
        if not ok:
            return text
        held = await self._held(engine)
        if held is None or name not in held:
            return f"it answered the load but does not list {name} at /v1/models"
        return None

    async def _publish(self, name: str, path: str) -> tuple[bool, str]:
        """Load adapter `name` on every engine in rotation, each checked to hold it (`_load_on`), before anything
        routes to it (under the lock): the one place a step reaches the engines. Published when at least one engine
        holds it: an engine that does not is quarantined (out of rotation until `prepare_engine` loads it there),
        so every engine that takes calls holds every step routed to. When none holds it, it is published to none:
        (False, why), and no engine is quarantined (the step is what fails, as with one engine)."""
        engines = self.engines.in_rotation or self.engines.engines[:1]
        outcomes = await asyncio.gather(*(self._load_on(e, name, path) for e in engines))
        failed = [(e, why) for e, why in zip(engines, outcomes, strict=True) if why is not None]
        if len(failed) == len(engines):
            if len(engines) == 1:
                return False, failed[0][1]
            return False, "; ".join(f"{e.url}: {why[:500]}" for e, why in failed)
        for engine, why in failed:
            self.engines.quarantine(engine, f"did not load {name}: {why[:500]}")
        return True, ""

    async def _unload(self, name: str) -> tuple[bool, str]:
        """Unload adapter `name` from every engine (those out of rotation too: one may hold it); ok when every
        engine in rotation did."""
        engines = self.engines.engines
        outcomes = await asyncio.gather(*(self._engine(e, "unload", {"lora_name": name}) for e in engines))
        failed = [(e, text) for e, (ok, text) in zip(engines, outcomes, strict=True) if not ok and e.in_rotation]
        return not failed, "; ".join(f"{e.url}: {text[:300]}" for e, text in failed)

    async def prepare_engine(self, engine: Engine) -> str | None:
        """Whether an engine that answers its health probe holds every step calls may be routed to (each model's
        promoted, kept, pinned and canary steps): None when it does, else why not (engine/pool.py quarantines it).
        One out of rotation (back from a restart with nothing loaded, or quarantined) gets the missing steps loaded
        first, under the lock so that no step is published meanwhile; one in rotation that lost some (it restarted
        between two probes) is only said to lack them, and is loaded once out of rotation, at the next probe. One in
        rotation is not checked while a step is being published or unloaded (the lock held): its list is in flux."""
        if engine.in_rotation and self._lock.locked():
            return None
        async with self._lock:
            return await self._prepare(engine, load=not engine.in_rotation)

    async def restore_engine(self, engine: Engine) -> str | None:
        """An engine answered a call that it does not hold the step the call was routed to (it restarted since
        its last probe, and lost every adapter: gateway/proxy.py): every step calls may be routed to is loaded
        there again, now, so that the call is sent again rather than failed. None when it holds them all."""
        async with self._lock:
            return await self._prepare(engine, load=True)

    async def _prepare(self, engine: Engine, *, load: bool) -> str | None:
        """`prepare_engine`'s check (under the lock); `load`: the missing steps are loaded, else only said."""
        held = await self._held(engine, wait=30.0 if load else 2.0)
        if held is None:  # only checked (in rotation): its health probe says whether it is gone
            return "its /v1/models does not answer" if load else None
        missing = {
            adapter_name(m.name, step): (m.name, step)
            for m in self.registry.models.values()
            for step in m.loaded_steps
            if adapter_name(m.name, step) not in held
        }
        if not missing:
            return None
        if not load:
            return f"it lost {', '.join(sorted(missing))} (restarted?)"
        async with self.store.connect() as conn:
            rows = [await committed_step(conn, model, step) for model, step in missing.values()]
        for adapter, row in zip(missing, rows, strict=True):
            if row is None:
                return f"{adapter} is served but not in the store"
            why = await self._load_on(engine, adapter, row.path)
            if why is not None:
                return f"did not load {adapter}: {why[:500]}"
        log.info("engine %s holds every served step again (%d loaded)", engine.url, len(missing))
        return None

    async def load(self, name: str, spec: AdapterLoad) -> Decision:
        """Commit a trainer's new step: load it on every engine, record it, unload steps older than `keep`. The
        decision on it comes back: `evaluate` under `gated` promotion (PromotionService.commit hands it to the
        gate), `promote` (done, in the commit's transaction) under `always`."""
        model = self._model(name)
        if spec.step < 1:
            raise invalid_request("'step' must be >= 1 (step 0 is the base model).", param="step")
        if not (Path(spec.path) / "adapter_config.json").is_file():
            raise invalid_request(f"No adapter at `{spec.path}` (adapter_config.json missing).", param="path")
        problem = adapter_problem(spec.path)
        if problem is not None:
            raise invalid_request(f"The adapter at `{spec.path}` does not load: {problem}.", param="path")
        async with self._lock:
            if spec.step <= model.latest_step:
                raise OpenAIError(
                    409, f"Step {spec.step} is not newer than the newest step {model.latest_step}.", param="step"
                )
            adapter = adapter_name(name, spec.step)
            decision = decide(Committed(spec.step, self.promotion))
            ok, text = await self._publish(adapter, spec.path)
            if not ok:
                async with self.store.begin() as conn:
                    await record_failure(
                        conn, model=name, step=spec.step, path=spec.path, metrics=spec.metrics, error=text[:2000]
                    )
                raise OpenAIError(
                    502, f"The engine refused adapter {adapter}: {text[:500]}", code="adapter_load_failed"
                )
            try:
                async with model.changing:
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
                        if decision.moves:  # in the same transaction: a committed step is a promoted one
                            await _record(conn, name, model.served_step, decision)
                    model.loaded_steps.add(spec.step)
                    model.latest_step = spec.step  # `name@latest` moves; `name` too if the decision says so
                    if decision.moves:
                        model.served_step = spec.step
                    model.changed += 1
            except BaseException as exc:
                # Whatever stopped the commit (a lost lease, the store down or locked, a cancelled request),
                # the adapter must not stay loaded: the store says what serves, and a retry loads it again.
                with anyio.CancelScope(shield=True):
                    ok, text = await self._unload(adapter)
                if not ok:
                    log.error("could not unload %s after its commit failed: %s", adapter, text[:300])
                if isinstance(exc, LeaseLost):
                    raise OpenAIError(409, f"Step not committed: {exc}.", code="lease_lost") from None
                raise
            await self._unload_old(model)
        return decision

    async def promote(self, name: str, decision: Decision) -> PromotionRow:
        """Point `name` at the decision's step (0: the base weights), loading its adapter again if it was
        unloaded, and record the decision. 404 for a step that never committed; 409 if the engine refuses it."""
        model = self._model(name)
        step = decision.step
        async with self._lock:
            if step != 0 and step not in model.loaded_steps:
                if step in model.broken_steps:
                    raise OpenAIError(
                        409, f"Step {step} of `{name}` does not load (broken).", param="step", code="adapter_broken"
                    )
                async with self.store.connect() as conn:
                    row = await committed_step(conn, name, step)
                if row is None:
                    raise OpenAIError(
                        404, f"Step {step} of `{name}` was never committed.", param="step", code="step_not_found"
                    )
                if not await self._reload(model, row):
                    raise OpenAIError(
                        409, f"Step {step} of `{name}` does not load (broken).", param="step", code="adapter_broken"
                    )
                async with self.store.begin() as conn:
                    await set_status(conn, name, [step], "loaded", "loaded again to be promoted")
            async with model.changing:
                async with self.store.begin() as conn:
                    promotion = await _record(conn, name, model.served_step, decision)
                model.served_step = step
                model.changed += 1
            await self._unload_old(model)
        log.info("%s: %s to step %d by %s (%s)", name, decision.kind, step, decision.actor, decision.reason)
        return promotion

    async def rollback_target(self, name: str) -> int:
        """The step that was promoted before the current one was (409 if there is none)."""
        model = self._model(name)
        async with self.store.connect() as conn:
            history = await promotion_history(conn, name, limit=1000)
        for row in history:  # newest first: how the current step came to be promoted
            if row.action == "promote" and row.step == model.served_step and row.previous_step is not None:
                if row.previous_step != model.served_step:
                    return row.previous_step
        raise OpenAIError(409, f"`{name}` has no earlier promoted step to roll back to.", code="nothing_to_roll_back")

    async def _unload_old(self, model: TrainableModel) -> None:
        # The newest `keep` stay loaded, the promoted step whatever its age (`NAME` must keep answering), and
        # the steps active rollouts are pinned to (a rollout stays on one policy).
        held = {model.served_step, model.canary_step, *self.held_steps(model.name)}
        unpinned = sorted(model.loaded_steps - held)
        old = unpinned[: -self.keep] if self.keep else unpinned
        done = []
        for step in old:
            ok, _ = await self._unload(adapter_name(model.name, step))
            model.loaded_steps.discard(step)
            model.changed += 1
            if ok:
                done.append(step)
        async with self.store.begin() as conn:
            await set_status(conn, model.name, done, "unloaded", f"older than the newest {self.keep}")

    async def sync_engine(self) -> None:
        """After the engine (re)starts: load what the store says should be serving, newest `keep` per model
        and the promoted step."""
        async with self._lock:  # read under the lock too: a step committed meanwhile is in the read
            async with self.store.connect() as conn:
                rows = await loaded_adapters(conn)
                promoted = await promoted_steps(conn)
                canaries = await running_canaries(conn)
            for model in self.registry.models.values():
                await self._load_lineage(model, rows, promoted.get(model.name, 0))
                canary = canaries.get(model.name)
                model.canary_step = canary.step if canary is not None else None
                model.changed += 1

    async def _load_lineage(self, model: TrainableModel, rows: list[AdapterRow], promoted: int) -> None:
        """Load the newest `keep` of a model's serving steps and its promoted one into the engine (under the
        lock). `NAME` serves the promoted step; if it does not load, the newest step promoted before it that
        does (the base weights last): a broken file never takes a model offline."""
        mine = [r for r in rows if r.model == model.name]
        for row in [r for r in mine[: -self.keep] if r.step == promoted] + mine[-self.keep :]:
            model.latest_step = max(model.latest_step, row.step)
            await self._reload(model, row)
        model.served_step = await self._servable(model, promoted)

    async def _reload(self, model: TrainableModel, row: AdapterRow) -> bool:
        """Load a committed step into the engine again (under the lock); one whose checkpoint no longer loads is
        marked broken: in the store (status, and a `load_failed` event saying why), the status and /metrics."""
        problem = adapter_problem(row.path)
        if problem is None:
            ok, text = await self._publish(adapter_name(row.model, row.step), row.path)
            if ok:
                model.loaded_steps.add(row.step)
                return True
            problem = f"the engine refused it: {text[:500]}"
        log.error("%s: step %d (%s) does not load: %s", row.model, row.step, row.path, problem)
        model.broken_steps.add(row.step)
        model.loaded_steps.discard(row.step)
        async with self.store.begin() as conn:
            await set_status(conn, row.model, [row.step], "broken", problem)
        return False

    async def _servable(self, model: TrainableModel, promoted: int) -> int:
        """The step `NAME` serves: the promoted one if it is loaded, else the newest step promoted before it that
        loads (loading it again if needed), else the base weights."""
        if promoted == 0 or promoted in model.loaded_steps:
            return promoted
        async with self.store.connect() as conn:
            history = await promotion_history(conn, model.name, limit=1000)
        for step in dict.fromkeys(p.step for p in history):  # newest first, each step once
            if step == 0 or step in model.loaded_steps:
                fallback = step
                break
            if step in model.broken_steps:
                continue
            async with self.store.connect() as conn:
                row = await committed_step(conn, model.name, step)
            if row is not None and await self._reload(model, row):
                fallback = step
                break
        else:
            fallback = 0
        log.warning("%s: promoted step %d does not load; serving step %d instead", model.name, promoted, fallback)
        return fallback

    # ------------------------------------------------------------ the set of models (admin)

    async def add_model(self, name: str) -> tuple[ModelStatus, bool]:
        """Serve a new trainable model (or bring a retired one back, with its adapters); (status, created)."""
        if not valid_model_name(name):
            raise invalid_request(f"Invalid model name: {MODEL_NAME_RULE}.", param="name")
        if name == self.registry.base_model:
            raise invalid_request(f"`{name}` is the base model's name.", param="name")
        async with self._lock:
            created = name not in self.registry.models
            if created:
                async with self.store.begin() as conn:
                    await add_models(conn, [name])
                    rows = await loaded_adapters(conn)
                    promoted = await promoted_steps(conn)
                model = self.registry.models.setdefault(name, TrainableModel(name))
                if self.registry.base_model is not None:  # else sync_engine loads it once the engine is up
                    await self._load_lineage(model, rows, promoted.get(name, 0))
        return await self.status(name, ADMIN), created  # an admin endpoint

    async def retire_model(self, name: str) -> ModelStatus:
        """Stop serving and training a model: its adapters leave the engine, its data stays in the store."""
        model = self._model(name)
        async with self._lock:
            async with self.store.begin() as conn:
                await retire_in_store(conn, name)
            self.registry.models.pop(name, None)
            for step in sorted(model.loaded_steps):
                ok, text = await self._unload(adapter_name(name, step))
                if not ok:
                    log.warning("could not unload %s@%s on retiring it: %s", name, step, text[:300])
        status = await self._status_of(model)
        return msgspec.structs.replace(status, served_step=0, loaded_steps=[], retired=True)

    async def follow_store(self, every: float = 2.0) -> None:
        """Replicas share one engine and one store: pick up models another replica added or retired, and
        steps it committed."""
        while True:
            await asyncio.sleep(every)
            seen = {name: model.changed for name, model in self.registry.models.items()}
            try:
                async with self.store.connect() as conn:
                    rows = await loaded_adapters(conn)
                    active = set(await active_models(conn))
                    promoted = await promoted_steps(conn)
                    canaries = await running_canaries(conn)
            except Exception as exc:  # a store hiccup: try again next round
                log.warning("could not read adapters from the store: %s", exc)
                continue
            if self._lock.locked():  # this replica is committing a step itself
                continue
            for name in list(self.registry.models):
                if name not in active:
                    del self.registry.models[name]  # retired elsewhere (which unloaded its adapters)
            for name in active:
                self.registry.models.setdefault(name, TrainableModel(name))
            for model in list(self.registry.models.values()):
                steps = {r.step for r in rows if r.model == model.name}
                target = promoted.get(model.name, 0)
                canary = canaries.get(model.name)
                async with model.changing:  # not while one of its status reads runs (it lags the store anyway)
                    if model.changed != seen.get(model.name, model.changed):
                        continue  # changed here while the store was read: the read may predate it
                    model.canary_step = canary.step if canary is not None else None
                    if (steps and max(steps) > model.latest_step) or target != model.served_step:
                        # Mirror what the committing replica left in the engine, unloads included: a pinned
                        # `NAME@K` must not be routed to an adapter that is gone.
                        model.loaded_steps = steps
                        model.latest_step = max(steps, default=0)
                        model.served_step = target if target == 0 or target in steps else model.served_step

    async def status(self, name: str, caller: Caller) -> ModelStatus:
        """A model's served step, adapters, groups and step history (404 for a model the caller's key lacks)."""
        caller.check_model(name)
        return await self._status_of(self._model(name))

    def list_models(self, caller: Caller) -> list[str]:
        return sorted(name for name in self.registry.models if caller.covers(name))

    async def _status_of(self, model: TrainableModel) -> ModelStatus:
        name = model.name
        async with model.changing, self.store.connect() as conn:
            history = await adapter_history(conn, name)
            counts = await count_by_state(conn)
            promotions = await promotion_history(conn, name)
            events = await adapter_event_history(conn, name)
            evaluations = await evaluations_of(conn, name)
            return ModelStatus(
                name=name,
                base_model=self.registry.base_model,
                base_model_path=self.registry.base_model_path,
                served_step=model.served_step,
                loaded_steps=sorted(model.loaded_steps),
                groups={state: n for (m, state), n in counts.items() if m == name},
                steps=history,
                latest_step=model.latest_step,
                promotion=self.promotion,
                canary_step=model.canary_step,
                canary_share=self.registry.canary_share,
                pinned_rollouts=self.held_steps(name),
                promotions=promotions,
                evaluations=evaluations,
                adapter_events=events,
            )


async def _record(conn: AsyncConnection, name: str, served: int, decision: Decision) -> PromotionRow:
    """The promotion log's row for a decision that moves `name` off the `served` step."""
    if not decision.moves:
        raise ValueError(f"a {decision.kind!r} decision moves nothing")
    return await record_promotion(
        conn,
        model=name,
        step=decision.step,
        previous_step=served,
        action="rollback" if decision.kind == "rollback" else "promote",
        actor=decision.actor,
        reason=decision.reason,
    )
