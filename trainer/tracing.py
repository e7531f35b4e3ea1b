"""The trainer's OpenTelemetry span, when `store.tracing.start_tracing` turns tracing on: one per training step
(`train_step MODEL`), from the claim of its groups to its commit, with the step's metrics as attributes."""

from __future__ import annotations

import time

import msgspec
from opentelemetry.trace import Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

from store.tracing import ART_MODEL, ART_STEP
from store.types import StepMetrics


def step_span(
    tracer: Tracer | None, model: str, step: int, metrics: StepMetrics, started_ns: int, failure: str | None
) -> None:
    """Export the span of `model`'s `step` (nothing with tracing off): every number of its metrics as
    `art.train.<field>` (loss, reward_mean, kl, clip_fraction, trainable_tokens_per_second, step_seconds, ...),
    and `error.type` when its commit failed (the step then does not count)."""
    if tracer is None:
        return
    attributes: dict[str, AttributeValue] = {ART_MODEL: model, ART_STEP: step, "art.train.committed": failure is None}
    for key, value in msgspec.structs.asdict(metrics).items():
        if isinstance(value, int | float):
            attributes[f"art.train.{key}"] = value
    span = tracer.start_span(f"train_step {model}", attributes=attributes, start_time=started_ns)
    if failure is not None:
        span.set_attribute("error.type", "commit_failed")
        span.set_status(Status(StatusCode.ERROR, failure))
    span.end(end_time=time.time_ns())
