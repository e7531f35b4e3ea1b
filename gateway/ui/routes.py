"""The web UI's pages at /ui: thin handlers over the API's services, rendered by Jinja templates."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec
from litestar import Request, Router, get, post
from litestar.datastructures import ResponseHeader
from litestar.enums import RequestEncodingType
from litestar.params import Body, Parameter
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Redirect, Template
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig

from gateway.adapters import AdapterRegistry, AdapterService
from gateway.auth import Caller
from gateway.errors import OpenAIError
from gateway.groups.service import GroupService
from gateway.guards import RouteAccess
from gateway.rollouts import RolloutService
from gateway.ui import pages
from gateway.ui.auth import (
    SECURITY_HEADERS,
    exception_handlers,
    reader_of,
    safe_next,
    same_site_form,
    session_cookie,
    session_token,
    ui_reader,
)
from gateway.ui.views import FILTERS

HERE = Path(__file__).parent
PAGE = RouteAccess(guards=[ui_reader], include_in_schema=False)


class LoginForm(msgspec.Struct, frozen=True):
    key: str = ""
    next: str = ""


@get("/", **PAGE)
async def home() -> Redirect:
    return Redirect("/ui/models")


@get("/models", **PAGE)
async def models_page(adapters: AdapterService, caller: Caller) -> Template:
    return Template("models.html", context=await pages.models_overview(adapters, caller))


@get("/models/{name:str}", **PAGE)
async def model_page(adapters: AdapterService, groups: GroupService, caller: Caller, name: str) -> Template:
    return Template("model.html", context=await pages.model_detail(adapters, groups, caller, name))


@get("/rollouts", **PAGE)
async def rollouts_page(
    rollouts: RolloutService,
    adapters: AdapterService,
    caller: Caller,
    model: str | None = None,
    since: str | None = None,
    key_id: str | None = None,
    limit: int = Parameter(default=pages.PAGE_SIZE, ge=1, le=200),
    cursor: str | None = None,
    status: str | None = None,
    api: str | None = None,
    group_id: str | None = None,
) -> Template:
    filters = pages.RolloutForm(
        model or None, since or None, key_id or None, limit, status or None, api or None, group_id or None
    )
    return Template("rollouts.html", context=await pages.rollout_list(rollouts, adapters, caller, filters, cursor))


@get("/rollouts/{rollout_id:str}", **PAGE)
async def rollout_page(
    rollouts: RolloutService,
    registry: AdapterRegistry,
    caller: Caller,
    rollout_id: str,
    view: str = "conversation",
    owner: str | None = None,
) -> Template:
    context = await pages.rollout_detail(rollouts, registry, caller, rollout_id, view, owner)
    return Template("rollout.html", context=context)


@get("/groups", **PAGE)
async def groups_page(
    groups: GroupService,
    adapters: AdapterService,
    caller: Caller,
    model: str | None = None,
    group_state: str | None = Parameter(query="state", default=None),  # `state` is Litestar's own kwarg
    limit: int = Parameter(default=pages.PAGE_SIZE, ge=1, le=200),
    cursor: str | None = None,
) -> Template:
    filters = pages.GroupForm(model or None, group_state or None, limit)
    return Template("groups.html", context=await pages.group_list(groups, adapters, caller, filters, cursor))


@get("/groups/{group_id:str}", **PAGE)
async def group_page(
    groups: GroupService, rollouts: RolloutService, caller: Caller, group_id: str, owner: str | None = None
) -> Template:
    return Template("group.html", context=await pages.group_detail(groups, rollouts, caller, group_id, owner))


@get("/login", include_in_schema=False)
async def login_form(next: str | None = None) -> Template:
    return Template("login.html", context={"next": safe_next(next), "error": None})


@post("/login", include_in_schema=False, status_code=303, guards=[same_site_form])
async def login(
    request: Request[Any, Any, Any], data: Annotated[LoginForm, Body(media_type=RequestEncodingType.URL_ENCODED)]
) -> Template | Redirect:
    """Check the key as the pages will, then keep a session naming it (not the key) in the cookie."""
    keyring = request.app.state.services.keyring
    try:
        caller = reader_of(keyring, data.key.strip() or None)
    except OpenAIError as exc:
        context = {"next": safe_next(data.next), "error": exc.message}
        return Template("login.html", context=context, status_code=exc.status)
    token = session_token(keyring, caller)
    return Redirect(safe_next(data.next), status_code=303, cookies=[session_cookie(request, token)])


@post("/logout", include_in_schema=False, status_code=303, guards=[same_site_form])
async def logout(request: Request[Any, Any, Any]) -> Redirect:
    return Redirect("/ui/login", status_code=303, cookies=[session_cookie(request, None)])


def _template_engine(engine: JinjaTemplateEngine) -> None:
    engine.engine.filters.update(FILTERS)


TEMPLATE_CONFIG = TemplateConfig(
    directory=HERE / "templates", engine=JinjaTemplateEngine, engine_callback=_template_engine
)

router = Router(
    path="/ui",
    route_handlers=[
        home,
        models_page,
        model_page,
        rollouts_page,
        rollout_page,
        groups_page,
        group_page,
        login_form,
        login,
        logout,
        create_static_files_router(path="/static", directories=[HERE / "static"], include_in_schema=False),
    ],
    exception_handlers=exception_handlers,  # type: ignore[arg-type]
    # No page of the UI may be framed (clickjacking), and the browser runs and loads only the UI's own files.
    response_headers=[ResponseHeader(name=name, value=value) for name, value in SECURITY_HEADERS.items()],
)
