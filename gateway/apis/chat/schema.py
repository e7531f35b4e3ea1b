"""Chat completions: validate, route to vLLM, give the client what it asked for (gateway/proxy.py records it).

The gateway always asks vLLM for the sampled token ids, the prompt token ids
and the sampling logprobs (the recorder needs them), then hands the client a
response shaped exactly as if it had called vLLM with its own request: the
fields it did not ask for are set back to null, as vLLM does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for

from gateway.adapters import Route
from gateway.asgi import EventStream, HangUp, JSONBody
from gateway.errors import OpenAIError, decode_body, decode_json, invalid_request
from gateway.proxy import CHAT_PATH, CallOrigin, EngineCalls, EngineRequest

_decode = msgspec.json.decode
_encode = msgspec.json.encode

# OpenAI's roles; vLLM would render any other into the prompt as text.
ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
MAX_N = 128  # choices per call: each is a full generation, so one request could otherwise occupy the engine
MAX_TOP_LOGPROBS = 20  # OpenAI's cap, and vLLM's default --max-logprobs


class ChatMessageHead(msgspec.Struct, frozen=True):
    role: str  # checked against ROLES by hand: OpenAI's message names the supported values


class FunctionHead(msgspec.Struct, frozen=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    # Kept as the bytes sent: the schema check is cached by them, and agents send the same tools every call.
    parameters: msgspec.Raw = msgspec.Raw()


class ToolHead(msgspec.Struct, frozen=True):
    type: Literal["function"]
    function: FunctionHead


class ChatRequestHead(msgspec.Struct, frozen=True):
    """The fields of a chat request the gateway itself relies on or bounds. The rest goes to vLLM as sent
    (unknown fields are kept, not dropped): vLLM validates them and its 400s pass through."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    messages: Annotated[list[ChatMessageHead], msgspec.Meta(min_length=1)]
    stream: bool | None = False
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = 1
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ToolHead] | None = None


_head_decoder = msgspec.json.Decoder(ChatRequestHead)
_request_decoder: msgspec.json.Decoder[dict[str, Any]] = msgspec.json.Decoder(dict)


def parse_chat_request(body: bytes) -> tuple[ChatRequestHead, dict[str, Any]]:
    """The typed head (400 naming the param if it is wrong) and the whole request as sent."""
    head = decode_body(body, ChatRequestHead, _head_decoder)  # nesting depth checked here, once
    request = decode_json(body, dict, _request_decoder)
    for i, message in enumerate(head.messages):
        if message.role not in ROLES:
            raise invalid_request(
                f"Invalid value: '{message.role}'. Supported values are: 'system', 'assistant', 'user', "
                "'function', 'tool', and 'developer'.",
                param=f"messages[{i}].role",
                code="invalid_value",
            )
    for i, tool in enumerate(head.tools or ()):
        problem = schema_problem(bytes(tool.function.parameters))
        if problem is not None:
            raise invalid_request(
                f"Invalid schema for function '{tool.function.name}': {problem}",
                param=f"tools[{i}].function.parameters",
                code="invalid_function_parameters",
            )
    return head, request


@functools.lru_cache(maxsize=1024)
def schema_problem(raw: bytes) -> str | None:
    """What is wrong with a tool's `parameters` (None: a valid JSON Schema object, or none given). Cached by the
    encoded schema: agents send the same tools on every call. Every API's tools are checked by it."""
    if raw in (b"", b"null"):
        return None
    schema = _decode(raw)
    if not isinstance(schema, dict):
        return "parameters must be a JSON Schema object."
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"{exc.message}" + (f" (at '{where}')." if where else ".")
    return None


@dataclass(frozen=True, slots=True)
class Asked:
    """What the client asked for among the fields the gateway always requests."""

    logprobs: bool
    token_ids: bool


def strict_forced_calls(request: dict[str, Any]) -> dict[str, Any]:
    """The request with the tools a named or `required` tool_choice forces made `strict`: their arguments are
    then sampled under the tool's schema. Without it vLLM 0.32 constrains only the `<tool_call>` envelope and the
    arguments may be any JSON (a model still learning writes a number), which most clients send by default.
    The request is recorded as changed (the trainer rebuilds the grammar the engine sampled under from it)."""
    tools = request.get("tools")
    choice = request.get("tool_choice")
    if not tools or not (choice == "required" or isinstance(choice, dict)):
        return request
    forced = None if choice == "required" else (choice.get("function") or {}).get("name")
    strict = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and forced in (None, function.get("name")) and function.get("strict") is not True:
            tool = {**tool, "function": {**function, "strict": True}}
        strict.append(tool)
    return {**request, "tools": strict}


def upstream_request(request: dict[str, Any], route: Route, **extra: Any) -> tuple[bytes, Asked]:
    """The engine's request: the client's, for the routed model, asking for what the recorder needs."""
    asked = Asked(bool(request.get("logprobs")), bool(request.get("return_token_ids")))
    upstream = dict(request)
    if upstream.get("tools") == []:  # no tools (strands' and fast-agent's default): vLLM refuses an empty list
        del upstream["tools"]
        if upstream.get("tool_choice") in ("auto", "none"):  # what no tools means anyway; refused without tools
            del upstream["tool_choice"]
    upstream["model"] = route.upstream_model
    upstream["logprobs"] = True
    upstream["return_token_ids"] = True
    upstream.update(extra)
    return _encode(upstream), asked


def hide_unasked(payload: dict[str, Any], asked: Asked, model: str) -> None:
    """Undo what the gateway added, in place: null, as vLLM sends fields nobody asked for."""
    payload["model"] = model
    if not asked.token_ids:
        if "prompt_token_ids" in payload:
            payload["prompt_token_ids"] = None
        for choice in payload.get("choices") or ():
            if "token_ids" in choice:
                choice["token_ids"] = None
    if not asked.logprobs:
        for choice in payload.get("choices") or ():
            choice["logprobs"] = None


class ChatWire:
    """Chat's own format, minus what the client did not ask for."""

    __slots__ = ("asked", "model")

    def __init__(self, asked: Asked, model: str) -> None:
        self.asked = asked
        self.model = model

    async def answer(self, payload: dict[str, Any]) -> bytes:
        hide_unasked(payload, self.asked, self.model)
        return _encode(payload)

    def event(self, event: dict[str, Any]) -> bytes:
        hide_unasked(event, self.asked, self.model)
        return b"data: " + _encode(event) + b"\n\n"

    async def done(self) -> bytes:
        return b"data: [DONE]\n\n"

    def broken(self, error: OpenAIError) -> bytes:
        """OpenAI's error body as the last event (code `upstream_error` when the engine is at fault)."""
        return b"data: " + _encode(error.body()) + b"\n\n"


class ChatService:
    """Chat completions: parse, route, and hand the call to the engine (gateway/proxy.py)."""

    def __init__(self, calls: EngineCalls) -> None:
        self.calls = calls
        self.registry = calls.registry

    async def complete(self, body: bytes, origin: CallOrigin, hang_up: HangUp | None = None) -> JSONBody | EventStream:
        head, request = parse_chat_request(body)
        request = strict_forced_calls(request)
        route = await self.calls.route(head.model, origin)
        upstream_body, asked = upstream_request(request, route)
        wire = ChatWire(asked, head.model)
        spec = EngineRequest("chat", CHAT_PATH, upstream_body, request, route, bool(head.stream), wire)
        return await self.calls.run(spec, origin, hang_up)
