"""Chat completions: validate, route to vLLM, give the client what it asked for, record the call.

The gateway always asks vLLM for the sampled token ids, the prompt token ids
and the sampling logprobs (the recorder needs them), then hands the client a
response shaped exactly as if it had called vLLM with its own request: the
fields it did not ask for are set back to null, as vLLM does.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import aiohttp
import anyio
import msgspec
from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for

from gateway.adapters import AdapterRegistry, Route
from gateway.asgi import EventStream, HangUpWatch, JSONBody, Receive
from gateway.engine import EngineState
from gateway.errors import OpenAIError, decode_body, decode_json, invalid_request
from gateway.metrics import GatewayMetrics
from gateway.recorder import Recorder
from store.records import CallRecord, CallStatus, ChoiceRecord

ROLLOUT_HEADER = "X-ART-Rollout-Id"
_ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")

_decode = msgspec.json.decode
_encode = msgspec.json.encode


@dataclass(frozen=True, slots=True)
class RolloutKey:
    rollout_id: str
    explicit: bool  # False when the gateway made the id up


def rollout_key(header: str | None, path_id: str | None) -> RolloutKey:
    """The rollout a call belongs to: the path prefix wins over the header; neither → a new id."""
    given = path_id if path_id is not None else header
    if given is None:
        return RolloutKey(f"r-{uuid.uuid4().hex}", explicit=False)
    if not _ROLLOUT_ID.match(given):
        raise invalid_request(
            "Invalid rollout id: use 1 to 128 characters from letters, digits and `._:-`, "
            "starting with a letter or digit.",
            param=ROLLOUT_HEADER,
            code="invalid_rollout_id",
        )
    return RolloutKey(given, explicit=True)


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
        problem = _schema_problem(bytes(tool.function.parameters))
        if problem is not None:
            raise invalid_request(
                f"Invalid schema for function '{tool.function.name}': {problem}",
                param=f"tools[{i}].function.parameters",
                code="invalid_function_parameters",
            )
    return head, request


@functools.lru_cache(maxsize=1024)
def _schema_problem(raw: bytes) -> str | None:
    """What is wrong with a tool's `parameters` (None: a valid JSON Schema object, or none given)."""
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
class _Asked:
    """What the client asked for among the fields the gateway always requests."""

    logprobs: bool
    token_ids: bool


def _upstream_body(request: dict[str, Any], route: Route) -> tuple[bytes, _Asked]:
    asked = _Asked(bool(request.get("logprobs")), bool(request.get("return_token_ids")))
    upstream = dict(request)
    upstream["model"] = route.upstream_model
    upstream["logprobs"] = True
    upstream["return_token_ids"] = True
    return _encode(upstream), asked


def _hide_unasked(payload: dict[str, Any], asked: _Asked, model: str) -> None:
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


# What reading a malformed engine answer raises: not JSON, or JSON without the fields vLLM always sends.
ENGINE_DATA_ERRORS = (msgspec.DecodeError, KeyError, TypeError, AttributeError, ValueError, IndexError)


def _sampled_logprobs(choice: dict[str, Any]) -> list[float]:
    logprobs = choice.get("logprobs") or {}
    return [entry["logprob"] for entry in logprobs.get("content") or ()]


def _upstream_error(status: int, body: bytes) -> OpenAIError:
    """vLLM's error body, re-shaped as OpenAI's (vLLM puts an int in `code`)."""
    message, param = f"The engine answered {status}.", None
    try:
        err = _decode(body).get("error") or {}
        message = err.get("message") or message
        param = err.get("param")
    except Exception:
        pass
    if status >= 500:
        return OpenAIError(502, f"Upstream engine error: {message}", code="upstream_error")
    return OpenAIError(status, message, param=param)


def _upstream_error_event(message: str) -> bytes:
    """The SSE event that ends a stream the engine broke off: OpenAI's error body, code `upstream_error`."""
    return b"data: " + _encode(OpenAIError(502, message, code="upstream_error").body()) + b"\n\n"


_JSON_HEADERS = {"content-type": "application/json"}
EngineStateOf = Callable[[], EngineState]


