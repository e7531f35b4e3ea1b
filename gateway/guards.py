"""Who may call what: Litestar guards on the routes (handlers never check keys themselves)."""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.errors import OpenAIError

_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def admin_only(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Admin endpoints: `Authorization: Bearer <admin key>`; with no key configured, this machine only."""
    key = connection.app.state.services.settings.admin_key
    if key is None:
        host = connection.client.host if connection.client else ""
        if host not in _LOOPBACK:
            raise OpenAIError(403, "Admin endpoints need --admin-key when called from another host.")
        return
    given = connection.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):  # constant time
        raise OpenAIError(401, "Admin endpoints need `Authorization: Bearer <admin key>`.", code="invalid_admin_key")
