"""OpenTelemetry spans, checked in memory (the SDK's InMemorySpanExporter): what a call, a RULER scoring and a
training step become, and that nothing of the SDK is loaded when no collector is named. The export over OTLP to
a real receiver is tests/integration/test_otel.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, Tracer

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-map download

import ruler
from gateway.tracing import CallTracer, scoring_ended, scoring_span, trace_context
from store.records import CallRecord, ChoiceRecord
from store.tracing import start_tracing
from store.types import StepMetrics
from tests.conftest import ROOT, make_call
from trainer.tracing import step_span

OTEL_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
)


@pytest.fixture(autouse=True)
def no_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def exported() -> Iterator[tuple[Tracer, InMemorySpanExporter]]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield provider.get_tracer("test"), memory
    provider.shutdown()


def call(*args: Any, api: str = "chat", **fields: Any) -> CallRecord:
    """tests.conftest.make_call, through any API."""
    return msgspec.structs.replace(make_call(*args, **fields), api=api)


def trace_call(
    tracer: Tracer, records: list[CallRecord], url: str = "http://engine", headers: tuple[tuple[str, str], ...] = ()
) -> dict[str, str]:
    """What gateway/proxy.py does for a call with tracing on: the span starts with the call, its context goes to
    the engine, the records finish it. Returns the engine request's headers."""
    calls = CallTracer(tracer, url)
    first = records[0]
    span = calls.started(first.api, first.request, first.upstream_model, headers, first.started_at)
    engine_headers = calls.engine_headers(span, {"content-type": "application/json"})
    calls.ended(records, span)
    return engine_headers


def only(memory: InMemorySpanExporter) -> ReadableSpan:
    (span,) = memory.get_finished_spans()
    return span


# ---------------------------------------------------------------------------- set-up from the environment


def test_nothing_of_the_sdk_is_loaded_without_an_endpoint() -> None:
    code = (
        "import sys; from store.tracing import start_tracing; "
        "print(start_tracing('artgw-gateway'), sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))"
    )
    env = {k: v for k, v in os.environ.items() if k not in OTEL_VARIABLES}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    assert out.stdout.strip() == "None []"


