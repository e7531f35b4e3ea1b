"""The gateway's OpenTelemetry spans, when `store.tracing.start_tracing` turns tracing on.

- One span per inference call, whatever the API, following the GenAI semantic conventions (`chat my-agent`,
  `text_completion my-agent`), plus ART's `art.*` attributes. It is made when the call ends (gateway/proxy.py),
  from what is recorded of it, with the call's own start and end times: nothing is carried through the request
  path, and with tracing off the call pays one `is None` test.
- One span per RULER scoring of a group (`score_group MODEL`), current while the judge works, so that ruler/
  makes each judge call a child span of it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from store.records import Api, CallRecord
from store.tracing import ART_MODEL, ART_ROLLOUT_ID, ART_STEP

log = logging.getLogger("artgw.tracing")

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


class CallTracer:
    """Exports the span of each inference call as it ends."""

    def __init__(self, tracer: Tracer, upstream_url: str) -> None:
        self.tracer = tracer
        url = urlsplit(upstream_url)
        self.server: dict[str, AttributeValue] = {
            "server.address": url.hostname or "",
            "server.port": url.port or (443 if url.scheme == "https" else 80),
        }

    def ended(self, records: Sequence[CallRecord]) -> None:
        """The call's span, from its records: one, or one per prompt of a completions call with several (the
        first carries the engine's usage of the whole call). A span that cannot be made is logged, never the
        call's failure."""
        try:
            self._span(records)
        except Exception:
            log.exception("tracing: no span for call %s", records[0].call_id if records else "?")

    def _span(self, records: Sequence[CallRecord]) -> None:
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
        span = self.tracer.start_span(
            f"{operation} {requested}",
            kind=SpanKind.CLIENT,
            attributes=attributes,
            start_time=int(first.started_at * 1e9),
        )
        if first.stream and first.first_token_at is not None:
            span.add_event("first_token", timestamp=int(first.first_token_at * 1e9))
        if first.status != "ok":
            span.set_status(Status(StatusCode.ERROR, first.error))
        span.end(end_time=int(first.ended_at * 1e9))


def scoring_span(tracer: Tracer | None, group_id: str, model: str, judge_model: str) -> AbstractContextManager[Any]:
    """The span of one group's RULER scoring (nothing with tracing off), current inside the `with`: ruler/ makes
    each judge call a child of it."""
    if tracer is None:
        return nullcontext()
    attributes: dict[str, AttributeValue] = {
        "art.group_id": group_id,
        ART_MODEL: model,
        "art.ruler.judge_model": judge_model,
    }
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
