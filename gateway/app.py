"""The gateway's ASGI app: routes, injected services, error shapes. Handlers are 2–4 statements."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.plugins import JsonRenderPlugin, SwaggerRenderPlugin
from litestar.types import ASGIApp
from prometheus_client import CONTENT_TYPE_LATEST

from gateway import art_api
from gateway.adapters import AdapterRegistry, AdapterService
from gateway.chat import ROLLOUT_HEADER, ChatService, rollout_key
from gateway.errors import exception_handlers
from gateway.groups.service import GroupService
from gateway.openapi import chat_operation, errors
from gateway.provide import Services, provide_services
from gateway.rollouts import RolloutService
from gateway.settings import Settings

# ---------------------------------------------------------------- dependencies (built once, in provide.py)


def _services(state: State) -> Services:
    return state.services  # type: ignore[no-any-return]


def _chat(state: State) -> ChatService:
    return _services(state).chat


def _registry(state: State) -> AdapterRegistry:
    return _services(state).registry


def _rollouts(state: State) -> RolloutService:
    return _services(state).rollouts


def _groups(state: State) -> GroupService:
    return _services(state).groups


def _adapters(state: State) -> AdapterService:
    return _services(state).adapters


DEPENDENCIES = {
    name: Provide(provider, sync_to_thread=False)
    for name, provider in (
        ("services", _services),
        ("registry", _registry),
        ("rollouts", _rollouts),
        ("groups", _groups),
        ("adapters", _adapters),
    )
}

# ---------------------------------------------------------------- handlers


@post(
    ["/v1/chat/completions", "/rollouts/{rollout_id:str}/v1/chat/completions"],
    status_code=200,
    # The body is read raw (the data path): its schema, the SSE answer and the errors are described here.
    operation_class=chat_operation,
    responses=errors(400, 404, 408, 413, 500, 502, 503, 504),
)
async def chat_completions(request: Request, rollout_id: str | None = None) -> ASGIApp:
    # The data path: the service is taken from the app's state rather than through Litestar's DI (~12 µs a
    # call measured), and the answer is a bare ASGI app (gateway/asgi.py), no framework work after it.
    key = rollout_key(request.headers.get(ROLLOUT_HEADER), rollout_id)
    return await _chat(request.app.state).complete(await request.body(), key, request.receive)


@get(["/v1/models", "/rollouts/{rollout_id:str}/v1/models"], responses=errors(400, 500))
async def list_models(registry: AdapterRegistry, rollout_id: str | None = None) -> dict[str, Any]:
    return registry.model_list()


@get("/metrics", media_type=CONTENT_TYPE_LATEST.replace("; charset=utf-8", ""), responses=errors(500))
async def metrics(services: Services) -> Response[bytes]:
    # Litestar adds the charset itself.
    body = await services.metrics.scrape(services.store.engine, services.recorder, services.registry.served_steps())
    return Response(body, media_type=CONTENT_TYPE_LATEST.replace("; charset=utf-8", ""))


@get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get(
    "/readyz",
    responses={503: ResponseSpec(data_container=dict[str, str], description="Not ready: the reason in the body")},
)
async def readyz(services: Services) -> Response[dict[str, str]]:
    ready, body = await services.readiness()
    return Response(body, status_code=200 if ready else 503)


# ---------------------------------------------------------------- the app

# The document at /schema/openapi.json (Swagger UI at /schema/swagger); gateway/openapi.py fills in what
# Litestar can't read from the handlers (raw-read bodies, OpenAI's error shape).
OPENAPI_CONFIG = OpenAPIConfig(
    title="ART Gateway",
    version="0.1.0",
    path="/schema",
    render_plugins=[JsonRenderPlugin(), SwaggerRenderPlugin()],
)


def create_app(settings: Settings) -> Litestar:
    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        async with provide_services(settings) as services:
            app.state.services = services
            yield

    return Litestar(
        route_handlers=[chat_completions, list_models, metrics, healthz, readyz, *art_api.routes],
        dependencies=DEPENDENCIES,
        lifespan=[lifespan],
        exception_handlers=exception_handlers,  # type: ignore[arg-type]
        request_max_body_size=settings.max_body_bytes,
        debug=False,
        type_encoders={msgspec.Struct: msgspec.to_builtins},
        openapi_config=OPENAPI_CONFIG,
    )
