"""The inference endpoints' handlers: chat, completions, Responses, Anthropic Messages. Thin: parse, call the
API's service, return its bare ASGI answer (gateway/asgi.py).

Every answer of an inference call carries its rollout id (`X-ART-Rollout-Id`), errors included, so a client
that let the gateway make one up still learns it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.exceptions import HTTPException
from litestar.params import Parameter
from litestar.types import ASGIApp

from gateway.apis.chat.service import ChatService
from gateway.apis.completions.service import CompletionsService
from gateway.apis.messages.schema import AnthropicError, from_openai_error
from gateway.apis.messages.service import MessagesService
from gateway.apis.responses.service import MAX_ITEMS_PAGE, ResponsesService
from gateway.asgi import EventStream, HangUp, JSONBody, hang_up_of
from gateway.auth import Caller, KeyRing
from gateway.errors import OpenAIError, from_http_exception, from_store_error
from gateway.guards import STORED
from gateway.openapi import (
    anthropic_errors,
    chat_operation,
    completions_operation,
    count_tokens_operation,
    errors,
    messages_operation,
    responses_operation,
)
from gateway.proxy import CallOrigin, call_origin
from gateway.rollouts import ROLLOUT_HEADER
from gateway.services import services_of
from gateway.tracing import trace_context
from store.errors import StoreError

Create = Callable[[bytes, CallOrigin, HangUp | None], Awaitable[JSONBody | EventStream]]
INFERENCE_ERRORS = errors(400, 401, 403, 404, 408, 409, 413, 429, 500, 502, 503, 504)


async def answer(create: Create, request: Request[Any, Any, Any], rollout_id: str | None) -> ASGIApp:
    """One inference call: its key (401, 403, 429 before anything else), its rollout (path prefix, header, or
    made up), then the API's service."""
    keys: KeyRing = services_of(request.app.state).keyring
    caller = keys.caller(request.headers)
    caller.check_scope("infer")
    keys.limits.admit(caller)
    origin = call_origin(request.headers.get(ROLLOUT_HEADER), rollout_id, caller, trace_context(request.headers))
    try:
        try:
            body = await request.body()
        except HTTPException as exc:  # too large (Litestar's): as the API's own errors, with the rollout id
            raise from_http_exception(request, exc) from None
        return await create(body, origin, hang_up_of(request.scope))
    except StoreError as exc:  # a stored response that isn't there, say
        error = from_store_error(exc)
        error.headers = {ROLLOUT_HEADER: origin.rollout_id}
        raise error from None
    except (OpenAIError, AnthropicError) as exc:
        exc.headers = {**(exc.headers or {}), ROLLOUT_HEADER: origin.rollout_id}  # and its own (Retry-After)
        raise


@post(
    ["/v1/chat/completions", "/rollouts/{rollout_id:str}/v1/chat/completions"],
    status_code=200,
    # The body is read raw (the data path): its schema, the SSE answer and the errors are described here.
    operation_class=chat_operation,
    responses=INFERENCE_ERRORS,
)
async def chat_completions(request: Request[Any, Any, Any], rollout_id: str | None = None) -> ASGIApp:
    # The data path: the service is taken from the app's state rather than through Litestar's DI (~12 µs a
    # call measured), and the answer is a bare ASGI app (gateway/asgi.py), no framework work after it.
    chat: ChatService = services_of(request.app.state).chat
    return await answer(chat.complete, request, rollout_id)


@post(
    ["/v1/completions", "/rollouts/{rollout_id:str}/v1/completions"],
    status_code=200,
    operation_class=completions_operation,
    responses=INFERENCE_ERRORS,
)
async def completions(request: Request[Any, Any, Any], rollout_id: str | None = None) -> ASGIApp:
    service: CompletionsService = services_of(request.app.state).completions
    return await answer(service.complete, request, rollout_id)


@post(
    ["/v1/responses", "/rollouts/{rollout_id:str}/v1/responses"],
    status_code=200,
    operation_class=responses_operation,
    responses=INFERENCE_ERRORS,
)
async def create_response(request: Request[Any, Any, Any], rollout_id: str | None = None) -> ASGIApp:
    service: ResponsesService = services_of(request.app.state).responses
    return await answer(service.create, request, rollout_id)


RESPONSE_PATHS = ["/v1/responses/{response_id:str}", "/rollouts/{rollout_id:str}/v1/responses/{response_id:str}"]


