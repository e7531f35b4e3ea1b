"""The gateway's ASGI app: thin handlers over the services in `GatewayState`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.types import ASGIApp
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway import art_api
from gateway.adapters import AdapterRegistry, AdapterService
from gateway.chat import ROLLOUT_HEADER, ChatService, rollout_key
from gateway.engine import EngineConfig, EngineFailed, EngineSupervisor, resolve_engine_port, wait_until_ready
from gateway.errors import exception_handlers
from gateway.groups import GroupService
from gateway.metrics import GatewayMetrics
from gateway.recorder import Recorder
from gateway.rollouts import RolloutService
from gateway.settings import Settings, served_base_name
from store import create_engine, migrate
from store.db import create_sync_sqlite_engine

log = logging.getLogger("artgw.gateway")


@dataclass
class GatewayState:
    settings: Settings
    registry: AdapterRegistry
    client: httpx.AsyncClient
    recorder: Recorder
    chat: ChatService
    supervisor: EngineSupervisor | None
    store: AsyncEngine
    rollouts: RolloutService
    groups: GroupService
    adapters: AdapterService
    metrics: GatewayMetrics
    engine_state: str = "starting"
    fatal: list[str] = field(default_factory=list)  # why the gateway gave up, if it did

    def current_engine_state(self) -> str:
        return self.supervisor.state if self.supervisor is not None else self.engine_state


def gateway(request: Request[Any, Any, State]) -> GatewayState:
    return request.app.state.gateway  # type: ignore[no-any-return]


# ---------------------------------------------------------------- handlers


@post(
    ["/v1/chat/completions", "/rollouts/{rollout_id:str}/v1/chat/completions"],
    status_code=200,
)
async def chat_completions(request: Request[Any, Any, State], rollout_id: str | None = None) -> ASGIApp:
    # The answer is a bare ASGI app (gateway/responses.py): no framework work between engine and client.
    key = rollout_key(request.headers.get(ROLLOUT_HEADER), rollout_id)
    return await gateway(request).chat.complete(await request.body(), key)


@get(["/v1/models", "/rollouts/{rollout_id:str}/v1/models"])
async def list_models(request: Request[Any, Any, State], rollout_id: str | None = None) -> dict[str, Any]:
    data = [
        {"id": model_id, "object": "model", "created": 0, "owned_by": "artgw", "root": root}
        for model_id, root in gateway(request).registry.model_ids()
    ]
    return {"object": "list", "data": data}


@get("/metrics")
async def metrics(request: Request[Any, Any, State]) -> Response[bytes]:
    state = gateway(request)
    served = {name: model.served_step for name, model in state.registry.models.items()}
    await state.metrics.refresh(state.store, state.recorder, served)
    # Litestar adds the charset itself.
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST.replace("; charset=utf-8", ""))


@get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz")
async def readyz(request: Request[Any, Any, State]) -> Response[Any]:
    state = gateway(request)
    ready = state.current_engine_state() == "ready"  # started, base model known, adapters synced
    if ready:
        try:
            ready = (await state.client.get("/health", timeout=2.0)).status_code == 200
        except httpx.TransportError:
            ready = False
    body = {"status": "ready" if ready else "not ready", "engine": state.current_engine_state()}
    return Response(body, status_code=200 if ready else 503)


# ---------------------------------------------------------------- life cycle


def _fail(state: GatewayState, reason: str) -> None:
    """Fail loudly: say why, then stop the server (the CLI exits non-zero)."""
    log.critical(reason)
    print(f"artgw: fatal: {reason}", file=sys.stderr, flush=True)
    state.fatal.append(reason)
    os.kill(os.getpid(), signal.SIGTERM)


async def _bring_up_engine(state: GatewayState) -> None:
    settings = state.settings
    try:
        if state.supervisor is not None:
            await state.supervisor.start()
            log.info("engine ready in %.1fs", state.supervisor.ready_seconds or 0)
        else:
            await wait_until_ready(settings.upstream_url, settings.engine_startup_timeout)
            state.registry.base_model = await _discover_base_model(state.client)
            await state.adapters.sync_engine()
            state.engine_state = "ready"
    except EngineFailed as exc:
        _fail(state, f"the inference engine did not start: {exc}")
        return
    print(
        f"ART Gateway ready: base_url=http://{settings.host}:{settings.port}/v1  model={settings.model_name}",
        flush=True,
    )


async def _discover_base_model(client: httpx.AsyncClient) -> str:
    """The base model a running vLLM serves: the model entry that is not a LoRA adapter."""
    answer = await client.get("/v1/models", timeout=10.0)
    answer.raise_for_status()
    for entry in answer.json()["data"]:
        if not entry.get("parent"):
            return str(entry["id"])
    raise EngineFailed("the upstream engine serves no base model")


def create_app(settings: Settings) -> Litestar:
    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        nonlocal settings
        if settings.base_model is not None:  # the supervised engine's port: a free one unless given
            settings = dataclasses.replace(settings, engine_port=resolve_engine_port(settings.engine_port))
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        store = create_engine(settings.db_url)
        if settings.migrate:
            await migrate(store)
        client = httpx.AsyncClient(
            base_url=settings.upstream_url,
            timeout=httpx.Timeout(settings.request_timeout, connect=5.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        supervisor: EngineSupervisor | None = None
        # With --upstream the base model's name is asked of the engine once it answers.
        base_name = served_base_name(settings.base_model) if settings.base_model is not None else None
        recorder = Recorder(
            store,
            sync_engine=create_sync_sqlite_engine(settings.db_url),
            spill_dir=settings.data_dir / "spill",
            queue_size=settings.recorder_queue_size,
            batch_size=settings.recorder_batch_size,
        )
        registry = AdapterRegistry(base_name, [settings.model_name])
        state = GatewayState(
            settings=settings,
            registry=registry,
            client=client,
            recorder=recorder,
            chat=None,  # type: ignore[arg-type]  # set just below; needs the state for engine_state
            supervisor=None,
            store=store,
            rollouts=RolloutService(store, recorder),
            groups=None,  # type: ignore[arg-type]  # set just below
            adapters=AdapterService(registry, client, store),
            metrics=GatewayMetrics(),
        )
        state.groups = GroupService(store, state.rollouts, registry, recorder, metrics=state.metrics)
        if settings.base_model is not None:
            supervisor = EngineSupervisor(
                EngineConfig(
                    base_model=settings.base_model,
                    served_name=base_name,
                    port=settings.engine_port,
                    max_lora_rank=settings.max_lora_rank,
                    max_model_len=settings.max_model_len,
                    extra_args=settings.engine_args,
                    log_path=settings.data_dir / "engine.log",
                    startup_timeout=settings.engine_startup_timeout,
                    env=settings.extra_env,
                ),
                on_fatal=lambda reason: _fail(state, reason),
                on_ready=state.adapters.sync_engine,
            )
            state.supervisor = supervisor
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30), auto_decompress=False
        )
        state.chat = ChatService(
            session=session,
            upstream_url=settings.upstream_url,
            request_timeout=settings.request_timeout,
            registry=registry,
            recorder=recorder,
            engine_state=state.current_engine_state,
            metrics=state.metrics,
        )
        app.state.gateway = state
        await recorder.start()
        await state.groups.resume_scoring()
        bring_up = asyncio.create_task(_bring_up_engine(state), name="engine-bring-up")
        follow = asyncio.create_task(state.adapters.follow_store(), name="adapters-follow-store")
        try:
            yield
        finally:
            bring_up.cancel()
            follow.cancel()
            await state.groups.close()
            await recorder.close()
            if supervisor is not None:
                await supervisor.stop()
            await client.aclose()
            await session.close()
            await store.dispose()

    return Litestar(
        route_handlers=[chat_completions, list_models, metrics, healthz, readyz, *art_api.routes],
        lifespan=[lifespan],
        exception_handlers=exception_handlers,  # type: ignore[arg-type]
        request_max_body_size=settings.max_body_bytes,
        debug=False,
        type_encoders={msgspec.Struct: msgspec.to_builtins},
    )
