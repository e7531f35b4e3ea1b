"""What the OpenAPI document (`/schema/openapi.json`) says beyond what Litestar reads from the handlers.

The handlers that take a body read it raw (`await request.body()`) and decode it themselves: chat because
it is the data path (one msgspec decode of the head, the rest passed to vLLM as sent), the others to give
OpenAI-shaped 400s that name the `param`. So Litestar sees no `data` parameter and would describe no request
body; and it describes errors in its own shape, not the `{"error": {...}}` the gateway sends. Here the
routes get both, through Litestar's route options only (`responses=`, `operation_class=`): nothing here runs
on a request.
"""

from __future__ import annotations

from typing import Any, cast

import msgspec
from litestar.openapi import ResponseSpec
from litestar.openapi.spec import (
    OpenAPIMediaType,
    OpenAPIResponse,
    Operation,
    Parameter,
    RequestBody,
    Schema,
)

from gateway.apis.chat.schema import MAX_N, MAX_TOP_LOGPROBS, ROLES
from gateway.rollouts import ROLLOUT_HEADER
from store.types import ID_PATTERN


class OpenAIErrorDetail(msgspec.Struct, frozen=True):
    message: str
    type: str  # invalid_request_error, not_found_error, server_error, ...
    param: str | None  # the offending field, e.g. "messages[0].role"
    code: str | None  # e.g. model_not_found, invalid_json, upstream_timeout


class OpenAIError(msgspec.Struct, frozen=True):
    """Every error the gateway answers, in OpenAI's shape (the OpenAI SDKs raise typed exceptions from it)."""

    error: OpenAIErrorDetail


class AnthropicErrorCode(msgspec.Struct, frozen=True):
    error_code: str  # thread_not_found, thread_fingerprint_mismatch


class AnthropicErrorDetail(msgspec.Struct, frozen=True):
    type: str  # invalid_request_error, not_found_error, api_error, overloaded_error, ...
    message: str
    details: AnthropicErrorCode | None = None  # where Anthropic's SDK branches on a code


class AnthropicError(msgspec.Struct, frozen=True):
    """The errors of `/v1/messages`, in Anthropic's shape (its SDK raises typed exceptions from it)."""

    type: str  # always "error"
    error: AnthropicErrorDetail


_WHEN = {
    400: "Invalid request: malformed JSON, a missing or invalid field (named in `param`)",
    401: "Missing or unknown API key (`Authorization: Bearer <key>` or `x-api-key`), or not the admin key",
    403: "The API key lacks the scope this endpoint needs (infer, reward, read), or a client key on an admin endpoint",
    404: "Unknown model, rollout, group or route, or one the API key does not cover",
    408: "The request head or body was not received in time (the connection is then closed)",
    409: "Conflicts with what exists (a rollout already in a group, a group id reused with other content, ...)",
    413: "Request body larger than --max-body-bytes",
    429: "The API key's requests or tokens per minute are used up: retry after `Retry-After` seconds",
    500: "The gateway hit an internal error (a bug: it is logged with its traceback)",
    502: "The engine failed, answered something unreadable, or is unreachable",
    503: "The engine is (re)starting, or the store is unavailable: retry shortly",
    504: "The engine did not answer within --request-timeout",
}


def errors(*statuses: int) -> dict[int, ResponseSpec]:
    """Route `responses=` for these error statuses, each with OpenAI's error body."""
    return {
        status: ResponseSpec(data_container=OpenAIError, description=_WHEN[status], generate_examples=False)
        for status in statuses
    }


def anthropic_errors(*statuses: int) -> dict[int, ResponseSpec]:
    """Route `responses=` for these error statuses, each with Anthropic's error body."""
    return {
        status: ResponseSpec(data_container=AnthropicError, description=_WHEN[status], generate_examples=False)
        for status in statuses
    }


def struct_schema(kind: type[msgspec.Struct]) -> dict[str, Any]:
    """msgspec's JSON Schema of a struct (the one the handler decodes with), its `$defs` inlined: Litestar
    rebuilds `components.schemas` from its own registry, so references to anything else would dangle."""
    schema = msgspec.json.schema(kind)
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return cast(dict[str, Any], inline(schema))


def _nullable(kind: str, **extra: Any) -> dict[str, Any]:
    return {"type": [kind, "null"], **extra}


