"""The engine call every API shares: send to vLLM, answer or relay, watch for a hang-up, record exactly once.

Each API the gateway speaks (chat, completions, Responses, Anthropic Messages) parses its own request and
builds the engine request: chat completions, or completions, always asking for the prompt token ids, the
sampled token ids and their logprobs, which is what the recorder keeps. Its `Wire` then turns the engine's
answer, or each event of its stream, into what that API's client expects. The record is built from the
engine's own answer, so every API is recorded token for token the same way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import aiohttp
import anyio
import msgspec
import tenacity
from opentelemetry.trace import Span

from engine.answers import Answer, AnswerChoice, EngineAnswerError, ErrorBody, read
from engine.pool import Engine, EnginePool
from engine.supervisor import EngineState
from gateway.adapters import AdapterRegistry, Pin, Route, adapter_name
from gateway.asgi import EventStream, HangUp, JSONBody
from gateway.auth import Caller, RateLimits
from gateway.continuation import (
    GENERATE_PATH,
    Continuations,
    DerenderedStream,
    DerenderFailed,
    Served,
    Splice,
    Splicer,
    message_digests,
)
from gateway.errors import OpenAIError, invalid_request
from gateway.metrics import GatewayMetrics
from gateway.rollouts import ROLLOUT_HEADER, RolloutOwners
from gateway.tracing import CallTracer
from recording.recorder import Recorder, RecordingUnavailable
from store.records import Api, CallRecord, CallStatus, ChoiceRecord, RolloutKey
from store.types import ROLLOUT_ID

# The promotion gate's own calls (gateway/promotion/): recorded like any call, never part of a group, and
# a prefix no client may use.
EVAL_ROLLOUT_PREFIX = "artgw-eval:"
CHAT_PATH = "/v1/chat/completions"  # the engine endpoint of chat, Responses and Messages: a call there may continue
RECORDING_RETRY_SECONDS = 5  # Retry-After of a call refused because the journal cannot take it
log = logging.getLogger("artgw.gateway")

_decode = msgspec.json.decode
_encode = msgspec.json.encode
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CallOrigin:
    """Where a call comes from: the rollout it belongs to and the caller (API key) that made it."""

    rollout_id: str
    explicit: bool  # False when the gateway made the id up
    caller: Caller
    # The client's W3C trace context (`traceparent`, `tracestate`; gateway/tracing.py::trace_context): the
    # call's span joins the client's trace, and the engine gets it on.
    trace_headers: tuple[tuple[str, str], ...] = ()

    @property
    def rollout_key(self) -> RolloutKey:
        """The rollout it joins: `rollout_id` in its caller's namespace (store.access.Grant.namespace)."""
        return RolloutKey(self.caller.grant.namespace, self.rollout_id)


def call_origin(
    header: str | None,
    path_id: str | None,
    caller: Caller,
    trace_headers: tuple[tuple[str, str], ...] = (),
) -> CallOrigin:
    """The rollout a call belongs to: the path prefix wins over the header; neither → a new id."""
    given = path_id if path_id is not None else header
    if given is None:
        return CallOrigin(f"r-{uuid.uuid4().hex}", False, caller, trace_headers)
    if not ROLLOUT_ID.fullmatch(given):
        raise invalid_request(
            "Invalid rollout id: use 1 to 128 characters from letters, digits and `._:-`, "
            "starting with a letter or digit.",
            param=ROLLOUT_HEADER,
            code="invalid_rollout_id",
        )
    if given.startswith(EVAL_ROLLOUT_PREFIX):
        raise invalid_request(
            f"Rollout ids starting with `{EVAL_ROLLOUT_PREFIX}` are the gateway's own (eval calls).",
            param=ROLLOUT_HEADER,
            code="invalid_rollout_id",
        )
    return CallOrigin(given, True, caller, trace_headers)


# What reading a malformed engine answer raises: not JSON, or JSON without the fields vLLM always sends.
ENGINE_DATA_ERRORS = (msgspec.DecodeError, KeyError, TypeError, AttributeError, ValueError, IndexError)
# A send the engine's end cut before any answer (a kept-alive connection it closed or reset under the send): nothing
# reached the client and nothing is recorded yet, so the call is sent again on another connection. A refused
# connection (ClientConnectorError, a subclass: the engine is down or restarting) is not sent again.
RESENDABLE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
ENGINE_SENDS = 3  # a burst can find more than one dropped connection in the pool


# A send that did not reach the engine, after its resends (refused, reset, cut before any answer, no connection in
# time): with several engines the engine leaves rotation and the call goes to another (engine/pool.py).
UNREACHED = (*RESENDABLE, aiohttp.ConnectionTimeoutError)


def _resendable(exc: BaseException) -> bool:
    return isinstance(exc, RESENDABLE) and not isinstance(exc, aiohttp.ClientConnectorError)


async def _at_once(_seconds: float) -> None:
    """tenacity's sleep between two sends to the engine: none, the next goes out at once."""


