"""OpenTelemetry traces, on only when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) names
a collector. The gateway exports a span per inference call and per RULER scoring (its judge calls as children),
the trainer a span per step; both set tracing up here, store/ being the one room they may both import
(tests/unit/test_architecture.py). Nothing here touches the store.

Every other setting is OpenTelemetry's own variable, read by its SDK: `OTEL_SERVICE_NAME` (default
`artgw-gateway` / `artgw-trainer`), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS` (a
collector's auth), `..._PROTOCOL` (`http/protobuf`, the default, or `grpc` where its exporter is installed),
`..._TIMEOUT`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*` (batching). Spans leave through the SDK's
`BatchSpanProcessor`: a bounded queue and a thread of its own, so a slow or unreachable collector costs a call
nothing (spans are dropped when the queue is full), and an export gives up after `EXPORT_TIMEOUT_SECONDS`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the SDK is imported only when tracing is on
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

log = logging.getLogger("artgw.tracing")

# ART's own span attributes, beside the GenAI semantic conventions' `gen_ai.*`.
ART_MODEL = "art.model"  # the trainable model's name
ART_STEP = "art.adapter.step"  # the adapter step that served a call (0: the base weights), or a step trained
ART_ROLLOUT_ID = "art.rollout_id"

EXPORT_TIMEOUT_SECONDS = 2.0  # one export, retries included, unless OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT says (SDK: 10)
SHUTDOWN_SECONDS = 5.0  # what is still queued at exit is exported for at most this long, then dropped


def _env(name: str) -> str:
    """`OTEL_EXPORTER_OTLP_TRACES_<name>`, else `OTEL_EXPORTER_OTLP_<name>` (the spec's precedence); "" if unset."""
    return (
        os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}") or ""
    ).strip()


def tracing_requested() -> bool:
    """A collector is named, and neither `OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none` says otherwise."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(_env("ENDPOINT"))


@dataclass(frozen=True)
class Tracing:
    """A tracer provider exporting over OTLP, for one process."""

    provider: TracerProvider

    def tracer(self, name: str) -> Tracer:
        return self.provider.get_tracer(name)

    def shutdown(self, timeout: float = SHUTDOWN_SECONDS) -> None:
        """Export what is queued, waiting at most `timeout` seconds: an unreachable collector does not hold up an
        exit (the SDK's own shutdown would wait out every queued batch's export timeout)."""
        worker = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        worker.start()
        worker.join(timeout)


def start_tracing(service_name: str) -> Tracing | None:
    """Tracing for this process when a collector is named (see the module's doc), else None: no provider, no
    exporter, no thread. `service_name` is the default of `OTEL_SERVICE_NAME`. A protocol that cannot be
    served is logged and leaves tracing off: observability never stops the process it watches."""
    if not tracing_requested():
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    protocol = _env("PROTOCOL") or "http/protobuf"
    timeout = None if _env("TIMEOUT") else EXPORT_TIMEOUT_SECONDS  # the SDK reads the variable itself
    exporter: SpanExporter
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(timeout=timeout)
    elif protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
        except ImportError:
            log.error("tracing off: OTLP over gRPC needs `pip install opentelemetry-exporter-otlp-proto-grpc`")
            return None
        exporter = GrpcSpanExporter(timeout=timeout)
    else:
        log.error("tracing off: OTLP protocol %r is not supported here (http/protobuf or grpc)", protocol)
        return None
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    # shutdown_on_exit=False: `Tracing.shutdown` bounds the wait; the SDK's atexit hook would not.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing: spans go to %s (%s) as %s", _env("ENDPOINT"), protocol, resource.attributes[SERVICE_NAME])
    return Tracing(provider)


@contextmanager
def traced(service_name: str, tracer_name: str) -> Iterator[Tracer | None]:
    """`start_tracing`'s tracer called `tracer_name` for the `with` (None with tracing off), shut down after it."""
    tracing = start_tracing(service_name)
    try:
        yield tracing.tracer(tracer_name) if tracing is not None else None
    finally:
        if tracing is not None:
            tracing.shutdown()
