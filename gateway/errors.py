"""OpenAI's error body, for every error the gateway returns.

`{"error": {"message", "type", "param", "code"}}`: clients built on the OpenAI
SDK turn this into typed exceptions (`openai.NotFoundError`, ...).
"""

from __future__ import annotations

import logging
import re
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.types import ExceptionHandlersMap
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, ProgrammingError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from store.errors import Conflict, Invalid, NotFound, StoreError, StoreMissing

log = logging.getLogger("artgw.gateway")
T = TypeVar("T")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class OpenAIError(Exception):
    """An error the client should see, in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers: dict[str, str] | None = None  # e.g. the rollout id, echoed on an inference call's error

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> Response[bytes]:
        return Response(
            msgspec.json.encode(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")


def validation_error(exc: msgspec.ValidationError) -> OpenAIError:
    """msgspec's validation error as a 400 naming the `param`, with OpenAI's codes."""
    text = str(exc)
    at = _AT.search(text)
    path = at["path"] if at else ""
    message = text[: at.start()] if at else text
    if missing := _MISSING.match(message):
        param = f"{path}.{missing['field']}" if path else missing["field"]
        message = f"Missing required parameter: '{param}'."
        return invalid_request(message, param=param, code="missing_required_parameter")
    if not path and message.startswith("Expected `object`"):
        return invalid_request("Request body must be a JSON object.", code="invalid_json")
    # `Expected int >= 1`: a value out of range; `Expected str, got int` or an array too short: the wrong kind.
    code = "invalid_value" if re.search(r"[<>]=? ?-?\d", message) and "of length" not in message else "invalid_type"
    if message.startswith("Invalid enum value"):  # a Literal field given another value
        code = "invalid_value"
    where = f" (at '{path}')" if path else ""
    return invalid_request(f"Invalid request: {message}{where}.", param=path or None, code=code)


# The deepest nesting of arrays and objects a JSON body may have (the body itself is level 1). One limit for
# accepting and for storing: whatever is accepted is recorded, and must read back through every decoder on the
# way out (SQLite's and PostgreSQL's JSON, Python's json, msgspec), whose own limits are near 1,000 levels less
# the reader's stack. Real requests nest under 20 (a tool's JSON schema is the deepest part).
MAX_JSON_DEPTH = 64
# Kind-blind brackets: JSON already decoded is well formed, and depth does not care which kind nests.
_BRACKETS_ONLY = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when `body`, already decoded as valid JSON, nests arrays and objects deeper than `limit`.

    Only C-speed bytes operations, no Python work per value (for a body with more than `limit` brackets, about
    as long as msgspec takes to decode it; fewer brackets, under a microsecond): escapes and
    then strings are cut out, everything but brackets is dropped, and each `replace` pass removes the
    innermost pairs; `replace` does not rescan what it joins, so one pass is exactly one level, and whatever
    is left after `limit` passes is deeper.
    """
    if body.count(b"[") + body.count(b"{") <= limit:  # too few openers to nest that deep
        return False
    # `\\` first: what then remains of a backslash before a quote escapes that quote.
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])  # the even pieces lie outside strings
    brackets = outside.translate(_BRACKETS_ONLY, _NOT_BRACKET)
    for _ in range(limit):
        brackets = brackets.replace(b"[]", b"")
        if not brackets:
            return False
    return True


def too_deep() -> OpenAIError:
    return invalid_request(
        f"Request body is nested too deeply: at most {MAX_JSON_DEPTH} levels of arrays and objects.",
        code="invalid_json",
    )


def decode_body(body: bytes, kind: type[T], decoder: msgspec.json.Decoder[T] | None = None) -> T:
    """Decode a JSON body into a struct; anything wrong is a 400 naming the field, nesting beyond
    MAX_JSON_DEPTH included."""
    value = decode_json(body, kind, decoder)
    if json_too_deep(body):
        raise too_deep()
    # A struct's decoder skips unknown fields without reading their strings: invalid UTF-8 there must not pass
    # (the body is recorded). ASCII, nearly every body, is checked at C speed without a decode.
    if not body.isascii():
        try:
            body.decode()
        except UnicodeDecodeError:
            raise not_utf8() from None
    return value