class Wire(Protocol):
    """How one API's client sees a call that the engine answers in its own format."""

    async def answer(self, payload: dict[str, Any]) -> bytes:
        """The engine's whole answer (decoded) -> the client's response body."""
        ...

    def event(self, event: dict[str, Any]) -> bytes:
        """One event of the engine's stream (decoded) -> what the client gets for it (b"": nothing)."""
        ...

    async def done(self) -> bytes:
        """The engine's stream ended well ([DONE]) -> the client's last events."""
        ...

    def broken(self, error: OpenAIError) -> bytes:
        """The stream ends with this error -> the client's error event(s)."""
        ...


def sampled_logprobs(choice: AnswerChoice) -> list[float]:
    """The sampling logprob of each sampled token of a choice (chat's or completions' logprobs)."""
    logprobs = choice.logprobs
    if logprobs is None:
        return []
    if logprobs.content is not None:
        return [entry.logprob for entry in logprobs.content]
    # Completions: with `echo`, the prompt's tokens come first (the very first has no logprob).
    values = logprobs.token_logprobs or []
    sampled = len(choice.token_ids or ())
    if not sampled:
        return []
    mine = values[len(values) - sampled :]
    if None in mine:
        raise EngineAnswerError("a sampled token without its logprob at `$.choices[*].logprobs.token_logprobs`")
    return mine  # type: ignore[return-value]  # no None in it


def upstream_error(status: int, body: bytes) -> OpenAIError:
    """vLLM's error body, re-shaped as OpenAI's (vLLM puts an int in `code`)."""
    message, param = f"The engine answered {status}.", None
    try:
        err = read(body, ErrorBody).error
        message = err.message or message
        param = err.param
    except EngineAnswerError:
        pass
    if status >= 500:
        return OpenAIError(502, f"Upstream engine error: {message}", code="upstream_error")
    return OpenAIError(status, message, param=param)


_JSON_HEADERS = {"content-type": "application/json"}
EngineStateOf = Callable[[], EngineState]


@dataclass
class StreamedChoice:
    """One choice of a streamed call, put back together from its deltas (chat's, or completions' text)."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_ids: list[int] | None = None  # completions: each choice carries its prompt's ids

    def add(self, choice: AnswerChoice) -> None:
        delta = choice.delta
        if delta is None:  # completions
            if choice.text:
                self.content.append(choice.text)
            if choice.prompt_token_ids:
                self.prompt_ids = choice.prompt_token_ids
        else:
            if delta.content:
                self.content.append(delta.content)
            reasoning = delta.reasoning or delta.reasoning_content
            if reasoning:
                self.reasoning.append(reasoning)
            for call in delta.tool_calls or ():
                slot = self.tool_calls.setdefault(
                    call.index,
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                if call.id:
                    slot["id"] = call.id
                function = call.function
                if function is not None and function.name:
                    slot["function"]["name"] += function.name
                if function is not None and function.arguments:
                    slot["function"]["arguments"] += function.arguments
        if choice.finish_reason:
            self.finish_reason = choice.finish_reason
        if choice.token_ids:
            self.token_ids.extend(choice.token_ids)
        self.logprobs.extend(sampled_logprobs(choice))

    def record(self, index: int) -> ChoiceRecord:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            message["reasoning"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return ChoiceRecord(index, message, self.finish_reason, self.token_ids, self.logprobs)


def choice_record(choice: AnswerChoice) -> ChoiceRecord:
    """One choice of a whole answer, as recorded (chat's message, or completions' text)."""
    if choice.message is not None:
        message = {k: v for k, v in choice.message.items() if v is not None}
    else:
        message = {"role": "assistant", "content": choice.text or ""}
    return ChoiceRecord(
        choice.index,
        message,
        choice.finish_reason,
        choice.token_ids or [],
        sampled_logprobs(choice),
    )


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A call accepted by one of the APIs, ready for the engine."""

    api: Api
    path: str  # the engine's endpoint: /v1/chat/completions or /v1/completions
    body: bytes  # what the engine gets
    request: dict[str, Any]  # what is recorded as the call's request (the engine's chat request, for translations)
    route: Route
    stream: bool
    wire: Wire
    # Completions with several prompts: how many choices each prompt has (one record per prompt). 0: one record.
    choices_per_prompt: int = 0


class PlainUpstream:
    """A call served as sent, at its API's engine path: the engine's own answer (whose `system_fingerprint` its
    engine's splicer, with --continuity splice, learns for the calls it splices)."""

    __slots__ = ("body", "path", "splicer")

    def __init__(self, path: str, body: bytes, splicer: Splicer | None) -> None:
        self.path = path
        self.body = body
        self.splicer = splicer

    def stream(self, upstream: aiohttp.ClientResponse) -> aiohttp.ClientResponse:
        return upstream

    async def answer(self, payload: dict[str, Any]) -> dict[str, Any]:
        return payload


