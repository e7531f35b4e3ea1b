"""`--auth off`: the gateway answers its own machine's clients, not the web pages they browse.

Without keys, what stops a page from calling the gateway is the browser's rules, and they let through a
cross-site POST whose body is `text/plain`, a form or typeless (no preflight), and a page whose own name was
rebound to 127.0.0.1 (DNS rebinding: same origin, full access). So, with --auth off only (a key stops both
otherwise): a request must name one of the gateway's own hosts in `Host` (settings' `local_host_names`:
--host, localhost, 127.0.0.1, ::1, and each --allowed-host), an `Origin` if it sends one must be one of them
too, and an API body must be JSON, which a page can only send cross-site after a preflight the gateway never
grants. The UI (/ui) keeps its forms: its own session cookie and CSRF token guard them.

Refusals are in OpenAI's error shape (Anthropic's under /v1/messages), sent before the app sees the request.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.apis.messages.schema import from_openai_error
from gateway.apis.routes import under_messages
from gateway.asgi import JSONBody
from gateway.errors import OpenAIError

_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
_FORMS = "/ui"  # the web UI's own forms (gateway/ui/): guarded by its session and CSRF token


def host_name(value: str) -> str:
    """The name in a `Host` value or an `Origin`'s authority: no port, lower case, IPv6 without brackets,
    no trailing dot."""
    if value.startswith("["):
        return value[1:].partition("]")[0].lower()
    return value.partition(":")[0].rstrip(".").lower()


def origin_name(origin: str) -> str:
    """The host name an `Origin` names (`http://name:port`); "" for `null` and anything else unreadable."""
    scheme, sep, rest = origin.partition("://")
    return host_name(rest.partition("/")[0]) if sep and scheme in ("http", "https") else ""


def is_json(content_type: str) -> bool:
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class LocalOnly:
    """ASGI middleware for --auth off: refuses a foreign `Host` or `Origin`, and API bodies that are not JSON."""

    def __init__(self, app: Any, names: frozenset[str]) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        refused = self.refusal(scope) if scope["type"] == "http" else None
        if refused is None:
            await self.app(scope, receive, send)
            return
        body = from_openai_error(refused).body() if under_messages(scope["path"]) else refused.body()
        await JSONBody(msgspec.json.encode(body), {}, refused.status)(scope, receive, send)

    def refusal(self, scope: Any) -> OpenAIError | None:
        host = origin = content_type = None
        has_body = False
        for name, value in scope["headers"]:  # one pass; names are lower case in ASGI
            if name == b"host":
                host = value.decode("latin-1")
            elif name == b"origin":
                origin = value.decode("latin-1")
            elif name == b"content-type":
                content_type = value.decode("latin-1")
            elif name == b"content-length":
                has_body = value.strip() not in (b"", b"0")
            elif name == b"transfer-encoding":
                has_body = True
        if host is None or host_name(host) not in self.names:
            return OpenAIError(
                403,
                f"This gateway (--auth off) answers only the host names it listens for, not {host!r}: add a name "
                "with --allowed-host (ARTGW_ALLOWED_HOST), or use --auth required.",
                code="host_not_allowed",
            )
        if origin is not None and origin_name(origin) not in self.names:
            return OpenAIError(
                403,
                f"This gateway (--auth off) answers no page of origin {origin!r}: a web page may not call it. Add its "
                "host with --allowed-host, or use --auth required and a key.",
                code="origin_not_allowed",
            )
        path: str = scope["path"]
        if (
            has_body
            and scope["method"] in _WITH_BODY
            and not (path == _FORMS or path.startswith(_FORMS + "/"))
            and not (content_type is not None and is_json(content_type))
        ):
            return OpenAIError(
                415,
                f"The body must be JSON, sent as `Content-Type: application/json` (got {content_type!r}).",
                param="Content-Type",
                code="unsupported_media_type",
            )
        return None
