"""OpenTelemetry traces over OTLP/HTTP (`OTEL_EXPORTER_OTLP_ENDPOINT`), received by a real receiver started here
(`POST /v1/traces`, decoded with OpenTelemetry's own protobufs).

1. A gateway in front of the real vLLM: calls through chat (the OpenAI SDK), Anthropic Messages (Anthropic's SDK)
   and Responses arrive as GenAI spans whose token counts are what each API answered, with the rollout id and the
   adapter step; a group scored by RULER is a `score_group` span with each judge call as its child. The judge is
   litellm's own `mock_response` (the real litellm call path, no network): a paid judge API cannot run here.
2. A client's W3C `traceparent`: the call's span is a child of the client's span, and the engine is sent the
   gateway's span as its parent (the stand-in engine shows what it got); with tracing off it is passed on.
   The collector unreachable (a closed port): every call is answered 200, the gateway keeps serving and still
   stops cleanly. Against the stand-in engine (tests/stub_engine.py): calls of ~1 ms, so the exporter's retries
   would show if they were on the calls' path.
3. A training step (`artgw train` on the tiny model, rollouts written to the store, the stand-in engine loading the
   adapter) arrives as a `train_step` span carrying the step's metrics as the gateway reports them.
"""

from __future__ import annotations

import gzip
import json
import random
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from tests.conftest import (
    GatewayProcess,
    free_port,
    make_call,
    poll,
    start_gateway,
    start_stub,
    start_trainer,
    stop_group,
    write_records,
)

MODEL = "my-agent"
JUDGE = "openai/gpt-4o-mini"  # any model litellm knows; `mock_response` answers for it
FAST_BATCHES = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # the SDK's batch delay (default 5 s), so tests wait less


@dataclass(frozen=True)
class Span:
    """One received span, decoded."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    status: int
    attributes: dict[str, Any]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


class OtlpReceiver:
    """A real OTLP/HTTP trace receiver on a free port: what a collector (Jaeger, Langfuse, ...) is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    def take(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        Span(
                            service=str(resource.get("service.name")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            status=span.status.code,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        with self._lock:
            self.posts += 1
            self.spans.extend(spans)

    def find(self, **attributes: Any) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if all(s.attributes.get(k) == v for k, v in attributes.items())]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


def judge_answer(count: int) -> str:
    """A valid RULER answer scoring `count` trajectories (the schema's shape, ruler/_prompt.py)."""
    scores = {str(i): {"explanation": f"reason {i}", "score": i / count} for i in range(1, count + 1)}
    return msgspec.json.encode({"scores": scores}).decode()


@pytest.mark.engine
def test_calls_and_judge_calls_arrive_as_genai_spans(
    vllm_url: str, receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> None:
    where = tmp_path_factory.mktemp("otel")
    judges = where / "judges.json"  # the operator's judge: litellm's mock answers for it, no call leaves
    judges.write_text(
        json.dumps({JUDGE: {"model": JUDGE, "litellm_params": {"mock_response": judge_answer(3), "api_key": "x"}}})
    )
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "ARTGW_JUDGES_FILE": str(judges), **FAST_BATCHES}
    gateway = start_gateway(where, "--upstream", vllm_url, env=env)
    try:
        chat_id, messages_id, responses_id = (f"otel-{api}-{uuid.uuid4().hex[:8]}" for api in ("c", "m", "r"))
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Did the motion pass?"}],
            max_tokens=8,
            temperature=0.7,
            extra_headers={"X-ART-Rollout-Id": chat_id},
        )
        claude = anthropic.Anthropic(base_url=f"{gateway.url}/rollouts/{messages_id}", api_key="unused", max_retries=0)
        message = claude.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Tell me if it passed."}]
        )
        response = client.responses.create(
            model=MODEL,
            input="Was it carried?",
            max_output_tokens=8,
            extra_headers={"X-ART-Rollout-Id": responses_id},
        )
        assert chat.usage is not None and response.usage is not None

        # RULER on the three rollouts.
        group = httpx.post(
            f"{gateway.base_url}/art/groups",
            json={
                "model": MODEL,
                "rollouts": [{"rollout_id": rid} for rid in (chat_id, messages_id, responses_id)],
                "ruler": {"judge_model": JUDGE},
            },
            timeout=30,
            headers=gateway.admin,
        )
        assert group.status_code == 201, group.text
        group_id = group.json()["id"]
        poll(
            lambda: (
                httpx.get(f"{gateway.base_url}/art/groups/{group_id}", timeout=10, headers=gateway.admin).json()[
                    "state"
                ]
                == "ready"
            ),
            60,
            "RULER (litellm's mock judge) to score the group",
        )

        poll(
            lambda: (
                all(receiver.find(**{"art.rollout_id": r}) for r in (chat_id, messages_id, responses_id))
                and receiver.find(**{"art.group_id": group_id})
            ),
            30,
            "the call and scoring spans at the receiver",
        )
        expected_usage = {
            chat_id: ("chat", chat.usage.prompt_tokens, chat.usage.completion_tokens),
            messages_id: ("messages", message.usage.input_tokens, message.usage.output_tokens),
            responses_id: ("responses", response.usage.input_tokens, response.usage.output_tokens),
        }
        for rollout_id, (api, input_tokens, output_tokens) in expected_usage.items():
            (span,) = receiver.find(**{"art.rollout_id": rollout_id})
            assert span.name == f"chat {MODEL}"
            assert span.kind == SpanProto.SPAN_KIND_CLIENT
            assert span.service == "artgw-gateway"
            assert span.status == Status.STATUS_CODE_UNSET
            a = span.attributes
            assert a["art.api"] == api
            assert a["gen_ai.operation.name"] == "chat"
            assert a["gen_ai.provider.name"] == "vllm"
            assert a["gen_ai.request.model"] == MODEL
            assert a["gen_ai.response.model"] == "tiny"  # step 0: the base weights serve `my-agent`
            assert (a["art.model"], a["art.adapter.step"]) == (MODEL, 0)
            assert a["gen_ai.conversation.id"] == rollout_id
            assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (input_tokens, output_tokens)
            assert a["gen_ai.request.max_tokens"] == 8
            assert len(a["gen_ai.response.finish_reasons"]) == 1
        chat_span = receiver.find(**{"art.rollout_id": chat_id})[0]
        assert chat_span.attributes["gen_ai.request.temperature"] == 0.7
        assert chat_span.attributes["gen_ai.response.finish_reasons"] == [chat.choices[0].finish_reason]

        (scoring,) = receiver.find(**{"art.group_id": group_id})
        assert scoring.name == f"score_group {MODEL}"
        assert scoring.parent_span_id == ""  # a trace of its own
        assert (scoring.attributes["art.group.size"], scoring.attributes["art.ruler.judge_calls"]) == (3, 1)
        judges = [s for s in receiver.find() if s.parent_span_id == scoring.span_id]
        assert [j.name for j in judges] == [f"chat {JUDGE}"]
        judge = judges[0]
        assert judge.trace_id == scoring.trace_id
        assert judge.kind == SpanProto.SPAN_KIND_CLIENT
        assert judge.attributes["gen_ai.provider.name"] == "openai"
        assert judge.attributes["gen_ai.usage.input_tokens"] > 0
    finally:
        code = gateway.stop()
    assert code == 0


