"""The gateway's OpenTelemetry spans, when `store.tracing.start_tracing` turns tracing on.

- One span per inference call, whatever the API, following the GenAI semantic conventions (`chat my-agent`,
  `text_completion my-agent`), plus ART's `art.*` attributes. It starts with the call (gateway/proxy.py), a
  child of the client's span when the client sent a W3C `traceparent`, and goes on to the engine in the
  request's `traceparent`, so vLLM's own spans (`--otlp-traces-endpoint`) are its children; its attributes
  are set when the call ends, from what is recorded of it. With tracing off the call pays one `is None` test
  (and a client's trace context goes on to the engine unchanged).
- One span per RULER scoring of a group (`score_group MODEL`), current while the judge works, so that ruler/
  makes each judge call a child span of it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from store.records import Api, CallRecord
from store.tracing import ART_MODEL, ART_ROLLOUT_ID, ART_STEP

log = logging.getLogger("artgw.tracing")
_PROPAGATOR = TraceContextTextMapPropagator()  # W3C Trace Context: `traceparent` and `tracestate`
# version-trace id-parent id-flags (W3C Trace Context, level 1); tracestate is at most 32 entries of <= 256 bytes.
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
_MAX_TRACESTATE = 8192

# gen_ai.provider.name: the conventions' "best knowledge" of who serves the model. vLLM has no well-known value
# (the list names hosted APIs); its OpenAI-compatible server is what the gateway calls.
PROVIDER = "vllm"
OPERATION: dict[Api, str] = {
    "chat": "chat",
    "responses": "chat",  # translated to chat completions (gateway/apis/)
    "messages": "chat",
    "completions": "text_completion",
}
# A request's sampling fields (the engine's request: Responses and Messages ones translated) -> their attributes.
_REQUESTED = (
    ("max_tokens", "gen_ai.request.max_tokens"),
    ("max_completion_tokens", "gen_ai.request.max_tokens"),
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("top_k", "gen_ai.request.top_k"),
    ("seed", "gen_ai.request.seed"),
    ("frequency_penalty", "gen_ai.request.frequency_penalty"),
    ("presence_penalty", "gen_ai.request.presence_penalty"),
)


def trace_context(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The client's W3C trace context headers, if well-formed (a malformed `traceparent` is dropped, as the
    standard asks, and so is the `tracestate` that goes with it): what the call's span joins."""
    parent = (headers.get("traceparent") or "").strip().lower()
    if not _TRACEPARENT.match(parent):
        return ()
    found: tuple[tuple[str, str], ...] = (("traceparent", parent),)
    state = headers.get("tracestate")
    if state and len(state) <= _MAX_TRACESTATE:
        found += (("tracestate", state),)
    return found


