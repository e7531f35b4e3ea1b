"""Who may call what: Litestar guards on the routes (handlers never check keys themselves).

A route says what it needs: `guards=[admin_only]`, or `guards=[scoped], opt={"scope": "read"}`. `scoped`
leaves the `Caller` in the request's scope, where the `caller` dependency hands it to the handler (to
filter listings to the key's models). The inference routes check their keys in gateway/apis/routes.py,
on the data path, without Litestar's DI.
"""

from __future__ import annotations

from typing import Any, TypedDict

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard, Scope

from gateway.auth import Caller, KeyRing, bearer, keyless_refused, same_secret
from gateway.errors import OpenAIError
from gateway.services import services_of

CALLER = "artgw.caller"  # the request scope's key for the Caller a guard found


class RouteAccess(TypedDict, total=False):
    """The keywords a route decorator takes to say who may call it, spread as `@get(path, **READ)`."""

    guards: list[Guard]
    opt: dict[str, Any]
    include_in_schema: bool


def _keys(connection: ASGIConnection[Any, Any, Any, Any]) -> KeyRing:
    return services_of(connection.app.state).keyring


def admin_only(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """The admin key, always (whatever --auth says; no exception for loopback clients)."""
    connection.scope[CALLER] = _keys(connection).admin(connection.headers)  # type: ignore[literal-required]


def scoped(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """A key with the route's `opt["scope"]` (infer, reward, read); the admin key has every scope."""
    caller = _keys(connection).caller(connection.headers)
    caller.check_scope(handler.opt["scope"])
    connection.scope[CALLER] = caller  # type: ignore[literal-required]


def keyed(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """`scoped`, and a key always: what is stored (a Response) is read and deleted with a key, whatever --auth
    says. Keyless inference may keep Responses, but any page a browser loads could ask for them by id."""
    caller = _keys(connection).caller(connection.headers)
    if caller.keyless:
        raise keyless_refused(handler.opt["scope"])
    caller.check_scope(handler.opt["scope"])
    connection.scope[CALLER] = caller  # type: ignore[literal-required]


def metrics_reader(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """`/metrics`: the --metrics-key or the admin key. Open only with --auth off and no --metrics-key: its series
    name every model, so where keys keep tenants apart they are nobody's to read without one."""
    services = services_of(connection.app.state)
    settings = services.settings
    expected = settings.metrics_key
    if expected is None and not settings.auth_required:
        return
    given = bearer(connection.headers)
    if given is not None and (
        (expected is not None and same_secret(given, expected)) or services.keyring.admin_key_matches(given)
    ):
        return
    wanted = "<metrics key>" if expected is not None else "<admin key> (or set --metrics-key for a scraper)"
    raise OpenAIError(401, f"/metrics needs `Authorization: Bearer {wanted}`.", code="invalid_api_key")


# An inference route's guard: a key with the `infer` scope (the data path's POSTs check theirs in
# gateway/apis/routes.py, without a guard).
INFER: dict[str, Any] = {"guards": [scoped], "opt": {"scope": "infer"}}
# A stored Response's reads and delete: `infer`, with a key (never keyless).
STORED: dict[str, Any] = {"guards": [keyed], "opt": {"scope": "infer"}}


def request_caller(scope: Scope) -> Caller:
    """The `caller` dependency: whom the route's guard let in (a KeyError here is a route without a guard)."""
    caller: Caller = scope[CALLER]  # type: ignore[literal-required]
    return caller