class SplicedUpstream:
    """A call continuing its rollout, served from the model's own tokens (--continuity splice) at
    /inference/v1/generate: its answer, or each chunk of its stream, derendered to what the engine would have
    answered the chat request (logprobs only for a chat client that asked: `request` is the client's)."""

    __slots__ = ("body", "logprobs", "splice", "splicer")
    path = GENERATE_PATH

    def __init__(self, splicer: Splicer, splice: Splice, request: dict[str, Any]) -> None:
        self.splicer = splicer
        self.splice = splice
        self.body = _encode(splice.generate)
        self.logprobs = bool(request.get("logprobs"))

    def stream(self, upstream: aiohttp.ClientResponse) -> DerenderedStream:
        return DerenderedStream(self.splicer, upstream, self.splice, logprobs=self.logprobs)

    async def answer(self, payload: dict[str, Any]) -> dict[str, Any]:
        return await self.splicer.derender(payload, self.splice)


# How the engine serves one call, chosen once per engine it is sent to (EngineCalls._upstream).
Upstream = PlainUpstream | SplicedUpstream


class EngineCalls:
    """Sends accepted calls to the engine and records each exactly once, whatever the API."""

    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        engines: EnginePool,
        request_timeout: float,
        registry: AdapterRegistry,
        recorder: Recorder,
        engine_state: EngineStateOf,
        metrics: GatewayMetrics,
        owners: RolloutOwners,
        limits: RateLimits | None = None,
        tracer: CallTracer | None = None,
        splicers: dict[str, Splicer] | None = None,
        continuations: Continuations | None = None,
        restore: Callable[[Engine], Awaitable[str | None]] | None = None,
    ) -> None:
        self.metrics = metrics
        self.tracer = tracer  # with tracing on (OTEL_EXPORTER_OTLP_ENDPOINT): a span per call
        self.limits = limits or RateLimits()  # a finished call's tokens count against its key's minute
        # aiohttp on the data path: httpx's connection pool rescans every connection per request
        # (quadratic; encode/httpx#3215) and collapses at a few hundred concurrent calls.
        self.session = session
        self.engines = engines  # which engine serves each call: its rollout's, else the least loaded
        # sock_connect: a loopback connect is instant, but its timer runs on this event loop, so a stall of the
        # loop (a busy 2-core machine) can fire a short one on a connect that had succeeded.
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=request_timeout)
        self.registry = registry
        self.recorder = recorder
        self.owners = owners  # a rollout's calls are all of one model
        self.engine_state = engine_state
        # One rollout, one sequence (gateway/continuation.py): each rollout's last chat call, and with
        # `--continuity splice` each engine's splicer (by URL), which serves a call continuing it from the model's
        # own tokens: on any engine, since the tokens are the gateway's.
        self.continuations = Continuations() if continuations is None else continuations  # empty is falsy
        self.splicers = splicers
        # An engine that answers that it lacks a call's LoRA step (it restarted before its next probe) gets every
        # served step loaded again (gateway/adapters.py restore_engine), when no other engine can take the call.
        self.restore = restore

    async def answer(
        self,
        requested: str,
        origin: CallOrigin,
        build: Callable[[Route], EngineRequest],
        hang_up: HangUp | None = None,
    ) -> JSONBody | EventStream:
        """Route a call asking for `requested`, build its engine request (`build`) and answer it (`run`).

        A rollout's calls to `NAME` go to the step its first call was served by, while that step is loaded, and
        are all of one model (gateway/rollouts.py). For a rollout this process has not seen yet the store says
        which, while the engine already works on the call: it is refused then, or sent again to its step."""
        if not origin.explicit:  # an id the gateway made up is new and random: nobody else's
            route = self.registry.resolve(requested, origin.caller, origin.rollout_id)
            return await self.run(build(route), origin, hang_up)
        rollout = origin.rollout_key
        route = self.registry.resolve(requested, origin.caller, origin.rollout_id, self.owners.owner(rollout).pin)
        call_in = build(route)
        claimed = self.owners.claim(rollout, route.model, route.step)
        if claimed is None:
            return await self.run(call_in, origin, hang_up)
        moved = asyncio.ensure_future(self._moved(claimed, requested, origin, route))
        moved.add_done_callback(_retrieved)  # a call cancelled meanwhile never reads it
        try:
            return await self.run(call_in, origin, hang_up, moved)
        except _Rerouted as rerouted:
            return await self.run(build(rerouted.route), origin, hang_up)

    async def _moved(
        self, claimed: Awaitable[Pin | None], requested: str, origin: CallOrigin, route: Route
    ) -> Route | None:
        """Once the store has answered: where the call belongs, if not on `route` (or the 409)."""
        pin = await claimed
        if pin is None:
            return None
        pinned = self.registry.resolve(requested, origin.caller, origin.rollout_id, pin)
        return None if pinned == route else pinned

    async def run(
        self,
        call_in: EngineRequest,
        origin: CallOrigin,
        hang_up: HangUp | None,
        moved: asyncio.Future[Route | None] | None = None,
    ) -> JSONBody | EventStream:
        """Answer one accepted call. `hang_up` (the server's, gateway/server.py) lets a call that is not
        streamed notice the client hanging up while the engine works: the engine's request is then closed
        (vLLM aborts it) and the call recorded `cancelled`, never trainable. `moved`: the store's word on a
        rollout new here (`answer`), awaited before any byte of the answer goes out."""
        # Accepted: from here on, every path records this call exactly once.
        call = _Call(self, origin, call_in, time.time())
        call.moved = moved
        self.recorder.begin(origin.rollout_key)
        self.metrics.call_started(call.label)
        if call_in.stream or hang_up is None:
            return await self._answer(call)
        # The relay of a stream watches for a hang-up itself (gateway/asgi.py); a plain answer is watched here.
        if hang_up.gone:  # gone while its body was read
            await call.finish("cancelled", 499, "the client hung up before the answer")
            return JSONBody(b"", {ROLLOUT_HEADER: origin.rollout_id}, status=499)  # nobody reads it
        hang_up.task = asyncio.current_task()
        try:
            return await self._answer(call, hang_up)
        except asyncio.CancelledError:
            if not hang_up.gone:
                raise  # not the client: the server is stopping this task
            asyncio.current_task().uncancel()  # type: ignore[unreachable]  # mypy keeps `gone` False from above; fire() set it
            await call.finish("cancelled", 499, "the client hung up before the answer")
            return JSONBody(b"", {ROLLOUT_HEADER: origin.rollout_id}, status=499)  # nobody reads it
        finally:
            hang_up.task = None

    async def _answer(self, call: _Call, hang_up: HangUp | None = None) -> JSONBody | EventStream:
        spec = call.spec
        served: Served | None = None
        regained = False
        try:
            try:
                while True:
                    way, served = await self._upstream(call)
                    try:
                        upstream = await self._send(call, way.path, way.body)
                        if upstream.status == 404 and not regained and await self._regained(call, upstream):
                            regained = True  # once: an engine that still lacks the step fails the call below
                            continue
                        break
                    except UNREACHED:
                        # Nothing reached the engine: it leaves rotation, and the call (spliced anew there) goes to
                        # another; with none left, the client gets the engine's error.
                        if not self._fail_over(call):
                            raise
            finally:
                if served is not None:  # how it was served on the engine it went to last
                    self.metrics.call_continued(call.label, served)
                    call.continued = served  # the record says it too: its split names the metric's cause
        except BaseException as exc:
            if isinstance(exc, Exception):
                await self._decided(call)  # a refused call is refused, whatever the engine did
            error = self._send_error(exc)
            if error is not None:  # the record says which exception, for a post-mortem
                await call.finish("upstream_error", error.status, f"{error.message} ({type(exc).__name__})")
                raise error from None
            if isinstance(exc, Exception):  # the gateway's own bug: a 500 with its traceback logged, not a 502
                await call.finish("internal_error", 500, f"gateway error: {type(exc).__name__}")
            else:  # cancelled: the client (or a shutdown) gave up on the call
                await call.finish("cancelled", 499, "cancelled before the engine answered")
            raise
        await self._decided(call, upstream)
        headers = {ROLLOUT_HEADER: call.origin.rollout_id}
        if upstream.status != 200:
            try:
                raw = await upstream.read()
            except aiohttp.ClientError:
                raw = b""
            finally:
                upstream.release()
            error = upstream_error(upstream.status, raw)
            if upstream.status == 404 and spec.route.model is not None and spec.route.step:
                # vLLM lost (or never really loaded) one of our adapters: its 404 would name its internal alias.
                error = OpenAIError(
                    503,
                    f"Step {spec.route.step} of `{spec.route.model}` cannot be served right now; retry shortly.",
                    type="server_error",
                    code="adapter_unavailable",
                )
            # The engine's 4xx is the client's mistake (a bad option): passed through and counted as such,
            # not as an engine fault.
            await call.finish("client_error" if error.status < 500 else "upstream_error", error.status, error.message)
            raise error
        if spec.stream:
            relay = call.relay(way.stream(upstream))
            # Starting the relay here means its `finally` (which records the call) is guaranteed to run,
            # even if the client is gone before the response starts: asyncio closes started generators.
            # The relay yields at least one event (the engine's first, or an error event).
            return EventStream(await anext(relay), relay, headers)
        try:
            # Decoded for the client's answer (the wire forwards what the engine sent, fields the gateway does not
            # know included), and read, typed, for the record.
            payload = await way.answer(_decode(await upstream.read()))
            if hang_up is not None:
                # From here on no hang-up can cut in (asyncio delivers it only where the task waits): the answer
                # is whole and the call is recorded as answered.
                hang_up.task = None
            answer = read(payload, Answer)
            if isinstance(way, PlainUpstream) and way.splicer is not None:
                way.splicer.learn(answer.system_fingerprint)
            choices = [choice_record(c) for c in answer.choices]
            prompts = _prompt_ids(answer)
        except asyncio.CancelledError:
            upstream.close()  # dropping the connection is how vLLM learns to abort the request
            raise
        except ENGINE_DATA_ERRORS as exc:  # the engine's answer, not the gateway's code: a 502
            await call.finish("upstream_error", 502, f"unreadable engine answer: {_why(exc)}")
            raise _unreadable("an unreadable answer", exc) from None
        except DerenderFailed as exc:
            error = upstream_error(exc.status, exc.body)
            await call.finish("upstream_error", error.status, f"derender: {error.message}")
            raise error from None
        usage = answer.usage
        try:
            body = await spec.wire.answer(payload)
        except ENGINE_DATA_ERRORS as exc:
            await call.finish("upstream_error", 502, f"unreadable engine answer: {_why(exc)}")
            raise _unreadable("an unreadable answer", exc) from None
        except BaseException as exc:
            await call.finish("internal_error", 500, f"gateway error: {type(exc).__name__}")
            raise
        try:
            await call.finish("ok", 200, None, prompts, choices, usage)
        except RecordingUnavailable as exc:
            raise unrecorded(exc) from None
        return JSONBody(body, headers)

    async def _decided(self, call: _Call, upstream: aiohttp.ClientResponse | None = None) -> None:
        """The store's word on the call's rollout, new here (`answer`), before any of the answer goes out: a
        call refused (409) or belonging to another step is withdrawn, unrecorded, its engine request closed."""
        moved, call.moved = call.moved, None
        if moved is None:
            return
        try:
            route = await asyncio.shield(moved)  # not cancelled with this call: others may wait on the look-up
        except asyncio.CancelledError:
            if upstream is not None:
                upstream.close()
            await call.finish("cancelled", 499, "cancelled before the engine answered")
            raise
        except BaseException:
            if upstream is not None:
                upstream.close()
            await call.withdraw()
            raise
        if route is not None:
            if upstream is not None:
                upstream.close()
            await call.withdraw()
            raise _Rerouted(route)

    async def _send(self, call: _Call, path: str, body: bytes) -> aiohttp.ClientResponse:
        """The engine's answer (its status and headers) to one call, sent again where the connection was cut
        before any answer (RESENDABLE)."""
        send = functools.partial(
            self.session.post, call.engine.url + path, data=body, headers=call.engine_headers, timeout=self.timeout
        )
        # The first send outside tenacity: nearly every call is answered by it, and a retry object costs ~0.1 ms.
        try:
            return await send()
        except RESENDABLE as exc:
            if not _resendable(exc):
                raise
            self._resending(call, exc)
        resends = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(ENGINE_SENDS - 1),
            retry=tenacity.retry_if_exception(_resendable),
            sleep=_at_once,
            # tenacity sets the outcome before it sleeps.
            before_sleep=lambda state: self._resending(call, state.outcome.exception()),  # type: ignore[union-attr]
            reraise=True,
        )
        async for attempt in resends:  # not resends(send): tenacity would call `send` as a plain function
            with attempt:
                response = await send()
        return response

    def _resending(self, call: _Call, exc: BaseException | None) -> None:
        log.warning("the engine cut a connection before answering (%s: %s); sending again", type(exc).__name__, exc)
        self.metrics.engine_resent(call.label, type(exc).__name__)

    async def _regained(self, call: _Call, upstream: aiohttp.ClientResponse) -> bool:
        """The call's engine answered 404 to a call routed to a LoRA step: it does not hold the step (it restarted
        since its last probe, losing every adapter). Whether the call is sent again (`upstream` released): to
        another engine in rotation, this one quarantined until its probe has loaded every served step there, or,
        with no other, to this one once they are loaded again. Else the client gets 503 `adapter_unavailable`."""
        route = call.spec.route
        model = self.registry.models.get(route.model) if route.model is not None else None
        if model is None or not route.step or route.step not in model.loaded_steps:
            return False  # the base weights, or a step unloaded since the call was routed to it: the engine is right
        lost = adapter_name(model.name, route.step)
        engine = call.engine
        other = self.engines.lost_step(call.rollout, engine, f"it does not hold {lost} (restarted?)")
        if other is not None:
            log.warning("engine %s does not hold %s: a call of it goes to %s", engine.url, lost, other.url)
            call.engine = other
        elif self.restore is None:
            return False
        else:
            problem = await self.restore(engine)
            if problem is not None:
                log.warning("engine %s lacks %s, and could not be given it again: %s", engine.url, lost, problem)
                return False
            log.warning("engine %s lacked %s (restarted?): every served step loaded there again", engine.url, lost)
        upstream.release()
        return True

    def _fail_over(self, call: _Call) -> bool:
        """The call's engine could not be reached: whether the call goes to another engine (`call.engine`)."""
        if len(self.engines) < 2:
            return False
        other = self.engines.failover(call.rollout, call.engine)
        if other is None:
            return False
        log.warning(
            "engine %s unreachable: a call of rollout %s goes to %s", call.engine.url, call.origin.rollout_id, other.url
        )
        call.engine = other
        return True

    async def _upstream(self, call: _Call) -> tuple[Upstream, Served | None]:
        """How the call's engine serves it: spliced, for a chat call that continues its rollout on an engine with
        a splicer, else as sent; and how a continuing call is served (None: it does not continue)."""
        spec, origin = call.spec, call.origin
        if spec.path != CHAT_PATH or not origin.explicit:
            return PlainUpstream(spec.path, spec.body, call.splicer), None
        continued, call.rollout_known = await self.continuations.look_up(
            origin.rollout_key, spec.request, spec.route, call.digests
        )
        if call.rejoin:  # the pool did not know the rollout: the engine of its last call, where one served it
            call.rejoin = False
            last = self.continuations.engine_of(origin.rollout_key)
            if last is not None and call.rollout is not None:
                call.engine = self.engines.rejoin(call.rollout, call.engine, last)
        splicer = call.splicer
        plain = PlainUpstream(spec.path, spec.body, splicer)
        if continued is None:
            return plain, None
        if splicer is None:
            return plain, "rerendered"
        upstream = _decode(spec.body)
        try:
            splice = await splicer.splice(upstream, continued, spec.stream)
        except Exception:  # the plain path still answers the call: a splice is never worth a failed call
            log.exception("splicing a call of rollout %s failed; it is rendered anew", origin.rollout_id)
            splice = "render_failed"
        if isinstance(splice, Splice):
            return SplicedUpstream(splicer, splice, spec.request), "spliced"
        return plain, splice

    async def engine_json(self, path: str, body: dict[str, Any], kind: type[T]) -> T:
        """A request to the engine that records nothing (vLLM's `/tokenize`): its answer read as `kind`, or the
        error the client sees (the engine's own for its 4xx; a 502 saying what is wrong with an unreadable one)."""
        engine = self.engines.least_loaded() or self.engines.engines[0]
        try:
            async with self.session.post(engine.url + path, json=body, timeout=self.timeout) as upstream:
                payload = await upstream.read()
                status = upstream.status
        except Exception as exc:
            error = self._send_error(exc)
            if error is None:
                raise
            raise error from None
        if status != 200:
            raise upstream_error(status, payload)
        try:
            return read(payload, kind)
        except EngineAnswerError as exc:
            raise _unreadable("an unreadable answer", exc) from None

    def _send_error(self, exc: BaseException) -> OpenAIError | None:
        """The client-facing error for a failed send to the engine; None when the engine is not at fault."""
        if isinstance(exc, aiohttp.ConnectionTimeoutError):  # nothing was sent: unreachable, not slow
            return self._unreachable(exc)
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


