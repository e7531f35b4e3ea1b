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
from litestar.exceptions import HTTPException

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

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> Response[bytes]:
        return Response(msgspec.json.encode(self.body()), status_code=self.status, media_type="application/json")


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
    where = f" (at '{path}')" if path else ""
    return invalid_request(f"Invalid request: {message}{where}.", param=path or None, code=code)


def decode_body(body: bytes, kind: type[T], decoder: msgspec.json.Decoder[T] | None = None) -> T:
    """Decode a JSON body into a struct; anything wrong is a 400 naming the field."""
    try:
        return decoder.decode(body) if decoder is not None else msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise invalid_request(f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    except UnicodeDecodeError:
        raise invalid_request("Request body is not valid UTF-8.", code="invalid_json") from None
    except RecursionError:
        raise invalid_request("Request body is nested too deeply.", code="invalid_json") from None


def handle_openai_error(_: Request, exc: OpenAIError) -> Response[bytes]:
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


def handle_store_error(_: Request, exc: StoreError) -> Response[bytes]:
    return from_store_error(exc).to_response()


def handle_http_exception(_: Request, exc: HTTPException) -> Response[bytes]:
    """Litestar's own errors (unknown route, wrong method, body too large) in OpenAI's shape."""
    status = exc.status_code
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    message = exc.detail or "error"
    if status == 413:
        message = "Request body is too large."
    return OpenAIError(status, message, code=code).to_response()


def handle_unexpected(_: Request, exc: Exception) -> Response[bytes]:
    log.exception("unhandled error", exc_info=exc)
    return OpenAIError(500, "The gateway hit an internal error.", code="internal_error").to_response()


exception_handlers = {
    OpenAIError: handle_openai_error,
    StoreError: handle_store_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