def decode_json(body: bytes, kind: type[T], decoder: msgspec.json.Decoder[T] | None = None) -> T:
    """`decode_body` without the depth check, for a body already checked."""
    try:
        return decoder.decode(body) if decoder is not None else msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise invalid_request(f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    except UnicodeDecodeError:
        raise not_utf8() from None
    except RecursionError:
        raise too_deep() from None


def not_utf8() -> OpenAIError:
    return invalid_request("Request body is not valid UTF-8.", code="invalid_json")


def handle_openai_error(_: Request[Any, Any, Any], exc: OpenAIError) -> Response[bytes]:
    return exc.to_response()


_STATUS_BY_STORE_ERROR: tuple[tuple[type[StoreError], int], ...] = (
    (NotFound, 404),
    (Invalid, 400),
    (Conflict, 409),
    (StoreMissing, 503),
)


def from_store_error(exc: StoreError) -> OpenAIError:
    """The store's domain error as the wire error the client sees."""
    status = next((code for kind, code in _STATUS_BY_STORE_ERROR if isinstance(exc, kind)), 500)
    return OpenAIError(status, exc.message, param=exc.param, code=exc.code)


def handle_store_error(_: Request[Any, Any, Any], exc: StoreError) -> Response[bytes]:
    return from_store_error(exc).to_response()


# What the gateway serves, named in the 404 of any other path: a client that hits one gets told what exists.
SERVED_ENDPOINTS = (
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/responses",
    "GET /v1/responses/{id}",
    "DELETE /v1/responses/{id}",
    "GET /v1/responses/{id}/input_items",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "GET /v1/models",
    "GET /v1/models/{id}",
    "/v1/art/... (rollouts, groups, models)",
)


def from_http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> OpenAIError:
    """Litestar's own errors (unknown route, wrong method, body too large, a query parameter of the wrong type)
    in OpenAI's shape."""
    status = exc.status_code
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    message = exc.detail or "error"
    param = None
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        first = exc.extra[0]
        if isinstance(first, dict) and first.get("key"):  # a path or query parameter Litestar could not parse
            param, code = str(first["key"]), "invalid_type"
            message = f"Invalid '{param}': {first.get('message') or 'wrong type'}."
    if status == 413:
        message = "Request body is too large."
    elif status == 404:
        code = "unknown_endpoint"
        message = (
            f"The gateway does not serve {request.method} {request.url.path}. "
            f"It serves: {', '.join(SERVED_ENDPOINTS)}; "
            "the inference endpoints also under /rollouts/{rollout_id}/v1/...."
        )
    return OpenAIError(status, message, param=param, code=code)


def handle_unexpected(_: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    log.exception("unhandled error", exc_info=exc)
    return OpenAIError(500, "The gateway hit an internal error.", code="internal_error").to_response()


# Seconds a client is told to wait (`Retry-After`) when the store is unavailable.
STORE_RETRY_AFTER = 2


def store_unavailable_response() -> Response[bytes]:
    error = OpenAIError(
        503, "The store is unavailable (down or locked); retry shortly.", type="server_error", code="store_unavailable"
    )
    return Response(
        msgspec.json.encode(error.body()),
        status_code=503,
        media_type="application/json",
        headers={"Retry-After": str(STORE_RETRY_AFTER)},
    )


def handle_database_error(request: Request[Any, Any, Any], exc: SQLAlchemyError) -> Response[bytes]:
    """The store could not be reached, or was locked past its busy timeout, or no pooled connection came free
    in time: a 503 the client may retry, not a 500. What retrying cannot fix (a constraint violation, data the
    column refuses, SQL the database rejects, a non-database SQLAlchemy error) is a bug: a 500."""
    if isinstance(exc, IntegrityError | DataError | ProgrammingError) or not isinstance(exc, DBAPIError | PoolTimeout):
        return handle_unexpected(request, exc)
    log.warning("store unavailable for %s %s: %s", request.method, request.url.path, exc)
    return store_unavailable_response()


exception_handlers: ExceptionHandlersMap = {
    OpenAIError: handle_openai_error,
    StoreError: handle_store_error,
    SQLAlchemyError: handle_database_error,
    Exception: handle_unexpected,
}