def unrecorded(exc: RecordingUnavailable) -> OpenAIError:
    """A call the journal could not take: refused, so that the client retries it (it was not recorded)."""
    error = OpenAIError(
        503,
        "The gateway cannot record calls right now (its disk is full or failing): this call was not recorded. "
        "Retry shortly.",
        type="server_error",
        code="recording_unavailable",
    )
    error.headers = {"Retry-After": str(RECORDING_RETRY_SECONDS)}
    log.debug("call refused: %s", exc)
    return error


def _prompt_ids(answer: Answer) -> list[list[int]]:
    """The prompt token ids of a whole answer: chat's one, or each completions choice's own."""
    if answer.prompt_token_ids:
        return [answer.prompt_token_ids]
    return [c.prompt_token_ids or [] for c in answer.choices]


def _why(exc: BaseException) -> str:
    """What was wrong with an engine answer, for the client's error and the record."""
    if isinstance(exc, EngineAnswerError):
        return exc.reason
    if isinstance(exc, msgspec.DecodeError):  # not JSON at all
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _unreadable(what: str, exc: BaseException) -> OpenAIError:
    """The client's 502 for an engine answer that is not what vLLM sends, saying what was wrong with it."""
    return OpenAIError(502, f"The engine sent {what}: {_why(exc)}", code="upstream_error")


