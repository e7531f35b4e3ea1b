"""The gateway's ASGI app: routes, injected services, error shapes. Handlers are 2–4 statements."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from litestar import Litestar, Response, get
from litestar.datastructures import State
from litestar.di import Provide
from litestar.exceptions import HTTPException
from litestar.middleware import DefineMiddleware
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.plugins import JsonRenderPlugin, SwaggerRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme
from prometheus_client import CONTENT_TYPE_LATEST

from gateway import art_api
from gateway.adapters import AdapterRegistry, AdapterService
from gateway.apis import routes as inference
from gateway.apis.responses.service import ResponsesService
from gateway.auth import Caller
from gateway.errors import exception_handlers
from gateway.groups.service import GroupService
from gateway.guards import INFER, metrics_reader, request_caller
from gateway.judge_report import JudgeReportService
from gateway.keys import KeyService
from gateway.local_only import LocalOnly
from gateway.openapi import errors
from gateway.promotion.service import PromotionService
from gateway.provide import provide_services
from gateway.rollouts import RolloutService
from gateway.services import Services, services_of
from gateway.settings import Settings
from gateway.ui import TEMPLATE_CONFIG as UI_TEMPLATES
from gateway.ui import router as ui_router
from store.clock import SYSTEM_CLOCK, Clock

# ---------------------------------------------------------------- dependencies (built once, in provide.py)


def _registry(state: State) -> AdapterRegistry:
    return services_of(state).registry


def _rollouts(state: State) -> RolloutService:
    return services_of(state).rollouts


def _groups(state: State) -> GroupService:
    return services_of(state).groups


def _responses(state: State) -> ResponsesService:
    return services_of(state).responses


def _adapters(state: State) -> AdapterService:
    return services_of(state).adapters


def _keys(state: State) -> KeyService:
    return services_of(state).keys


def _promotions(state: State) -> PromotionService:
    return services_of(state).promotions


def _judge_reports(state: State) -> JudgeReportService:
    return services_of(state).judge_reports


DEPENDENCIES = {
    name: Provide(provider, sync_to_thread=False)
    for name, provider in (
        ("services", services_of),
        ("registry", _registry),
        ("rollouts", _rollouts),
        ("groups", _groups),
        ("adapters", _adapters),
        ("responses", _responses),
        ("keys", _keys),
        ("judge_reports", _judge_reports),
        ("promotions", _promotions),
        ("caller", request_caller),  # whom the route's guard let in
    )
}

# ---------------------------------------------------------------- handlers


@get(["/v1/models", "/rollouts/{rollout_id:str}/v1/models"], responses=errors(400, 401, 403, 500), **INFER)
async def list_models(registry: AdapterRegistry, caller: Caller, rollout_id: str | None = None) -> dict[str, Any]:
    """The models the key may use: its trainable models, their loaded steps, and the base if it covers it."""
    return registry.model_list(caller)


@get(
    ["/v1/models/{model_id:str}", "/rollouts/{rollout_id:str}/v1/models/{model_id:str}"],
    responses=errors(400, 401, 403, 404),
    **INFER,
)
async def retrieve_model(
    registry: AdapterRegistry, caller: Caller, model_id: str, rollout_id: str | None = None
) -> dict[str, Any]:
    return registry.model_card(model_id, caller)


@get(
    "/metrics",
    media_type=CONTENT_TYPE_LATEST.replace("; charset=utf-8", ""),
    responses=errors(401, 500),
    guards=[metrics_reader],
)
async def metrics(services: Services) -> Response[bytes]:
    await services.judge_reports.refresh_metrics()  # remade only when a minute old: not a store read per scrape
    # Litestar adds the charset itself.
    registry = services.registry
    body = await services.metrics.scrape(
        services.store.engine,
        services.recorder,
        registry.served_steps(),
        registry.canaries(),
        registry.broken_steps(),
    )
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
    # A key either way (gateway/auth.py); /healthz and /readyz need none, /metrics only with --metrics-key.
    components=Components(
        security_schemes={
            "bearer": SecurityScheme(type="http", scheme="bearer", description="an API key, or the admin key"),
            "x-api-key": SecurityScheme(type="apiKey", name="x-api-key", security_scheme_in="header"),
        }
    ),
    security=[{"bearer": []}, {"x-api-key": []}],
)


def create_app(settings: Settings, clock: Clock = SYSTEM_CLOCK, worker: int = 0) -> Litestar:
    """The gateway's ASGI app; its services are built on startup (`clock`, `worker`: see provide_services)."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        async with provide_services(settings, clock, worker) as services:
            app.state.services = services
            yield

    return Litestar(
        route_handlers=[
            *inference.routes,
            list_models,
            retrieve_model,
            metrics,
            healthz,
            readyz,
            *art_api.routes,
            ui_router,  # the web UI at /ui (gateway/ui/)
        ],
        dependencies=DEPENDENCIES,
        lifespan=[lifespan],
        # Keyless: only this machine's clients, never a web page they browse (gateway/local_only.py).
        middleware=[] if settings.auth_required else [DefineMiddleware(LocalOnly, names=settings.local_host_names)],
        # Litestar's own errors (gateway/apis/routes.py): Anthropic's shape under /v1/messages, OpenAI's elsewhere.
        exception_handlers={**exception_handlers, HTTPException: inference.handle_http_exception},
        request_max_body_size=settings.max_body_bytes,
        debug=False,
        type_encoders={msgspec.Struct: msgspec.to_builtins},
        openapi_config=OPENAPI_CONFIG,
        template_config=UI_TEMPLATES,
    )