@get(RESPONSE_PATHS, responses=errors(400, 401, 403, 404, 500, 503), **STORED)
async def get_response(
    responses: ResponsesService, caller: Caller, response_id: str, rollout_id: str | None = None
) -> dict[str, Any]:
    return await responses.get(response_id, caller)


@delete(RESPONSE_PATHS, status_code=200, responses=errors(400, 401, 403, 404, 500, 503), **STORED)
async def delete_response(
    responses: ResponsesService, caller: Caller, response_id: str, rollout_id: str | None = None
) -> dict[str, Any]:
    return await responses.delete(response_id, caller)


@get([path + "/input_items" for path in RESPONSE_PATHS], responses=errors(400, 401, 403, 404, 500, 503), **STORED)
async def list_input_items(
    responses: ResponsesService,
    caller: Caller,
    response_id: str,
    rollout_id: str | None = None,
    limit: int = Parameter(default=20, schema_extra={"minimum": 1, "maximum": MAX_ITEMS_PAGE}),
    order: str = Parameter(default="desc", schema_extra={"enum": ["asc", "desc"]}),
    after: str | None = None,
) -> dict[str, Any]:
    return await responses.input_items(response_id, limit=limit, order=order, after=after, caller=caller)


def _anthropic_response(exc: AnthropicError) -> Response[bytes]:
    return Response(
        msgspec.json.encode(exc.body()),
        status_code=exc.status,
        media_type="application/json",
        headers=exc.headers,
    )


def _in_anthropic_shape(exc: OpenAIError) -> Response[bytes]:
    error = from_openai_error(exc)
    error.headers = exc.headers
    return _anthropic_response(error)


@post(
    ["/v1/messages", "/rollouts/{rollout_id:str}/v1/messages"],
    status_code=200,
    operation_class=messages_operation,
    responses=anthropic_errors(400, 401, 403, 404, 408, 409, 413, 429, 500, 502, 503, 504),
)
async def create_message(request: Request[Any, Any, Any], rollout_id: str | None = None) -> ASGIApp:
    """Anthropic's Messages API: every error on this route in Anthropic's shape."""
    service: MessagesService = services_of(request.app.state).messages
    try:
        return await answer(service.create, request, rollout_id)
    # Litestar answers a Response returned by value (to_response checks each return's type); the annotation
    # stays ASGIApp so that the engine's answers (JSONBody, EventStream) go out as they are.
    except AnthropicError as exc:
        return _anthropic_response(exc)  # type: ignore[return-value]
    except OpenAIError as exc:
        return _in_anthropic_shape(exc)  # type: ignore[return-value]


@post(
    ["/v1/messages/count_tokens", "/rollouts/{rollout_id:str}/v1/messages/count_tokens"],
    status_code=200,
    operation_class=count_tokens_operation,
    responses=anthropic_errors(400, 401, 403, 404, 413, 500, 502, 503, 504),
)
async def count_message_tokens(request: Request[Any, Any, Any], rollout_id: str | None = None) -> Response[bytes]:
    """Anthropic's token count (`client.messages.count_tokens`): the engine's count of the prompt a Messages
    request would send it. A key with `infer` may ask; nothing is recorded, and no rate limit is charged."""
    services = services_of(request.app.state)
    try:
        caller = services.keyring.caller(request.headers)
        caller.check_scope("infer")
        try:
            body = await request.body()
        except HTTPException as exc:
            raise from_http_exception(request, exc) from None
        counted = await services.messages.count_tokens(body, caller)
    except AnthropicError as exc:
        return _anthropic_response(exc)
    except OpenAIError as exc:
        return _in_anthropic_shape(exc)
    return Response(msgspec.json.encode(counted), media_type="application/json")


def under_messages(path: str) -> bool:
    """Is `path` under /v1/messages (its errors in Anthropic's shape)?"""
    return (
        path == "/v1/messages" or path.startswith("/v1/messages/") or "/v1/messages" in path.partition("/rollouts/")[2]
    )


def handle_http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    """Litestar's own errors (an unknown path, a wrong method, a body too large): in Anthropic's shape under
    `/v1/messages` (Anthropic's SDK reads no other), OpenAI's elsewhere."""
    error = from_http_exception(request, exc)
    if under_messages(request.url.path):
        return _in_anthropic_shape(error)
    return error.to_response()


routes = [
    chat_completions,
    completions,
    create_response,
    get_response,
    delete_response,
    list_input_items,
    create_message,
    count_message_tokens,
]