@dataclass
class _StreamedChoice:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def add(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            self.content.append(delta["content"])
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            self.reasoning.append(reasoning)
        for call in delta.get("tool_calls") or ():
            slot = self.tool_calls.setdefault(
                call.get("index", 0),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if call.get("id"):
                slot["id"] = call["id"]
            function = call.get("function") or {}
            if function.get("name"):
                slot["function"]["name"] += function["name"]
            if function.get("arguments"):
                slot["function"]["arguments"] += function["arguments"]
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        if choice.get("token_ids"):
            self.token_ids.extend(choice["token_ids"])
        self.logprobs.extend(_sampled_logprobs(choice))

    def record(self, index: int) -> ChoiceRecord:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            message["reasoning"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return ChoiceRecord(index, message, self.finish_reason, self.token_ids, self.logprobs)


def _choice_record(choice: dict[str, Any]) -> ChoiceRecord:
    message = {k: v for k, v in (choice.get("message") or {}).items() if v is not None}
    return ChoiceRecord(
        choice.get("index", 0),
        message,
        choice.get("finish_reason"),
        list(choice.get("token_ids") or ()),
        _sampled_logprobs(choice),
    )


class ChatService:
    """Forwards chat completions to the engine and records each call."""

    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        upstream_url: str,
        request_timeout: float,
        registry: AdapterRegistry,
        recorder: Recorder,
        engine_state: EngineStateOf,
        metrics: GatewayMetrics,
    ) -> None:
        self.metrics = metrics
        # aiohttp on the data path: httpx's connection pool rescans every connection per request
        # (quadratic; encode/httpx#3215) and collapses at a few hundred concurrent calls.
        self.session = session
        self.chat_url = f"{upstream_url}/v1/chat/completions"
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=request_timeout)
        self.registry = registry
        self.recorder = recorder
        self.engine_state = engine_state

    async def complete(self, body: bytes, key: RolloutKey, receive: Receive | None = None) -> JSONBody | EventStream:
        """Answer one chat request. `receive` (the request's ASGI receive, body already read) lets a non-streamed
        call notice the client hanging up while the engine works: the engine's request is then closed (vLLM
        aborts it) and the call recorded `cancelled`, never trainable."""
        head, request = parse_chat_request(body)
        route = self.registry.resolve(head.model)
        upstream_body, asked = _upstream_body(request, route)
        stream = bool(head.stream)
        # Accepted: from here on, every path records this call exactly once.
        call = _Call(self, key, route, request, stream, time.time())
        self.recorder.begin(key.rollout_id)
        self.metrics.call_started(call.label)
        if stream or receive is None:
            return await self._answer(call, upstream_body, asked, head.model)
        # The relay of a stream watches for a hang-up itself (gateway/asgi.py); a plain answer is watched here.
        hang_up = HangUpWatch(receive)
        try:
            return await self._answer(call, upstream_body, asked, head.model, hang_up)
        except asyncio.CancelledError:
            if not hang_up.gone:
                raise  # not the client: the server is stopping this task
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            await call.finish("cancelled", 499, "the client hung up before the answer")
            return JSONBody(b"", {ROLLOUT_HEADER: key.rollout_id}, status=499)  # nobody reads it
        finally:
            hang_up.stop()

    async def _answer(
        self,
        call: _Call,
        upstream_body: bytes,
        asked: _Asked,
        model: str,
        hang_up: HangUpWatch | None = None,
    ) -> JSONBody | EventStream:
        key = call.key
        try:
            upstream = await self.session.post(
                self.chat_url, data=upstream_body, headers=_JSON_HEADERS, timeout=self.timeout
            )
        except BaseException as exc:
            error = self._send_error(exc)
            if error is not None:
                await call.finish("upstream_error", error.status, error.message)
                raise error from None
            if isinstance(exc, Exception):  # the gateway's own bug: a 500 with its traceback logged, not a 502
                await call.finish("internal_error", 500, f"gateway error: {type(exc).__name__}")
            else:  # cancelled: the client (or a shutdown) gave up on the call
                await call.finish("cancelled", 499, "cancelled before the engine answered")
            raise
        headers = {ROLLOUT_HEADER: key.rollout_id}
        if upstream.status != 200:
            try:
                payload = await upstream.read()
            except aiohttp.ClientError:
                payload = b""
            finally:
                upstream.release()
            error = _upstream_error(upstream.status, payload)
            # The engine's 4xx is the client's mistake (a bad option): passed through and counted as such,
            # not as an engine fault.
            await call.finish("client_error" if error.status < 500 else "upstream_error", error.status, error.message)
            raise error
        if call.stream:
            relay = call.relay(upstream, asked, model)
            # Starting the relay here means its `finally` (which records the call) is guaranteed to run,
            # even if the client is gone before the response starts: asyncio closes started generators.
            # The relay yields at least one event (the engine's first, or an error event) and records the call
            # in its `finally`, which runs even if the client is gone before the response begins.
            return EventStream(await anext(relay), relay, headers)
        try:
            payload = _decode(await upstream.read())
            if hang_up is not None:
                # From here on nothing waits, so no hang-up can cut in: the answer is whole and is recorded `ok`.
                hang_up.stop()
            choices = [_choice_record(c) for c in payload.get("choices") or ()]
            prompt_ids = payload.get("prompt_token_ids") or []
            _hide_unasked(payload, asked, model)
        except asyncio.CancelledError:
            upstream.close()  # dropping the connection is how vLLM learns to abort the request
            raise
        except ENGINE_DATA_ERRORS as exc:  # the engine's answer, not the gateway's code: a 502
            await call.finish("upstream_error", 502, f"unreadable engine answer: {type(exc).__name__}: {exc}")
            raise OpenAIError(502, "The engine sent an unreadable answer.", code="upstream_error") from None
        await call.finish("ok", 200, None, prompt_ids, choices, payload.get("usage"))
        return JSONBody(_encode(payload), headers)

    def _send_error(self, exc: BaseException) -> OpenAIError | None:
        """The client-facing error for a failed send to the engine; None when the engine is not at fault."""
        if isinstance(exc, TimeoutError):  # aiohttp's timeouts are TimeoutErrors
            return OpenAIError(504, "The engine did not answer in time.", code="upstream_timeout")
        if isinstance(exc, aiohttp.ClientError | OSError):
            return self._unreachable(exc)
        return None  # cancellation, or a bug of the gateway's own: not the engine's fault

    def _unreachable(self, exc: Exception) -> OpenAIError:
        state = self.engine_state()
        if state in ("starting", "restarting"):
            return OpenAIError(
                503, f"The engine is {state}; retry shortly.", type="server_error", code="engine_unavailable"
            )
        return OpenAIError(502, f"The engine is unreachable ({type(exc).__name__}).", code="upstream_unreachable")


class _Call:
    """One call in flight: relays a stream and builds the record when the call ends."""

    def __init__(
        self,
        service: ChatService,
        key: RolloutKey,
        route: Route,
        request: dict[str, Any],
        stream: bool,
        started: float,
    ) -> None:
        self.service = service
        self.key = key
        self.route = route
        self.request = request
        self.stream = stream
        self.started = started
        self.first_token_at: float | None = None
        self.recorded = False  # exactly once: whichever path ends the call first records it
        self.label = route.model or route.upstream_model  # the metrics' model label

    async def finish(
        self,
        status: CallStatus,
        http_status: int,
        error: str | None,
        prompt_ids: list[int] | None = None,
        choices: list[ChoiceRecord] | None = None,
        usage: dict[str, Any] | None = None,
    ) -> None:
        if self.recorded:
            return
        self.recorded = True
        ended = time.time()
        record = CallRecord(
            call_id=uuid.uuid4().hex,
            rollout_id=self.key.rollout_id,
            rollout_explicit=self.key.explicit,
            model=self.route.model,
            step=self.route.step,
            upstream_model=self.route.upstream_model,
            request=self.request,
            stream=self.stream,
            status=status,
            http_status=http_status,
            error=error,
            prompt_token_ids=prompt_ids or [],
            choices=choices or [],
            usage=usage,
            started_at=self.started,
            first_token_at=self.first_token_at if self.stream else ended,
            ended_at=ended,
        )
        self.service.metrics.call_ended(self.label, record)
        await self.service.recorder.submit(record)

    async def relay(self, upstream: aiohttp.ClientResponse, asked: _Asked, model: str) -> AsyncGenerator[bytes]:
        """Pass vLLM's SSE events on, minus what the client did not ask for.

        Whatever the engine has sent by the time the gateway reads goes on as one write: events that
        arrive together (the role and the first token, a burst under load) cost one syscall, not one each.
        A client that goes away cancels this generator; closing the upstream response then closes the
        connection, and vLLM aborts the request.
        """
        stream = _Stream(asked, model)
        pending = b""
        recorded = False  # exactly once: at the engine's [DONE], else in `finally`
        try:
            async for data in upstream.content.iter_any():
                *lines, pending = (pending + data).split(b"\n")
                out = [event for line in lines if (event := stream.take(line, self)) is not None]
                if stream.done and not recorded:
                    # [DONE] is the client's end of answer: the call is journaled before the client gets it,
                    # so an answered call survives a crash of the gateway (gateway/journal.py).
                    recorded = True
                    with anyio.CancelScope(shield=True):
                        await self._record_stream(stream)
                if out:
                    yield b"".join(out)
                if stream.broken:  # its error event is out; the engine's request is closed in `finally`
                    break
            if pending and (event := stream.take(pending, self)) is not None:
                if stream.done and not recorded:
                    recorded = True
                    with anyio.CancelScope(shield=True):
                        await self._record_stream(stream)
                yield event
            if stream.status == "cancelled":  # the engine closed the stream without its [DONE]
                stream.status, stream.error = "upstream_error", "the engine ended the stream early"
                yield _upstream_error_event("The engine ended the stream early.")
        except (aiohttp.ClientError, TimeoutError) as exc:
            stream.status, stream.error = "upstream_error", f"engine connection lost: {type(exc).__name__}"
            yield _upstream_error_event("The engine connection was lost mid-stream.")
        finally:
            # Shielded: a client that went away cancels this generator's scope, and the
            # upstream close and the record must still happen.
            with anyio.CancelScope(shield=True):
                # Closing (not releasing) an unfinished response drops the connection: vLLM aborts.
                if stream.status == "ok":
                    upstream.release()
                else:
                    upstream.close()
                if not recorded:
                    await self._record_stream(stream)

    async def _record_stream(self, stream: _Stream) -> None:
        """Record the streamed call (once per call: see `relay`)."""
        records = [stream.choices[i].record(i) for i in sorted(stream.choices)]
        http_status = 200 if stream.status != "cancelled" else 499
        await self.finish(stream.status, http_status, stream.error, stream.prompt_ids, records, stream.usage)


@dataclass
class _Stream:
    """What a streamed call has sent so far, and its outcome (`cancelled` until the engine's [DONE])."""

    asked: _Asked
    model: str
    choices: dict[int, _StreamedChoice] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    status: CallStatus = "cancelled"
    error: str | None = None
    done: bool = False  # the engine's [DONE] came: the call is over, its record goes before the client's [DONE]
    broken: bool = False  # the engine sent a line the gateway cannot read: the stream ends there

    def take(self, line: bytes, call: _Call) -> bytes | None:
        """One line of the engine's SSE stream -> the bytes the client gets for it (None: nothing). A line that is
        not what vLLM sends ends the stream: an error event, and nothing after it (`broken`)."""
        if self.broken:
            return None
        try:
            return self._take(line, call)
        except ENGINE_DATA_ERRORS as exc:
            self.broken = True
            self.status, self.error = "upstream_error", f"unreadable engine event: {type(exc).__name__}: {exc}"
            return _upstream_error_event("The engine sent an event the gateway cannot read.")

    def _take(self, line: bytes, call: _Call) -> bytes | None:
        if not line.startswith(b"data: "):
            return None
        data = line[6:].rstrip()
        if data == b"[DONE]":
            self.done = True
            if self.status == "cancelled":  # vLLM sends [DONE] after an error event too: the error stands
                self.status = "ok"
            return b"data: [DONE]\n\n"
        event = _decode(data)
        if "error" in event and "choices" not in event:
            self.status, self.error = "upstream_error", str((event.get("error") or {}).get("message"))
            # vLLM's error event (e.g. its engine core died) has its HTTP status as an int `code`: re-shaped
            # as the gateway's own errors are, code `upstream_error` for a 5xx.
            code = event["error"].get("code") if isinstance(event["error"], dict) else None
            shaped = _upstream_error(code if isinstance(code, int) and code >= 400 else 500, data)
            return b"data: " + _encode(shaped.body()) + b"\n\n"
        if call.first_token_at is None:
            call.first_token_at = time.time()
        if event.get("prompt_token_ids"):
            self.prompt_ids = event["prompt_token_ids"]
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            self.choices.setdefault(choice.get("index", 0), _StreamedChoice()).add(choice)
        _hide_unasked(event, self.asked, self.model)
        return b"data: " + _encode(event) + b"\n\n"