class CallTracer:
    """Exports the span of each inference call: started with the call, finished from its records."""

    def __init__(self, tracer: Tracer, upstream_url: str) -> None:
        self.tracer = tracer
        url = urlsplit(upstream_url)
        self.server: dict[str, AttributeValue] = {
            "server.address": url.hostname or "",
            "server.port": url.port or (443 if url.scheme == "https" else 80),
        }

    def started(
        self,
        api: Api,
        request: Mapping[str, Any],
        upstream_model: str,
        trace_headers: Sequence[tuple[str, str]],
        started_at: float,
    ) -> Span | None:
        """The call's span, started (a child of the client's span if `trace_headers` name one); None if it
        cannot be made (logged: never the call's failure)."""
        try:
            parent = _PROPAGATOR.extract(dict(trace_headers)) if trace_headers else None
            name = f"{OPERATION[api]} {request.get('model') or upstream_model}"
            return self.tracer.start_span(name, parent, SpanKind.CLIENT, start_time=int(started_at * 1e9))
        except Exception:
            log.exception("tracing: no span for a call to %s", upstream_model)
            return None

    @staticmethod
    def engine_headers(span: Span | None, headers: Mapping[str, str]) -> dict[str, str]:
        """`headers` plus the span's `traceparent` (and the client's `tracestate`): the engine's request's."""
        out = dict(headers)
        if span is not None:
            _PROPAGATOR.inject(out, trace.set_span_in_context(span))
        return out

    def ended(self, records: Sequence[CallRecord], span: Span | None) -> None:
        """Finish the call's span from its records: one, or one per prompt of a completions call with several
        (the first carries the engine's usage of the whole call). A span that cannot be finished is logged,
        never the call's failure."""
        if span is None:
            return
        try:
            self._finish(span, records)
        except Exception:
            log.exception("tracing: no span for call %s", records[0].call_id if records else "?")

    def _finish(self, span: Span, records: Sequence[CallRecord]) -> None:
        first = records[0]
        request = first.request
        operation = OPERATION[first.api]
        requested = str(request.get("model") or first.upstream_model)
        attributes: dict[str, AttributeValue] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": requested,
            "gen_ai.response.model": first.upstream_model,  # what the engine served: `NAME@STEP`, or the base
            "gen_ai.conversation.id": first.rollout_id,
            ART_ROLLOUT_ID: first.rollout_id,
            "art.api": first.api,
            "http.response.status_code": first.http_status,
            **self.server,
        }
        if first.model is not None:
            attributes[ART_MODEL] = first.model
        if first.step is not None:
            attributes[ART_STEP] = first.step
        for field, key in _REQUESTED:
            value = request.get(field)
            if isinstance(value, int | float) and not isinstance(value, bool):
                attributes[key] = value
        if isinstance(n := request.get("n"), int) and n != 1:
            attributes["gen_ai.request.choice.count"] = n
        choices = [choice for record in records for choice in record.choices]
        if reasons := [c.finish_reason for c in choices if c.finish_reason]:
            attributes["gen_ai.response.finish_reasons"] = reasons
        usage = first.usage or {}
        if first.status == "ok" or usage:
            # The engine's count; a stream that did not ask for its usage: the recorded token ids, the same count.
            prompt = usage.get("prompt_tokens")
            sampled = usage.get("completion_tokens")
            attributes["gen_ai.usage.input_tokens"] = (
                prompt if isinstance(prompt, int) else sum(len(r.prompt_token_ids) for r in records)
            )
            attributes["gen_ai.usage.output_tokens"] = (
                sampled if isinstance(sampled, int) else sum(len(c.token_ids) for c in choices)
            )
        if first.status != "ok":
            attributes["error.type"] = first.status  # cancelled, upstream_error, client_error, internal_error
        span.set_attributes(attributes)
        if first.stream and first.first_token_at is not None:
            span.add_event("first_token", timestamp=int(first.first_token_at * 1e9))
        if first.status != "ok":
            span.set_status(Status(StatusCode.ERROR, first.error))
        span.end(end_time=int(first.ended_at * 1e9))


def scoring_span(
    tracer: Tracer | None, group_id: str, model: str, judge_model: str | None
) -> AbstractContextManager[Any]:
    """The span of one group's RULER scoring (nothing with tracing off), current inside the `with`: ruler/ makes
    each judge call a child of it."""
    if tracer is None:
        return nullcontext()
    attributes: dict[str, AttributeValue] = {
        "art.group_id": group_id,
        ART_MODEL: model,
    }
    if judge_model is not None:  # a panel's spec names its judges instead
        attributes["art.ruler.judge_model"] = judge_model
    return tracer.start_as_current_span(f"score_group {model}", attributes=attributes)


def scoring_ended(size: int, usage: dict[str, Any] | None, failure: str | None) -> None:
    """What the scoring came to, on the current scoring span (a no-op with tracing off)."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attribute("art.group.size", size)
    for key, value in (usage or {}).items():  # judge_calls, cache_hits, prompt_tokens, completion_tokens, cost_usd
        if isinstance(value, int | float):
            span.set_attribute(f"art.ruler.{key}", value)
    if failure is not None:
        span.set_attribute("error.type", "ruler_failed")
        span.set_status(Status(StatusCode.ERROR, failure))