# The OpenAI chat request: the fields the gateway itself reads and bounds (ChatRequestHead in
# gateway/apis/chat/schema.py) with its rules, and the usual others for clients' benefit. Anything else is allowed
# and passed to vLLM as sent (vLLM validates it; its 400s pass through). Written by hand: msgspec can't describe
# the head's Raw `parameters`, and the document should say more than the head checks.
CHAT_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {
            "type": "string",
            "minLength": 1,
            "description": "The trainable model (`my-agent`), a pinned step (`my-agent@7`), or the base model.",
        },
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"type": "string", "enum": sorted(ROLES)},
                    "content": {"type": ["string", "array", "null"]},
                    "name": {"type": "string"},
                    "tool_calls": {"type": "array", "items": {"type": "object"}},
                    "tool_call_id": {"type": "string"},
                },
                "additionalProperties": True,
            },
        },
        "stream": _nullable("boolean", default=False, description="Answer as server-sent events."),
        "stream_options": _nullable("object", properties={"include_usage": {"type": "boolean"}}),
        "n": _nullable("integer", minimum=1, maximum=MAX_N, default=1, description="Choices: a group of rollouts."),
        "tools": _nullable(
            "array",
            items={
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"type": "string", "enum": ["function"]},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1, "maxLength": 64},
                            "description": {"type": "string"},
                            "parameters": {"type": "object", "description": "a JSON Schema (checked: 400 if invalid)"},
                        },
                    },
                },
            },
        ),
        "tool_choice": {"description": "none, auto, required, or a named function"},
        "temperature": _nullable("number"),
        "top_p": _nullable("number"),
        "max_tokens": _nullable("integer", minimum=1),
        "max_completion_tokens": _nullable("integer", minimum=1),
        "stop": {"type": ["string", "array", "null"]},
        "seed": _nullable("integer"),
        "logprobs": _nullable("boolean", description="Return the sampled tokens' logprobs (always recorded)."),
        "top_logprobs": _nullable("integer", minimum=0, maximum=MAX_TOP_LOGPROBS),
        "return_token_ids": _nullable("boolean", description="vLLM's: return prompt and sampled token ids."),
    },
    "additionalProperties": True,
}

CHAT_EXAMPLE = {"model": "my-agent", "messages": [{"role": "user", "content": "Hi!"}]}

# The answer: OpenAI's chat.completion object (vLLM's, model name restored), or its chunks as SSE.
CHAT_COMPLETION: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string", "enum": ["chat.completion"]},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "message"],
                "properties": {
                    "index": {"type": "integer"},
                    "message": {"type": "object", "required": ["role"]},
                    "finish_reason": {"type": ["string", "null"]},
                },
            },
        },
        "usage": {"type": ["object", "null"]},
    },
    "additionalProperties": True,
}

ROLLOUT_HEADER_PARAMETER = Parameter(
    name=ROLLOUT_HEADER,
    param_in="header",
    required=False,
    # Ignored on /rollouts/{rollout_id}/v1/..., where the path gives it.
    schema=cast(Schema, {"type": "string", "pattern": ID_PATTERN}),
    description="The rollout this call belongs to (none: a one-call rollout with an id made up).",
)


IDEMPOTENCY_KEY_PARAMETER = Parameter(
    name="Idempotency-Key",
    param_in="header",
    required=False,
    schema=cast(Schema, {"type": "string"}),
    description="The group's id when the body gives no group_id (1 to 128 of letters, digits and `._:-`, else "
    "400): the same request again returns that group (200), other content with it is a 409.",
)


def _media(schema: dict[str, Any], example: Any = None) -> OpenAPIMediaType:
    # Litestar's serializer writes a dict as it is: a JSON Schema written by hand (or by msgspec) goes in
    # whole, without mirroring it in Litestar's Schema dataclasses.
    return OpenAPIMediaType(schema=cast(Schema, schema), example=example)


def documented(
    *,
    body: dict[str, Any] | None = None,
    example: Any = None,
    headers: tuple[Parameter, ...] = (),
    success: dict[str, OpenAPIMediaType] | None = None,
) -> type[Operation]:
    """A route's `operation_class=`: Litestar's operation plus a request body (a raw-read one Litestar can't
    see), header parameters, and the success response's content where one schema can't say it."""

    class DocumentedOperation(Operation):
        def __init__(self, **fields: Any) -> None:
            super().__init__(**fields)
            if body is not None:
                self.request_body = RequestBody(content={"application/json": _media(body, example)}, required=True)
            if headers:
                self.parameters = [*(self.parameters or ()), *headers]
            if success is not None:
                self.responses = {**(self.responses or {}), "200": OpenAPIResponse("OK", content=success)}

    return DocumentedOperation


chat_operation = documented(
    body=CHAT_REQUEST,
    example=CHAT_EXAMPLE,
    headers=(ROLLOUT_HEADER_PARAMETER,),
    success={
        "application/json": _media(CHAT_COMPLETION),
        "text/event-stream": _media(
            {"type": "string", "description": "`data: {chat.completion.chunk}` events, then `data: [DONE]`"}
        ),
    },
)