@pytest.mark.parametrize(("name", "value"), [("OTEL_SDK_DISABLED", "true"), ("OTEL_TRACES_EXPORTER", "none")])
def test_the_standard_off_switches_win_over_an_endpoint(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv(name, value)
    assert start_tracing("artgw-gateway") is None


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
def test_an_endpoint_turns_tracing_on_with_the_default_service_name(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, "http://127.0.0.1:9")
    tracing = start_tracing("artgw-trainer")
    assert tracing is not None
    try:
        assert tracing.provider.resource.attributes["service.name"] == "artgw-trainer"
    finally:
        tracing.shutdown(timeout=1)


def test_otel_service_name_overrides_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gateway-eu-1")
    tracing = start_tracing("artgw-gateway")
    assert tracing is not None
    try:
        assert tracing.provider.resource.attributes["service.name"] == "gateway-eu-1"
    finally:
        tracing.shutdown(timeout=1)


def test_a_protocol_it_cannot_serve_leaves_tracing_off_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with caplog.at_level(logging.ERROR, logger="artgw.tracing"):
        assert start_tracing("artgw-gateway") is None
    assert "http/json" in caplog.text


# ---------------------------------------------------------------------------- a call's span


def test_a_chat_call_is_a_genai_client_span_with_the_rollout_and_the_step(exported) -> None:
    tracer, memory = exported
    record = make_call(
        "c1",
        100.0,
        None,
        [1, 2, 3, 4],
        ({"role": "assistant", "content": "hi"}, [7, 8]),
        rollout_id="task-1",
        step=3,
        upstream_model="my-agent@3",
        extra={"max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "n": 1},
        usage={"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
    )
    trace_call(tracer, [record], "http://127.0.0.1:8100")
    span = only(memory)
    assert span.name == "chat my-agent"
    assert span.parent is None  # the client sent no trace context: a trace of its own
    assert span.kind is SpanKind.CLIENT
    assert (span.start_time, span.end_time) == (100_000_000_000, 100_500_000_000)  # the record's own times
    assert span.status.status_code is StatusCode.UNSET
    assert dict(span.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": "my-agent",
        "gen_ai.response.model": "my-agent@3",
        "gen_ai.conversation.id": "task-1",
        "gen_ai.request.max_tokens": 16,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 4,
        "gen_ai.usage.output_tokens": 2,
        "art.rollout_id": "task-1",
        "art.model": "my-agent",
        "art.adapter.step": 3,
        "art.api": "chat",
        "http.response.status_code": 200,
        "server.address": "127.0.0.1",
        "server.port": 8100,
    }


def test_completions_with_several_prompts_is_one_span_counting_the_recorded_tokens(exported) -> None:
    """A stream that did not ask for usage: the counts are the recorded token ids, over every prompt's record."""
    tracer, memory = exported
    records = [
        call(
            f"c{i}",
            5.0,
            None,
            [1] * (3 + i),
            ChoiceRecord(0, {"role": "assistant", "content": "x"}, "length", [7] * (2 + i), [-0.5] * (2 + i)),
            api="completions",
            stream=True,
            first_token_at=5.1,
            extra={"n": 1},
        )
        for i in range(2)
    ]
    trace_call(tracer, records)
    span = only(memory)
    attributes = span.attributes or {}
    assert span.name == "text_completion my-agent"
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (3 + 4, 2 + 3)
    assert attributes["gen_ai.response.finish_reasons"] == ("length", "length")
    assert attributes["server.port"] == 80
    assert [(event.name, event.timestamp) for event in span.events] == [("first_token", 5_100_000_000)]


def test_a_failed_call_says_why_and_a_base_model_call_has_no_step(exported) -> None:
    tracer, memory = exported
    record = call(
        "c1",
        1.0,
        status="upstream_error",
        model=None,
        step=None,
        upstream_model="tiny",
        error="engine died",
        api="messages",
    )
    trace_call(tracer, [record], "http://127.0.0.1:8100")
    span = only(memory)
    attributes = span.attributes or {}
    assert span.name == "chat tiny"
    assert attributes["error.type"] == "upstream_error"
    assert attributes["http.response.status_code"] == 502
    assert attributes["art.api"] == "messages"
    assert span.status.status_code is StatusCode.ERROR and span.status.description == "engine died"
    assert not {"art.model", "art.adapter.step", "gen_ai.usage.input_tokens"} & set(attributes)


def test_a_span_that_cannot_be_made_never_fails_the_call(exported, caplog: pytest.LogCaptureFixture) -> None:
    tracer, memory = exported
    broken = call("c1", api="nonsense")  # not an API the gateway has: no operation name for it
    with caplog.at_level(logging.ERROR, logger="artgw.tracing"):
        headers = trace_call(tracer, [broken], headers=(("traceparent", CLIENT_PARENT),))
    assert memory.get_finished_spans() == ()
    assert "no span for a call to base" in caplog.text
    assert headers == {"content-type": "application/json"}  # the engine still gets its request


CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def test_a_call_joins_the_clients_trace_and_the_engine_is_told_of_its_span(exported) -> None:
    tracer, memory = exported
    record = make_call("c1", 10.0, None, [1, 2], ({"role": "assistant", "content": "hi"}, [7]))
    headers = trace_call(tracer, [record], headers=(("traceparent", CLIENT_PARENT), ("tracestate", "vendor=x")))
    span = only(memory)
    assert span.parent is not None and span.parent.is_remote
    assert (f"{span.parent.trace_id:032x}", f"{span.parent.span_id:016x}") == (CLIENT_TRACE, CLIENT_SPAN)
    assert f"{span.context.trace_id:032x}" == CLIENT_TRACE
    # The engine's request names the gateway's span as the parent, in the client's trace, with its tracestate.
    assert headers == {
        "content-type": "application/json",
        "traceparent": f"00-{CLIENT_TRACE}-{span.context.span_id:016x}-01",
        "tracestate": "vendor=x",
    }


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, ()),
        ({"traceparent": CLIENT_PARENT}, (("traceparent", CLIENT_PARENT),)),
        ({"traceparent": f" {CLIENT_PARENT.upper()} "}, (("traceparent", CLIENT_PARENT),)),  # as W3C reads it
        (
            {"traceparent": CLIENT_PARENT, "tracestate": "a=1,b=2"},
            (("traceparent", CLIENT_PARENT), ("tracestate", "a=1,b=2")),
        ),
        ({"traceparent": "00-not-a-trace-01", "tracestate": "a=1"}, ()),  # malformed: dropped with its state
        ({"traceparent": CLIENT_PARENT[:-1]}, ()),
        ({"tracestate": "a=1"}, ()),  # a state without a parent means nothing
        ({"traceparent": CLIENT_PARENT, "tracestate": "a=" + "x" * 9000}, (("traceparent", CLIENT_PARENT),)),
    ],
)
def test_trace_context_keeps_only_a_well_formed_w3c_context(
    headers: dict[str, str], expected: tuple[tuple[str, str], ...]
) -> None:
    assert trace_context(headers) == expected


