"""Who may see the pages: the API's keys with the `read` scope, from a header or the session cookie.

Scripts send `Authorization: Bearer <key>` (or `x-api-key`) as to the API. A browser enters its key once at
/ui/login; the session then rides in an HttpOnly, SameSite=Strict cookie scoped to /ui (so no other site's page
can send it, and no script on the page can read it), for the browser session. The cookie holds no key: it names
the key by its id, until when, signed with a secret derived from the admin key (HMAC-SHA256), so a stolen
cookie is not a key, it ends after SESSION_SECONDS, and it ends at once when its key is revoked (or the admin
key changes). A form post from another site (login CSRF: a page that logs a browser in with the attacker's key)
is refused by its Origin. A page asked for without a key sends a browser to the login page; one with a wrong
key, or a key without `read`, is answered 401 / 403.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any
from urllib.parse import quote, urlsplit

from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie
from litestar.exceptions import HTTPException
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Redirect, Template

from gateway.auth import ADMIN, Caller, KeyRing
from gateway.errors import OpenAIError, from_http_exception, from_store_error
from gateway.guards import CALLER
from store.errors import StoreError

COOKIE = "artgw_ui_session"
LOGIN = "/ui/login"
HOME = "/ui/rollouts"
SESSION_SECONDS = 12 * 3600  # a session cookie's life, at most (the browser drops it when it closes)
_ADMIN_ID = "admin"  # a session of the admin key (which has no key id)


def _keyring(connection: ASGIConnection[Any, Any, Any, Any]) -> KeyRing:
    return connection.app.state.services.keyring  # type: ignore[no-any-return]


def _sends_key(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    return "authorization" in connection.headers or "x-api-key" in connection.headers


def reader_of(keyring: KeyRing, key: str | None) -> Caller:
    """The caller of `key` (None: no key) if it may read: else the API's own 401 / 403."""
    caller = keyring.caller({"authorization": f"Bearer {key}"} if key else {})
    caller.check_scope("read")
    return caller


def ui_reader(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """The guard of every page: a header's key, else the session cookie's; `read` scope."""
    keyring = _keyring(connection)
    if _sends_key(connection):
        caller = keyring.caller(connection.headers)
    else:
        caller = session_caller(keyring, connection.cookies.get(COOKIE))
    caller.check_scope("read")
    connection.scope[CALLER] = caller  # type: ignore[literal-required]


def _signature(keyring: KeyRing, claim: str) -> str:
    secret = hmac.new(keyring.admin_key.encode(), b"artgw ui session", hashlib.sha256).digest()
    return hmac.new(secret, claim.encode(), hashlib.sha256).hexdigest()


def session_token(keyring: KeyRing, caller: Caller) -> str:
    """`KEY_ID.EXPIRES.SIGNATURE`: which key, until when (epoch seconds), signed."""
    claim = f"{caller.key_id or _ADMIN_ID}.{int(time.time() + SESSION_SECONDS)}"
    return f"{claim}.{_signature(keyring, claim)}"


def session_caller(keyring: KeyRing, token: str | None) -> Caller:
    """The caller a session cookie names: its key while the token is genuine, unexpired and the key live; else
    the API's 401 (a browser is sent to log in)."""
    claim, _, signature = (token or "").rpartition(".")
    key_id, _, expires = claim.rpartition(".")
    caller = None
    if claim and hmac.compare_digest(signature, _signature(keyring, claim)) and expires.isdigit():
        if int(expires) > time.time():
            caller = ADMIN if key_id == _ADMIN_ID else keyring.by_key_id(key_id)
    if caller is None:
        return reader_of(keyring, None)  # no (valid) key: what a request without one gets
    return caller


def same_site_form(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """The guard of the UI's forms: a post from another site's page (its Origin, or the browser's
    Sec-Fetch-Site) is refused, so no page elsewhere can log a browser in or out."""
    origin = connection.headers.get("origin")
    cross = connection.headers.get("sec-fetch-site") == "cross-site"
    if origin is not None:
        cross = origin == "null" or urlsplit(origin).netloc != connection.headers.get("host")
    if cross:
        raise OpenAIError(403, "A form of another site cannot post here.", code="cross_site_form")


def session_cookie(request: Request[Any, Any, Any], token: str | None) -> Cookie:
    """The session of this browser (no max-age: gone when the browser closes); None clears it."""
    return Cookie(
        key=COOKIE,
        value=token or "",
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        max_age=None if token else 0,
    )


def safe_next(target: str | None) -> str:
    """Where to go after logging in: a page of the UI only (never another site)."""
    if target and target.startswith("/ui") and not target.startswith("//") and "\\" not in target:
        return target
    return HOME


# On every answer of the UI, its error pages too: no page may be framed (clickjacking), and the browser runs
# and loads only the UI's own files.
SECURITY_HEADERS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


def _error_page(request: Request[Any, Any, Any], error: OpenAIError) -> Response[Any]:
    if error.status == 401 and not _sends_key(request):  # a browser without (a valid) session key: log in
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        response: Response[Any] = Redirect(
            f"{LOGIN}?next={quote(target, safe='')}", status_code=303, headers=SECURITY_HEADERS
        )
        if COOKIE in request.cookies:
            response.set_cookie(session_cookie(request, None))  # a revoked key: forget it
        return response
    return Template(
        "error.html",
        context={"status": error.status, "message": error.message, "code": error.code},
        status_code=error.status,
        headers=SECURITY_HEADERS,
    )


def handle_openai_error(request: Request[Any, Any, Any], exc: OpenAIError) -> Response[Any]:
    return _error_page(request, exc)


def handle_store_error(request: Request[Any, Any, Any], exc: StoreError) -> Response[Any]:
    return _error_page(request, from_store_error(exc))


def handle_http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    return _error_page(request, from_http_exception(request, exc))


# The pages' errors as pages (the store being down stays the API's 503; a bug stays its 500).
exception_handlers = {
    OpenAIError: handle_openai_error,
    StoreError: handle_store_error,
    HTTPException: handle_http_exception,
}
