"""`GET /v1/art/models/{name}/judge-report`: how far RULER's rankings agree with the callers' own rewards.

The statistics are store/judge_report.py's; this service guards the model, runs them off the event loop
(a report over many groups is CPU work), and keeps the judge gauges of `/metrics` fresh: each report it
makes updates them, and a scrape recomputes only reports older than `metrics_max_age`, so scrapes read the
store for them at most once a minute per model.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import msgspec
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.adapters import AdapterRegistry
from gateway.auth import Caller
from gateway.errors import model_not_found
from gateway.metrics import STORE_READ_SECONDS, GatewayMetrics
from store.judge_report import JudgeReport, RubricAgreement, judge_report, judged_groups

log = logging.getLogger("artgw.judge_report")

METRICS_MAX_AGE_SECONDS = 60.0  # how stale a scrape's judge gauges may be before it recomputes them


class JudgeReportService:
    def __init__(
        self,
        engine: AsyncEngine,
        registry: AdapterRegistry,
        metrics: GatewayMetrics,
        *,
        threshold: float,
        metrics_max_age: float = METRICS_MAX_AGE_SECONDS,
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.metrics = metrics
        self.threshold = threshold  # --judge-agreement-threshold
        self.metrics_max_age = metrics_max_age
        self._made_at: dict[str, float] = {}  # model -> time.monotonic() of its newest report
        self._reports: dict[str, JudgeReport] = {}

    async def report(self, name: str, caller: Caller) -> JudgeReport:
        """The model's judge report, fresh from the store (404 as `GET /v1/art/models/{name}`: for a model the
        gateway does not serve or the caller's key does not cover)."""
        caller.check_model(name)
        if name not in self.registry.models:
            raise model_not_found(name)
        report = await self._make(name)
        # The figures are the model's; the groups it names are only those the caller may read (its own).
        readable = caller.grant.owner_of
        rubrics = [
            msgspec.structs.replace(r, worst_groups=[g for g in r.worst_groups if readable(g.owner) is not None])
            for r in report.rubrics
        ]
        return msgspec.structs.replace(report, rubrics=rubrics)

    async def _make(self, name: str) -> JudgeReport:
        async with self.engine.connect() as conn:
            judged = await judged_groups(conn, name)
        report = await asyncio.to_thread(judge_report, name, judged, self.threshold)
        self.metrics.judge_reported(report)
        self._made_at[name] = time.monotonic()
        self._reports[name] = report
        return report

    async def flagged(self, name: str) -> list[RubricAgreement]:
        """The model's rubrics that disagree with the callers (for `GET /v1/art/models/{name}`): from a report at
        most `metrics_max_age` old, so a status poll costs no statistics."""
        report = self._reports.get(name)
        if report is None or time.monotonic() - self._made_at[name] >= self.metrics_max_age:
            report = await self._make(name)
        return [r for r in report.rubrics if r.state == "flagged"]

    async def refresh_metrics(self) -> None:
        """Before a scrape: remake the reports older than `metrics_max_age`. A store that does not answer
        leaves the last figures (`artgw_store_up` tells the scrape they are stale)."""
        models = list(self.registry.models)
        self.metrics.keep_judge_reports(models)
        now = time.monotonic()
        for name in models:
            if now - self._made_at.get(name, -math.inf) < self.metrics_max_age:
                continue
            try:
                async with asyncio.timeout(STORE_READ_SECONDS):
                    await self._make(name)
            except (SQLAlchemyError, OSError, TimeoutError) as exc:
                log.warning("metrics: no judge report of %s (%s); its judge figures are the last known", name, exc)
                return