# ---------------------------------------------------------------------------- RULER and the trainer


async def test_judge_calls_are_children_of_the_scoring_span(exported) -> None:
    """litellm's own `mock_response`: the real acompletion path without a network (a paid judge cannot run here)."""
    tracer, memory = exported
    answer = msgspec.json.encode(
        {"scores": {"1": {"explanation": "a", "score": 0.9}, "2": {"explanation": "b", "score": 0.1}}}
    )
    group = [
        ruler.Trajectory(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": t}])
        for t in "ab"
    ]
    with scoring_span(tracer, "g-1", "my-agent", "openai/gpt-4o-mini"):
        result = await ruler.score_group(
            group,
            judge_model="openai/gpt-4o-mini",
            litellm_params={"mock_response": answer.decode(), "api_key": "sk-unused", "temperature": 0.0},
            tracer=tracer,
        )
        scoring_ended(len(group), msgspec.to_builtins(result.usage), None)
    judge, scoring = memory.get_finished_spans()
    assert scoring.name == "score_group my-agent" and scoring.parent is None
    assert judge.name == "chat openai/gpt-4o-mini" and judge.kind is SpanKind.CLIENT
    assert judge.parent is not None and judge.parent.span_id == scoring.context.span_id
    assert judge.context.trace_id == scoring.context.trace_id
    attributes = judge.attributes or {}
    assert attributes["gen_ai.provider.name"] == "openai"
    assert attributes["gen_ai.request.temperature"] == 0.0
    assert attributes["gen_ai.usage.input_tokens"] == result.usage.prompt_tokens > 0
    assert "sk-unused" not in str(dict(attributes))
    group_attributes = scoring.attributes or {}
    assert group_attributes["art.group_id"] == "g-1" and group_attributes["art.group.size"] == 2
    assert group_attributes["art.ruler.judge_calls"] == 1


async def test_a_failed_scoring_is_an_error_span_and_tracing_off_costs_nothing(exported) -> None:
    tracer, memory = exported
    with scoring_span(tracer, "g-2", "my-agent", "openai/x"):
        scoring_ended(3, None, "RULER failed: no valid scores")
    span = only(memory)
    assert span.status.status_code is StatusCode.ERROR
    assert (span.attributes or {})["error.type"] == "ruler_failed"
    with scoring_span(None, "g-3", "my-agent", "openai/x") as nothing:  # tracing off: no span, no error
        scoring_ended(3, None, "RULER failed")
    assert nothing is None and len(memory.get_finished_spans()) == 1


def test_a_training_step_is_a_span_with_its_metrics(exported) -> None:
    tracer, memory = exported
    metrics = StepMetrics(loss=0.25, reward_mean=0.5, kl=0.01, groups=2, step_seconds=1.5, group_ids=["g1", "g2"])
    step_span(tracer, "my-agent", 4, metrics, 1_000, None)
    step_span(tracer, "my-agent", 5, metrics, 2_000, "the gateway answered 503")
    committed, failed = memory.get_finished_spans()
    assert committed.name == "train_step my-agent" and committed.start_time == 1_000
    attributes = committed.attributes or {}
    assert attributes["art.model"] == "my-agent" and attributes["art.adapter.step"] == 4
    assert attributes["art.train.committed"] is True
    assert (attributes["art.train.loss"], attributes["art.train.reward_mean"], attributes["art.train.groups"]) == (
        0.25,
        0.5,
        2,
    )
    assert "art.train.group_ids" not in attributes
    assert (failed.attributes or {})["error.type"] == "commit_failed"
    assert failed.status.status_code is StatusCode.ERROR
    step_span(None, "my-agent", 6, metrics, 3_000, None)  # tracing off
    assert len(memory.get_finished_spans()) == 2