TOKEN_ID = {"type": "integer", "minimum": 0}

# The legacy completions request: the fields CompletionRequestHead (gateway/apis/completions/schema.py) reads
# and bounds.
COMPLETION_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        "model": CHAT_REQUEST["properties"]["model"],
        "prompt": {
            "description": "A string, a list of strings, a list of token ids, or a list of such lists.",
            "anyOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "items": {"type": "string"}},
                {"type": "array", "minItems": 1, "items": TOKEN_ID},
                {
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "array", "minItems": 1, "items": {"type": "integer"}},
                },
            ],
        },
        "stream": CHAT_REQUEST["properties"]["stream"],
        "n": _nullable("integer", minimum=1, maximum=MAX_N, default=1, description="Choices per prompt."),
        "max_tokens": _nullable("integer", minimum=1),
        "logprobs": _nullable("integer", minimum=0, maximum=MAX_TOP_LOGPROBS),
        "echo": _nullable("boolean"),
        "stop": {"type": ["string", "array", "null"]},
        "seed": _nullable("integer"),
        "temperature": _nullable("number"),
        "top_p": _nullable("number"),
    },
    "additionalProperties": True,
}

completions_operation = documented(
    body=COMPLETION_REQUEST,
    example={"model": "my-agent", "prompt": "Once upon a time"},
    headers=(ROLLOUT_HEADER_PARAMETER,),
    success={
        "application/json": _media({"type": "object", "required": ["id", "object", "choices"]}),
        "text/event-stream": _media({"type": "string", "description": "`data: {completion}` events, then [DONE]"}),
    },
)


def _loose_request(required: list[str], description: str, **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "required": required,
        "description": description,
        "properties": {"model": CHAT_REQUEST["properties"]["model"], **properties},
        "additionalProperties": True,
    }


# Responses and Messages requests: their own structs decode them (gateway/apis/); described here by their
# main fields, other fields allowed as the APIs define them.
responses_operation = documented(
    body=_loose_request(
        ["model", "input"],
        "OpenAI's Responses request, served through the engine's chat completions (recorded token-exactly).",
        input={"type": ["string", "array"]},
        instructions=_nullable("string"),
        tools=_nullable("array", items={"type": "object"}),
        previous_response_id=_nullable("string"),
        store=_nullable("boolean", default=True),
        stream=CHAT_REQUEST["properties"]["stream"],
        max_output_tokens=_nullable("integer", minimum=1),
    ),
    example={"model": "my-agent", "input": "Hi!"},
    headers=(ROLLOUT_HEADER_PARAMETER,),
    success={
        "application/json": _media({"type": "object", "required": ["id", "object", "output"]}),
        "text/event-stream": _media({"type": "string", "description": "Responses events, `response.completed` last"}),
    },
)

messages_operation = documented(
    body=_loose_request(
        ["model", "messages", "max_tokens"],
        "Anthropic's Messages request, served through the engine's chat completions (recorded token-exactly). "
        "Errors on this route are in Anthropic's shape: {type: error, error: {type, message}}.",
        messages={"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"]}},
        max_tokens={"type": "integer", "minimum": 1},
        system={"type": ["string", "array", "null"]},
        tools=_nullable("array", items={"type": "object"}),
        stream=CHAT_REQUEST["properties"]["stream"],
        thread={
            "type": ["object", "null"],
            "description": 'A message thread: {type: "create"}, or {type: "continue", previous_message_id} with only '
            "the new messages and no system or tools (the key's own thread, from the gateway's store).",
            "required": ["type"],
            "properties": {"type": {"enum": ["create", "continue"]}, "previous_message_id": {"type": "string"}},
        },
    ),
    example={"model": "my-agent", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi!"}]},
    headers=(ROLLOUT_HEADER_PARAMETER,),
    success={
        "application/json": _media({"type": "object", "required": ["id", "type", "content"]}),
        "text/event-stream": _media({"type": "string", "description": "Anthropic's events, `message_stop` last"}),
    },
)


count_tokens_operation = documented(
    body=_loose_request(
        ["model", "messages"],
        "Anthropic's token count: the Messages request's fields (no max_tokens), counted by the engine's chat "
        "template and tokenizer through the same translation as /v1/messages. Nothing is recorded.",
        messages={"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"]}},
        system={"type": ["string", "array", "null"]},
        tools=_nullable("array", items={"type": "object"}),
    ),
    example={"model": "my-agent", "messages": [{"role": "user", "content": "Hi!"}]},
    headers=(),
    success={
        "application/json": _media(
            {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": {"type": "integer"}}}
        )
    },
)