class _Rerouted(Exception):
    """A call sent before the store said its rollout is pinned to another step (EngineCalls.answer)."""

    def __init__(self, route: Route) -> None:
        super().__init__(route)
        self.route = route


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class _Call:
    """One call in flight: relays a stream and builds the record(s) when the call ends."""

    def __init__(self, service: EngineCalls, origin: CallOrigin, spec: EngineRequest, started: float) -> None:
        self.service = service
        self.origin = origin
        self.spec = spec
        self.started = started
        self.first_token_at: float | None = None
        self.recorded = False  # exactly once: whichever path ends the call first records it
        self.rollout_known: bool | None = None  # set by EngineCalls._splice: CallRecord.rollout_known
        self.continued: Served | None = None  # set by EngineCalls._answer: CallRecord.continued
        self.moved: asyncio.Future[Route | None] | None = None  # EngineCalls.run's `moved`, until awaited
        self.label = spec.route.model or spec.route.upstream_model  # the metrics' model label
        # The engine it goes to, counted in flight there until it is recorded (`finish`).
        self.rollout = origin.rollout_key if origin.explicit else None
        picked = service.engines.pick(self.rollout)
        self.engine: Engine = picked.engine
        # A rollout new to this pool (another replica's, or from before a restart) goes back to the engine of its
        # last call once the continuation look-up has found it (EngineCalls._upstream), if it can take it.
        self.rejoin = not picked.remembered
        # The span starts with the call so that the engine's own spans (vLLM --otlp-traces-endpoint) are its
        # children; with tracing off the client's trace context, if any, goes on to the engine as it came.
        tracer = service.tracer
        self.span: Span | None = None
        self.engine_headers = _JSON_HEADERS
        if tracer is not None:
            upstream = spec.route.upstream_model
            self.span = tracer.started(spec.api, spec.request, upstream, origin.trace_headers, started)
            self.engine_headers = tracer.engine_headers(self.span, _JSON_HEADERS)
        elif origin.trace_headers:
            self.engine_headers = {**_JSON_HEADERS, **dict(origin.trace_headers)}

    @property
    def splicer(self) -> Splicer | None:
        """Its engine's splicer (--continuity splice), else None."""
        splicers = self.service.splicers
        return splicers.get(self.engine.url) if splicers is not None else None

    @functools.cached_property
    def digests(self) -> tuple[bytes, ...] | None:
        """Its messages' digests: what it continues is found with them, and it is remembered by them."""
        return message_digests(self.spec.request)

    async def finish(
        self,
        status: CallStatus,
        http_status: int,
        error: str | None,
        prompts: list[list[int]] | None = None,
        choices: list[ChoiceRecord] | None = None,
        usage: dict[str, Any] | None = None,
    ) -> None:
        """Record the call, once. A completions call with several prompts is one record per prompt (each its
        own generation), with the choices of that prompt."""
        if self.recorded:
            return
        self.recorded = True
        self.service.engines.done(self.engine)
        ended = time.time()
        spec = self.spec
        parts = self._per_prompt(prompts or [[]], choices or [])
        caller = self.origin.caller
        if caller.tpm is not None:  # the tokens the engine spent, as recorded: prompt + sampled
            spent = sum(len(ids) + sum(len(c.token_ids) for c in mine) for ids, mine in parts)
            self.service.limits.charge(caller, spent)
        first = True
        records: list[CallRecord] = []
        for prompt_ids, part_choices in parts:
            record = CallRecord(
                call_id=uuid.uuid4().hex,
                rollout_id=self.origin.rollout_id,
                rollout_explicit=self.origin.explicit,
                model=spec.route.model,
                step=spec.route.step,
                upstream_model=spec.route.upstream_model,
                request=spec.request,
                stream=spec.stream,
                status=status,
                http_status=http_status,
                error=error,
                prompt_token_ids=prompt_ids,
                choices=part_choices,
                usage=usage if first else None,
                started_at=self.started,
                first_token_at=self.first_token_at if spec.stream else ended,
                ended_at=ended,
                api=spec.api,
                key_id=self.origin.caller.key_id,
                rollout_known=self.rollout_known,
                engine=self.engine.url,
                continued=self.continued,
            )
            first = False
            records.append(record)
            self.service.metrics.call_ended(self.label, record)
            if spec.path == CHAT_PATH and self.origin.explicit:
                self.service.continuations.remember(record, self.digests)
            try:
                await self.service.recorder.submit(record)
            except RecordingUnavailable:
                if status == "ok":
                    raise  # the caller refuses the call: an answer nobody recorded would be lost in a crash
                # A failed call's client gets its own error anyway; the journal's failure is logged.
        if self.service.tracer is not None:
            self.service.tracer.ended(records, self.span)

    async def withdraw(self) -> None:
        """Not a call after all (refused once the store answered, or sent again elsewhere): nothing recorded."""
        self.recorded = True
        self.service.metrics.call_withdrawn(self.label)
        await self.service.recorder.withdraw(self.origin.rollout_key)
        if self.span is not None:
            self.span.end()

    def _per_prompt(
        self, prompts: list[list[int]], choices: list[ChoiceRecord]
    ) -> list[tuple[list[int], list[ChoiceRecord]]]:
        """(prompt ids, choices) of each record: one, or one per prompt of a completions call with several
        (`prompts` then holds each choice's prompt, and choice i*n+j is choice j of prompt i)."""
        per = self.spec.choices_per_prompt
        if not per or len(choices) <= per:
            return [(prompts[0], choices)]
        records: dict[int, tuple[list[int], list[ChoiceRecord]]] = {}
        for i, choice in enumerate(choices):
            prompt = prompts[i] if i < len(prompts) else []
            _, mine = records.setdefault(choice.index // per, (prompt, []))
            mine.append(msgspec.structs.replace(choice, index=choice.index % per))
        return [records[k] for k in sorted(records)]

    async def relay(self, upstream: aiohttp.ClientResponse | DerenderedStream) -> AsyncGenerator[bytes]:
        """Pass the engine's SSE events on, as the API's client expects them.

        Whatever the engine has sent by the time the gateway reads goes on as one write: events that
        arrive together (the role and the first token, a burst under load) cost one syscall, not one each.
        A client that goes away cancels this generator; closing the upstream response then closes the
        connection, and vLLM aborts the request.
        """
        stream = _Stream(self.spec.wire)
        pending = b""
        recorded = False  # exactly once: at the engine's [DONE], else in `finally`
        try:
            async for data in upstream.content.iter_any():
                *lines, pending = (pending + data).split(b"\n")
                out = [event for line in lines if (event := stream.take(line, self))]
                if stream.done and not recorded:
                    # [DONE] is the client's end of answer: the call is journaled before the client gets it,
                    # so an answered call survives a crash of the gateway (recording/journal.py).
                    recorded = True
                    with anyio.CancelScope(shield=True):
                        out.append(await self._end_stream(stream))
                if out:
                    yield b"".join(out)
                if stream.broken:  # its error event is out; the engine's request is closed in `finally`
                    break
            if pending and (event := stream.take(pending, self)):
                yield event
            if stream.done and not recorded:
                recorded = True
                with anyio.CancelScope(shield=True):
                    ending = await self._end_stream(stream)
                yield ending
            if stream.status == "cancelled":  # the engine closed the stream without its [DONE]
                stream.status, stream.error = "upstream_error", "the engine ended the stream early"
                yield stream.wire.broken(OpenAIError(502, "The engine ended the stream early.", code="upstream_error"))
        except (DerenderFailed, EngineAnswerError) as exc:  # a spliced stream's derender refused, or unreadable
            if isinstance(exc, DerenderFailed):
                error = upstream_error(exc.status, exc.body)
                stream.error = f"derender: {error.message}"
            else:
                error = _unreadable("an event the gateway cannot read", exc)
                stream.error = f"unreadable engine event: {_why(exc)}"
            stream.status = "upstream_error"
            yield stream.wire.broken(error)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if isinstance(exc, aiohttp.ClientError):  # the engine went away mid-answer: out of rotation
                self.service.engines.failed(self.engine)
            stream.status, stream.error = "upstream_error", f"engine connection lost: {type(exc).__name__}"
            yield stream.wire.broken(
                OpenAIError(502, "The engine connection was lost mid-stream.", code="upstream_error")
            )
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

    async def _end_stream(self, stream: _Stream) -> bytes:
        """The client's last events of a stream the engine ended: the call is journaled first; if it cannot be,
        the stream ends with an error event instead (the client does not get an answer nobody recorded)."""
        try:
            await self._record_stream(stream)
        except RecordingUnavailable as exc:
            return stream.wire.broken(unrecorded(exc))
        return await stream.wire.done()

    async def _record_stream(self, stream: _Stream) -> None:
        """Record the streamed call (once per call: see `relay`)."""
        records = [stream.choices[i].record(i) for i in sorted(stream.choices)]
        if stream.prompt_ids:  # chat: one prompt
            prompts = [stream.prompt_ids]
        else:  # completions: each choice's own
            prompts = [stream.choices[i].prompt_ids or [] for i in sorted(stream.choices)]
        http_status = 200 if stream.status != "cancelled" else 499
        await self.finish(stream.status, http_status, stream.error, prompts, records, stream.usage)


@dataclass
class _Stream:
    """What a streamed call has sent so far, and its outcome (`cancelled` until the engine's [DONE])."""

    wire: Wire
    choices: dict[int, StreamedChoice] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    status: CallStatus = "cancelled"
    error: str | None = None
    done: bool = False  # the engine's [DONE] came: the call is over, its record goes before the client's end
    broken: bool = False  # the engine sent a line the gateway cannot read: the stream ends there

    def take(self, line: bytes, call: _Call) -> bytes:
        """One line of the engine's SSE stream -> the bytes the client gets for it (b"": nothing). A line that
        is not what vLLM sends ends the stream: an error event, and nothing after it (`broken`)."""
        if self.broken:
            return b""
        try:
            return self._take(line, call)
        except ENGINE_DATA_ERRORS as exc:
            self.broken = True
            self.status, self.error = "upstream_error", f"unreadable engine event: {_why(exc)}"
            return self.wire.broken(_unreadable("an event the gateway cannot read", exc))

    def _take(self, line: bytes, call: _Call) -> bytes:
        if not line.startswith(b"data: "):
            return b""
        data = line[6:].rstrip()
        if data == b"[DONE]":
            self.done = True
            if self.status == "cancelled":  # vLLM sends [DONE] after an error event too: the error stands
                self.status = "ok"
            return b""  # the wire's closing events go out after the record (relay)
        event = _decode(data)  # what the wire forwards; read, typed, below
        if "error" in event and "choices" not in event:
            try:
                error = read(event, ErrorBody).error
            except EngineAnswerError:
                error = None
            self.status, self.error = "upstream_error", str(error.message if error is not None else None)
            # vLLM's error event (e.g. its engine core died) has its HTTP status as an int `code`: re-shaped
            # as the gateway's own errors are, code `upstream_error` for a 5xx.
            code = error.code if error is not None else None
            return self.wire.broken(upstream_error(code if isinstance(code, int) and code >= 400 else 500, data))
        answer = read(event, Answer)
        if call.first_token_at is None:
            call.first_token_at = time.time()
        if answer.prompt_token_ids:
            self.prompt_ids = answer.prompt_token_ids
        if answer.usage:
            self.usage = answer.usage
            if call.splicer is not None:
                call.splicer.learn(answer.system_fingerprint)
        for choice in answer.choices:
            self.choices.setdefault(choice.index, StreamedChoice()).add(choice)
        return self.wire.event(event)
