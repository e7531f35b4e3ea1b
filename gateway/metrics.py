"""Prometheus metrics on `GET /metrics`: `artgw_` prefix, base units, bounded labels (model, status, state).

Live counters are updated where things happen (a call ends, a judge answers). What lives in the store
(groups by state, the trainer's committed steps) is read at scrape time, so every replica reports the
same shared truth and the trainer needs no scrape target of its own: its step metrics reach Prometheus
through the gateway, which received them with each committed step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncEngine

from store.records import CallRecord
from store.groups import count_by_state
from store.tables import adapters

# LLM latencies run from milliseconds (a cached short answer) to minutes (long generations).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
JUDGE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)


class _StoreCollector(Collector):
    """Families read from the store at scrape time (refreshed by `GatewayMetrics.refresh`)."""

    def __init__(self, source: Callable[[], dict[str, Any]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        snapshot = self.source()
        depth, written, retries, spilled = snapshot.get("recorder", (0, 0, 0, 0))
        yield GaugeMetricFamily("artgw_recorder_queue_depth", "Records waiting for the store.", value=depth)
        yield CounterMetricFamily("artgw_records_written", "Records committed to the store.", value=written)
        yield CounterMetricFamily("artgw_record_write_retries", "Failed store writes, retried.", value=retries)
        yield CounterMetricFamily("artgw_records_spilled", "Records spilled to disk at shutdown.", value=spilled)
        groups = GaugeMetricFamily("artgw_groups", "Groups by trainable model and state.", labels=["model", "state"])
        for (model, state), n in sorted(snapshot.get("groups", {}).items()):
            groups.add_metric([model, state], n)
        yield groups
        steps = CounterMetricFamily("artgw_trainer_steps", "Committed training steps.", labels=["model"])
        gauges = {
            name: GaugeMetricFamily(f"artgw_trainer_{name}", help_text, labels=["model"])
            for name, help_text in (
                ("loss", "Loss of the last committed training step."),
                ("reward_mean", "Mean reward of the groups in the last committed step."),
                ("step_seconds", "Seconds the last committed step took."),
                ("tokens_per_second", "Trainable tokens per second of the last committed step."),
            )
        }
        for model, (count, metrics) in sorted(snapshot.get("trainer", {}).items()):
            steps.add_metric([model], count)
            for name, key in (
                ("loss", "loss"),
                ("reward_mean", "reward_mean"),
                ("step_seconds", "step_seconds"),
                ("tokens_per_second", "trainable_tokens_per_second"),
            ):
                if isinstance(metrics.get(key), int | float):
                    gauges[name].add_metric([model], float(metrics[key]))
        yield steps
        yield from gauges.values()


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "artgw_requests", "Chat completion calls by model and outcome.", ["model", "status"], registry=r
        )
        self.duration = Histogram(
            "artgw_request_duration_seconds", "End-to-end call latency.", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "artgw_time_to_first_token_seconds",
            "Time to the first streamed event (non-streaming: the whole answer).",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("artgw_prompt_tokens", "Prompt tokens sent to the engine.", ["model"], registry=r)
        self.completion_tokens = Counter(
            "artgw_completion_tokens", "Completion tokens sampled by the engine.", ["model"], registry=r
        )
        self.in_flight = Gauge("artgw_requests_in_flight", "Calls being served now.", ["model"], registry=r)
        self.judge_calls = Counter("artgw_ruler_judge_calls", "RULER judge calls.", ["model"], registry=r)
        self.judge_errors = Counter("artgw_ruler_judge_errors", "RULER groups that failed.", ["model"], registry=r)
        self.judge_duration = Histogram(
            "artgw_ruler_judge_duration_seconds",
            "Time to score one group with RULER.",
            ["model"],
            buckets=JUDGE_BUCKETS,
            registry=r,
        )
        self.judge_tokens = Counter("artgw_ruler_judge_tokens", "Judge tokens.", ["model", "kind"], registry=r)
        self.adapter_step = Gauge(
            "artgw_adapter_step", "Adapter step each model serves (0: base).", ["model"], registry=r
        )
        self._snapshot: dict[str, Any] = {}
        r.register(_StoreCollector(lambda: self._snapshot))

    # -- live updates

    def call_started(self, model: str) -> None:
        self.in_flight.labels(model).inc()

    def call_ended(self, model: str, record: CallRecord) -> None:
        self.in_flight.labels(model).dec()
        self.requests.labels(model, record.status).inc()
        self.duration.labels(model).observe(record.ended_at - record.started_at)
        if record.first_token_at is not None and record.status == "ok":
            self.ttft.labels(model).observe(record.first_token_at - record.started_at)
        self.prompt_tokens.labels(model).inc(len(record.prompt_token_ids))
        self.completion_tokens.labels(model).inc(sum(len(c.token_ids) for c in record.choices))

    def judged(self, model: str, seconds: float, calls: int, prompt_tokens: int, completion_tokens: int) -> None:
        self.judge_calls.labels(model).inc(calls)
        self.judge_duration.labels(model).observe(seconds)
        self.judge_tokens.labels(model, "prompt").inc(prompt_tokens)
        self.judge_tokens.labels(model, "completion").inc(completion_tokens)

    # -- at scrape time

    async def refresh(self, store: AsyncEngine, recorder: Any, served_steps: dict[str, int]) -> None:
        for model, step in served_steps.items():
            self.adapter_step.labels(model).set(step)
        async with store.connect() as conn:
            groups = await count_by_state(conn)
            committed = adapters.c.status.in_(("loaded", "unloaded"))
            counts = dict(
                (
                    await conn.execute(
                        sa.select(adapters.c.model, sa.func.count()).where(committed).group_by(adapters.c.model)
                    )
                ).all()
            )
            newest = (
                sa.select(adapters.c.model, sa.func.max(adapters.c.step).label("step"))
                .where(committed)
                .group_by(adapters.c.model)
                .subquery()
            )
            rows = await conn.execute(
                sa.select(adapters.c.model, adapters.c.metrics).join(
                    newest, (adapters.c.model == newest.c.model) & (adapters.c.step == newest.c.step)
                )
            )
            trainer = {model: (counts.get(model, 0), metrics or {}) for model, metrics in rows}
        self._snapshot = {
            "groups": groups,
            "trainer": trainer,
            "recorder": (recorder.depth(), recorder.written, recorder.retries, recorder.spilled),
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)