def test_an_unreachable_collector_costs_the_calls_nothing(tmp_path: Path) -> None:
    stub_url, stub = start_stub()
    closed = free_port()  # nothing listens there: every export is refused and retried until its timeout
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed}", **FAST_BATCHES}
    gateway = start_gateway(tmp_path, "--upstream", stub_url, env=env)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        seconds = []
        with httpx.Client(timeout=30) as client:
            for i in range(200):
                started = time.perf_counter()
                answer = client.post(
                    f"{gateway.base_url}/chat/completions", json=body, headers={"X-ART-Rollout-Id": f"u{i}"}
                )
                seconds.append(time.perf_counter() - started)
                assert answer.status_code == 200, answer.text
        # The exports were tried, and failed, while the calls were answered.
        poll(lambda: "Failed to export" in gateway.log(), 30, "the exporter to give up on the closed port")
        assert httpx.get(f"{gateway.url}/readyz", timeout=10).status_code == 200
        assert httpx.post(f"{gateway.base_url}/chat/completions", json=body, timeout=30).status_code == 200
        ms = sorted(s * 1000 for s in seconds)
        print(f"200 calls, collector unreachable: p50 {statistics.median(ms):.2f} ms, max {ms[-1]:.2f} ms")
    finally:
        # The spans still queued are given a few seconds, not the SDK's 30: it exits by itself within 15 s.
        code = gateway.stop(grace=15)
        stop_group(stub)
    assert code == 0


