"""Prometheus metrics on `GET /metrics`: `artgw_` prefix, base units, bounded labels (model, status, state).

Live counters are updated where things happen (a call ends, a judge answers). What lives in the store
(groups by state, the trainer's committed steps) is read at scrape time, so every replica reports the
same shared truth and the trainer needs no scrape target of its own: its step metrics reach Prometheus
through the gateway, which received them with each committed step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from engine.pool import EnginePool
from store.adapters import TrainerSummary, trainer_summaries
from store.groups import count_by_state
from store.judge_report import JudgeReport
from store.promotions import canary_rewards, evaluation_counts, promotion_counts
from store.records import CallRecord
from store.trajectories import Trajectory
from store.types import GroupState

# LLM latencies run from milliseconds (a cached short answer) to minutes (long generations).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A scrape waits at most this long for the store's figures (Prometheus' own scrape timeout is 10 s by default).
STORE_READ_SECONDS = 3.0
log = logging.getLogger("artgw.metrics")
JUDGE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)


class StoreSnapshot(msgspec.Struct, frozen=True):
    """What `/metrics` shows from the store and the recorder, read at scrape time."""

    groups: dict[tuple[str, GroupState], int] = {}
    trainer: dict[str, TrainerSummary] = {}
    recorder: tuple[int, int, int, int] = (0, 0, 0, 0)  # queue depth, written, retries, spilled
    promotions: dict[tuple[str, str, str], int] = {}  # (model, action, actor) -> count
    evaluations: dict[tuple[str, str], int] = {}  # (model, status) -> count
    canary_arms: dict[tuple[str, str], list[float]] = {}  # (model, candidate|promoted) -> rewards of a canary


# The trainer gauges: metric name suffix, help, the StepMetrics field it shows.
_TRAINER_GAUGES = (
    ("loss", "Loss of the last committed training step.", "loss"),
    ("reward_mean", "Mean reward of the groups in the last committed step.", "reward_mean"),
    ("step_seconds", "Seconds the last committed step took.", "step_seconds"),
    ("tokens_per_second", "Trainable tokens per second of the last committed step.", "trainable_tokens_per_second"),
)


class _StoreCollector(Collector):
    """Families read from the store at scrape time (refreshed by `GatewayMetrics.refresh`)."""

    def __init__(self, source: Callable[[], StoreSnapshot]) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        snapshot = self.source()
        depth, written, retries, spilled = snapshot.recorder
        yield GaugeMetricFamily("artgw_recorder_queue_depth", "Records waiting for the store.", value=depth)
        yield CounterMetricFamily("artgw_records_written", "Records committed to the store.", value=written)
        yield CounterMetricFamily("artgw_record_write_retries", "Failed store writes, retried.", value=retries)
        yield CounterMetricFamily("artgw_records_spilled", "Records spilled to disk at shutdown.", value=spilled)
        groups = GaugeMetricFamily("artgw_groups", "Groups by trainable model and state.", labels=["model", "state"])
        for (model, state), n in sorted(snapshot.groups.items()):
            groups.add_metric([model, state], n)
        yield groups
        steps = CounterMetricFamily("artgw_trainer_steps", "Committed training steps.", labels=["model"])
        gauges = [
            (GaugeMetricFamily(f"artgw_trainer_{name}", help_text, labels=["model"]), field)
            for name, help_text, field in _TRAINER_GAUGES
        ]
        for model, summary in sorted(snapshot.trainer.items()):
            steps.add_metric([model], summary.committed_steps)
            for gauge, field in gauges:
                gauge.add_metric([model], float(getattr(summary.last, field)))
        yield steps
        moves = CounterMetricFamily(
            "artgw_promotions",
            "Changes of the step `NAME` serves, by action (promote, rollback) and actor (always, gate, admin).",
            labels=["model", "action", "actor"],
        )
        for (model, action, actor), n in sorted(snapshot.promotions.items()):
            moves.add_metric([model, action, actor], n)
        yield moves
        gate = CounterMetricFamily(
            "artgw_gate_evaluations",
            "Steps evaluated on an eval set by the promotion gate, by outcome (passed, failed, error, running).",
            labels=["model", "status"],
        )
        for (model, status), n in sorted(snapshot.evaluations.items()):
            gate.add_metric([model, status], n)
        yield gate
        means = GaugeMetricFamily(
            "artgw_canary_reward_mean", "Mean live reward of each arm of a running canary.", labels=["model", "arm"]
        )
        counts = GaugeMetricFamily(
            "artgw_canary_rewarded_rollouts",
            "Rewarded rollouts of each arm of a running canary.",
            labels=["model", "arm"],
        )
        for (model, arm), rewards in sorted(snapshot.canary_arms.items()):
            counts.add_metric([model, arm], len(rewards))
            if rewards:
                means.add_metric([model, arm], sum(rewards) / len(rewards))
        yield means
        yield counts
        yield from (gauge for gauge, _ in gauges)


class _JudgeCollector(Collector):
    """RULER's agreement with the callers' rewards, from the newest judge report of each model (made by
    gateway/judge_report.py, which keeps them fresh without a store read on every scrape)."""

    def __init__(self, source: Callable[[], dict[str, JudgeReport]]) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        labels = ["model", "rubric", "judge"]
        agreement = GaugeMetricFamily(
            "artgw_judge_agreement",
            "Mean per-group Spearman correlation of RULER's scores with the callers' rewards, per rubric (the "
            "first 12 hex digits of its sha256) and judge model.",
            labels=labels,
        )
        flagged = GaugeMetricFamily(
            "artgw_judge_flagged", "1 if the rubric's agreement is below --judge-agreement-threshold.", labels=labels
        )
        for model, report in sorted(self.source().items()):
            for rubric in report.rubrics:
                names = [model, rubric.rubric_id, rubric.judge_model]
                if rubric.spearman_mean is not None:  # no ranked group yet: no figure to show
                    agreement.add_metric(names, rubric.spearman_mean)
                flagged.add_metric(names, 1.0 if rubric.state == "flagged" else 0.0)
        yield agreement
        yield flagged


class _RecorderCollector(Collector):
    """The recorder's journal and refusals, read live at scrape time (no store needed: they say most when
    the store is away)."""

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder

    def collect(self) -> Iterator[Any]:
        r = self.recorder
        yield GaugeMetricFamily(
            "artgw_journal_bytes",
            "Bytes of the record journal on disk: segments holding uncommitted records, and the one appended to.",
            value=r.journal.bytes,
        )
        yield GaugeMetricFamily(
            "artgw_journal_segments", "Segment files of the record journal.", value=r.journal.segment_count()
        )
        yield GaugeMetricFamily(
            "artgw_recorder_memory_bytes", "Bytes of records waiting in memory for the store.", value=r.memory_bytes()
        )
        yield CounterMetricFamily(
            "artgw_records_rejected", "Records the store refused, set aside in DATA/rejected/.", value=r.rejected
        )
        yield CounterMetricFamily(
            "artgw_journal_errors",
            "Records the journal could not take (disk full, I/O error): their calls were refused with 503.",
            value=r.journal_errors,
        )
        yield CounterMetricFamily(
            "artgw_journal_damaged",
            "Damaged stretches of the record journal skipped on reading (each usually one entry; the entries after "
            "it are read on, and its segment is kept in DATA/journal/damaged/).",
            value=r.journal.damaged_stretches,
        )
        yield CounterMetricFamily(
            "artgw_journal_damaged_bytes",
            "Bytes of the record journal skipped as damaged (see artgw_journal_damaged).",
            value=r.journal.damaged_bytes,
        )
        yield GaugeMetricFamily(
            "artgw_journal_up",
            "1 while the journal takes records; 0 from a failed append until the disk takes writes again.",
            value=0 if r.journal_failure is not None else 1,
        )


class _EngineCollector(Collector):
    """Each engine's calls, calls in flight and health (engine/pool.py), read live at scrape time."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Any]:
        calls = CounterMetricFamily("artgw_engine_calls", "Calls this gateway sent to each engine.", labels=["engine"])
        in_flight = GaugeMetricFamily(
            "artgw_engine_in_flight", "Calls of this gateway in flight on each engine.", labels=["engine"]
        )
        healthy = GaugeMetricFamily(
            "artgw_engine_healthy",
            "1 while an engine is in rotation; 0 from a failed call's connection or health probe until its probe "
            "answers again.",
            labels=["engine"],
        )
        quarantined = GaugeMetricFamily(
            "artgw_engine_quarantined",
            "1 while an engine is out of rotation because it does not hold every LoRA step calls are routed to (a "
            "load it failed); 0 once a retry loaded them all.",
            labels=["engine"],
        )
        for engine in self.pool.engines:
            calls.add_metric([engine.url], engine.calls)
            in_flight.add_metric([engine.url], engine.in_flight)
            healthy.add_metric([engine.url], 1 if engine.healthy else 0)
            quarantined.add_metric([engine.url], 0 if engine.quarantined is None else 1)
        moves = CounterMetricFamily(
            "artgw_engine_moves",
            "Rollouts moved off the engine that served them (unhealthy, quarantined, saturated, or unreachable at a "
            "call).",
            labels=["reason"],
        )
        for reason, count in sorted(self.pool.moves.items()):
            moves.add_metric([reason], count)
        yield from (calls, in_flight, healthy, quarantined, moves)