def test_a_call_joins_the_clients_trace_and_passes_its_span_to_the_engine(
    receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A client that traces (a `traceparent` header, as OpenTelemetry's httpx or requests instrumentation sends it)
    sees the gateway's call span as the child of its own, and the engine (the stand-in, which shows the header it
    got) is told the gateway's span as its parent, so vLLM's spans nest under it. With tracing off the gateway
    passes the client's context on unchanged."""
    trace_id, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    traceparent = f"00-{trace_id}-{client_span}-01"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    stub_url, stub = start_stub()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, **FAST_BATCHES}
    traced = start_gateway(tmp_path_factory.mktemp("traced"), "--upstream", stub_url, env=env)
    untraced = start_gateway(tmp_path_factory.mktemp("untraced"), "--upstream", stub_url)
    try:
        rollout_id = f"traced-{uuid.uuid4().hex[:8]}"
        answer = httpx.post(
            f"{traced.base_url}/chat/completions",
            json=body,
            headers={"traceparent": traceparent, "tracestate": "app=1", "X-ART-Rollout-Id": rollout_id},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        engine_saw = httpx.get(f"{stub_url}/stats", timeout=10).json()["last_traceparent"]
        poll(lambda: receiver.find(**{"art.rollout_id": rollout_id}), 30, "the call's span at the receiver")
        (span,) = receiver.find(**{"art.rollout_id": rollout_id})
        assert (span.trace_id, span.parent_span_id) == (trace_id, client_span)
        assert engine_saw == f"00-{trace_id}-{span.span_id}-01"

        # A malformed context is dropped: the call is answered, as a trace of its own.
        other_id = f"traced-{uuid.uuid4().hex[:8]}"
        headers = {"traceparent": "00-nonsense-01", "X-ART-Rollout-Id": other_id}
        answer = httpx.post(f"{traced.base_url}/chat/completions", json=body, headers=headers, timeout=30)
        assert answer.status_code == 200, answer.text
        poll(lambda: receiver.find(**{"art.rollout_id": other_id}), 30, "the second call's span")
        (span,) = receiver.find(**{"art.rollout_id": other_id})
        assert span.parent_span_id == "" and span.trace_id != trace_id

        answer = httpx.post(
            f"{untraced.base_url}/chat/completions", json=body, headers={"traceparent": traceparent}, timeout=30
        )
        assert answer.status_code == 200, answer.text
        assert httpx.get(f"{stub_url}/stats", timeout=10).json()["last_traceparent"] == traceparent
    finally:
        codes = (traced.stop(), untraced.stop())
        stop_group(stub)
    assert codes == (0, 0)


def record_group(gateway: GatewayProcess) -> None:
    """One group of three one-call rollouts with caller rewards, the calls written to the store directly (random
    token ids: the stand-in engine samples one token), as tests/integration/test_trainer_distributed.py does."""
    rng = random.Random(16)
    records = []
    for i in range(3):
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randrange(6, 20))]
        sampled = [rng.randrange(10, 1000) for _ in range(rng.randrange(3, 12))]
        reply = ({"role": "assistant", "content": f"answer {i}"}, sampled)
        records.append(make_call(f"call-{i}", float(i), None, prompt, reply, rollout_id=f"otel-rollout-{i}"))

    write_records(gateway.db_path, records)
    answer = httpx.post(
        f"{gateway.base_url}/art/groups",
        json={
            "model": MODEL,
            "rollouts": [{"rollout_id": f"otel-rollout-{i}", "reward": r} for i, r in enumerate((1.0, 0.0, 0.5))],
        },
        timeout=30,
        headers=gateway.admin,
    )
    assert answer.status_code == 201, answer.text


def test_a_training_step_arrives_as_a_span_with_its_metrics(
    tiny_model: Path, receiver: OtlpReceiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stub_url, stub = start_stub()
    gateway = start_gateway(tmp_path, "--upstream", stub_url)  # no tracing for this gateway: the trainer's alone
    try:
        record_group(gateway)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)  # start_trainer passes os.environ on
        monkeypatch.setenv("OTEL_SERVICE_NAME", "trainer-under-test")
        proc, log_path = start_trainer(
            gateway,
            tiny_model,
            "--groups-per-step",
            "1",
            "--max-wait",
            "1",
            "--max-steps",
            "1",
            "--lease-seconds",
            "30",
        )
        try:
            assert proc.wait(300) == 0, log_path.read_text(errors="replace")[-3000:]
        finally:
            stop_group(proc)
        # Flushed at exit: the span is there once the trainer is gone.
        (span,) = [s for s in receiver.find(**{"art.model": MODEL}) if s.service == "trainer-under-test"]
        assert span.name == f"train_step {MODEL}"
        assert span.attributes["art.adapter.step"] == 1 and span.attributes["art.train.committed"] is True
        (step,) = [
            s
            for s in httpx.get(f"{gateway.base_url}/art/models/{MODEL}", timeout=10, headers=gateway.admin).json()[
                "steps"
            ]
            if s["step"] == 1
        ]
        metrics = step["metrics"]
        for key in (
            "loss",
            "reward_mean",
            "reward_std",
            "kl",
            "clip_fraction",
            "grad_norm",
            "groups",
            "trainable_tokens",
        ):
            assert span.attributes[f"art.train.{key}"] == metrics[key], key
        assert span.attributes["art.train.groups"] == 1
    finally:
        gateway.stop()
        stop_group(stub)