class _ModelSeries:
    """One model's series of the calls' metrics, looked up once: `labels()` takes a lock and builds a key on every
    call, several times a call on the hot path."""

    __slots__ = ("completion_tokens", "duration", "in_flight", "prompt_tokens", "requests", "ttft")

    def __init__(self, metrics: GatewayMetrics, model: str) -> None:
        self.in_flight = metrics.in_flight.labels(model)
        self.duration = metrics.duration.labels(model)
        self.ttft = metrics.ttft.labels(model)
        self.prompt_tokens = metrics.prompt_tokens.labels(model)
        self.completion_tokens = metrics.completion_tokens.labels(model)
        self.requests: dict[str, Counter] = {}  # by the call's status

    def ended(self, metrics: GatewayMetrics, model: str, status: str) -> Counter:
        counter = self.requests.get(status)
        if counter is None:
            counter = self.requests[status] = metrics.requests.labels(model, status)
        return counter


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._series: dict[str, _ModelSeries] = {}  # each model's series of the calls' metrics (call_started)
        r = self.registry
        self.requests = Counter(
            "artgw_requests", "Inference calls (every API) by model and outcome.", ["model", "status"], registry=r
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
        self.judge_spread = Histogram(
            "artgw_ruler_judge_spread",
            "How much a RULER panel's judgements of a group disagree: the mean over its rollouts of the standard "
            "deviation of their scores (0: every judgement alike; groups judged once are not counted).",
            ["model"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5),
            registry=r,
        )
        self.judge_duration = Histogram(
            "artgw_ruler_judge_duration_seconds",
            "Time to score one group with RULER.",
            ["model"],
            buckets=JUDGE_BUCKETS,
            registry=r,
        )
        self.judge_tokens = Counter("artgw_ruler_judge_tokens", "Judge tokens.", ["model", "kind"], registry=r)
        self.adapter_step = Gauge(
            "artgw_adapter_step", "Promoted step each model serves as NAME (0: base).", ["model"], registry=r
        )
        self.canary_share = Gauge(
            "artgw_canary_share",
            "Share of NAME's rollouts served by a canary step (0: none runs).",
            ["model"],
            registry=r,
        )
        self.latest_step = Gauge(
            "artgw_adapter_latest_step", "Newest committed step of each model (NAME@latest).", ["model"], registry=r
        )
        self.broken_steps = Gauge(
            "artgw_adapter_broken_steps",
            "Committed steps of each model whose checkpoint no longer loads (found at a reload; never served again).",
            ["model"],
            registry=r,
        )
        # One rollout, one sequence: what the rollouts put in groups (what training reads) assemble into.
        self.grouped_calls = Counter(
            "artgw_grouped_rollout_calls", "Answered calls of the rollouts put in groups.", ["model"], registry=r
        )
        self.grouped_sequences = Counter(
            "artgw_grouped_rollout_sequences",
            "Sequences those rollouts assemble into: one a rollout when each call continues its rollout's tokens, "
            "one a call when none does.",
            ["model"],
            registry=r,
        )
        self.sequence_splits = Counter(
            "artgw_sequence_splits",
            "Why a grouped rollout's sequence does not continue the one before, by cause (store/trajectories.py).",
            ["model", "cause"],
            registry=r,
        )
        self.continued_calls = Counter(
            "artgw_continued_calls",
            "Calls that continue their rollout, by how they were served: spliced (from the model's own tokens: one "
            "sequence), or rendered anew (rerendered: --continuity rerender; no_scale_out: the engine lacks "
            "--enable-scale-out; template_mismatch, render_failed).",
            ["model", "how"],
            registry=r,
        )
        self.continuation_reads = Counter(
            "artgw_continuation_reads",
            "Reads of a rollout's last call from the store by a call that may continue it and whose gateway does "
            "not hold that call (a restart, another replica, pushed out of memory), by what they found: found, "
            "none (not written yet: the call is rendered anew, its split says state_lost), failed (the store "
            "failed or was slower than --continuation-read-seconds).",
            ["found"],
            registry=r,
        )
        self.engine_resends = Counter(
            "artgw_engine_resends",
            "Calls sent to the engine again because it cut the connection before answering, by the error seen "
            "(ServerDisconnectedError, ClientOSError): a few at a burst's start are normal, a steady rate is not.",
            ["model", "error"],
            registry=r,
        )
        self.store_up = Gauge(
            "artgw_store_up",
            "1 if the store answered the last scrape's reads and the recorder's last write, else 0.",
            registry=r,
        )
        self._snapshot = StoreSnapshot()
        r.register(_StoreCollector(lambda: self._snapshot))
        self._judge_reports: dict[str, JudgeReport] = {}
        r.register(_JudgeCollector(lambda: self._judge_reports))

    def watch_recorder(self, recorder: Any) -> None:
        """Export the recorder's journal and refusal figures (recording/recorder.py)."""
        self.registry.register(_RecorderCollector(recorder))

    def watch_engines(self, pool: EnginePool) -> None:
        """Export each engine's calls, in-flight calls and health (engine/pool.py)."""
        self.registry.register(_EngineCollector(pool))

    # -- live updates

    def _of(self, model: str) -> _ModelSeries:
        series = self._series.get(model)
        if series is None:
            series = self._series[model] = _ModelSeries(self, model)
        return series

    def call_started(self, model: str) -> None:
        self._of(model).in_flight.inc()

    def call_ended(self, model: str, record: CallRecord) -> None:
        series = self._of(model)
        series.in_flight.dec()
        series.ended(self, model, record.status).inc()
        series.duration.observe(record.ended_at - record.started_at)
        if record.first_token_at is not None and record.status == "ok":
            series.ttft.observe(record.first_token_at - record.started_at)
        series.prompt_tokens.inc(len(record.prompt_token_ids))
        series.completion_tokens.inc(sum(len(c.token_ids) for c in record.choices))

    def call_withdrawn(self, model: str) -> None:
        self._of(model).in_flight.dec()

    def engine_resent(self, model: str, error: str) -> None:
        self.engine_resends.labels(model, error).inc()

    def call_continued(self, model: str, how: str) -> None:
        self.continued_calls.labels(model, how).inc()

    def continuation_read(self, found: str) -> None:
        self.continuation_reads.labels(found).inc()

    def rollouts_grouped(self, model: str, trajectories: Iterable[Trajectory]) -> None:
        for trajectory in trajectories:
            self.grouped_calls.labels(model).inc(sum(len(s.call_ids) for s in trajectory.sequences))
            self.grouped_sequences.labels(model).inc(len(trajectory.sequences))
            for sequence in trajectory.sequences:
                if sequence.split_cause is not None:
                    self.sequence_splits.labels(model, sequence.split_cause).inc()

    def judged(
        self,
        model: str,
        seconds: float,
        calls: int,
        prompt_tokens: int,
        completion_tokens: int,
        spread: float | None = None,
    ) -> None:
        """A group scored; `spread`: a panel's judgements' mean disagreement over it (None: one judgement)."""
        if spread is not None:
            self.judge_spread.labels(model).observe(spread)
        self.judge_calls.labels(model).inc(calls)
        self.judge_duration.labels(model).observe(seconds)
        self.judge_tokens.labels(model, "prompt").inc(prompt_tokens)
        self.judge_tokens.labels(model, "completion").inc(completion_tokens)

    def judge_reported(self, report: JudgeReport) -> None:
        """The model's newest judge report: its rubrics' series replace the ones of the last report."""
        self._judge_reports = {**self._judge_reports, report.model: report}

    def keep_judge_reports(self, models: Collection[str]) -> None:
        """Forget the reports of models no longer served (retired): their series leave /metrics."""
        self._judge_reports = {m: r for m, r in self._judge_reports.items() if m in models}

    # -- at scrape time

    async def refresh(
        self,
        engine: AsyncEngine,
        recorder: Any,
        served_steps: dict[str, tuple[int, int]],
        canaries: dict[str, float] | None = None,
        broken: dict[str, int] | None = None,
    ) -> None:
        """`served_steps`: model -> (promoted step, newest step); `canaries`: model -> share of a canary running;
        `broken`: model -> its steps that no longer load."""
        for model, (promoted, latest) in served_steps.items():
            self.broken_steps.labels(model).set((broken or {}).get(model, 0))
            self.adapter_step.labels(model).set(promoted)
            self.latest_step.labels(model).set(latest)
            self.canary_share.labels(model).set((canaries or {}).get(model, 0.0))
        old = self._snapshot
        groups, trainer, promotions, evaluations = old.groups, old.trainer, old.promotions, old.evaluations
        canary_arms = old.canary_arms
        try:
            async with asyncio.timeout(STORE_READ_SECONDS), engine.connect() as conn:
                groups = await count_by_state(conn)
                trainer = await trainer_summaries(conn)
                promotions = await promotion_counts(conn)
                evaluations = await evaluation_counts(conn)
                canary_arms = await canary_rewards(conn)
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            # /metrics must answer most when the store is away: the store's families keep their last values
            # and artgw_store_up says they are stale.
            log.warning("metrics: the store is unavailable (%s); store figures are from the last good scrape", exc)
            self.store_up.set(0)
        else:
            self.store_up.set(0 if recorder.store_failure is not None else 1)  # reads work, writes may not
        self._snapshot = StoreSnapshot(
            groups,
            trainer,
            (recorder.depth(), recorder.written, recorder.retries, recorder.spilled),
            promotions,
            evaluations,
            canary_arms,
        )

    async def scrape(
        self,
        engine: AsyncEngine,
        recorder: Any,
        served_steps: dict[str, tuple[int, int]],
        canaries: dict[str, float] | None = None,
        broken: dict[str, int] | None = None,
    ) -> bytes:
        """The Prometheus text of a scrape: store-backed families refreshed first."""
        await self.refresh(engine, recorder, served_steps, canaries, broken)
        return self.render()

    def render(self) -> bytes:
        return generate_latest(self.registry)
