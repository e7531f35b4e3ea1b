"""RULER in the background: groups created with a `ruler` request are judged here, a bounded number at
a time, and move `scoring` → `ready` (scores become rewards) or `failed` (with the reason).

The judges and webhook endpoints are the operator's (policy.py): a group names them, and a group left
`scoring` by a previous run is judged again on start only with what the operator allows now.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import msgspec
from opentelemetry.trace import Tracer
from sqlalchemy.ext.asyncio import AsyncEngine

import ruler
from gateway.groups.checks import GroupCheck, checked_reward, run_checks
from gateway.groups.policy import Refused, RulerPolicy
from gateway.metrics import GatewayMetrics
from gateway.tracing import scoring_ended, scoring_span
from store.access import EVERYTHING
from store.api import RulerIn
from store.groups import GroupRow, MemberScore, load_groups, scored, scoring_failed, scoring_group_ids
from store.judge_cache import StoreJudgeCache
from store.rollouts import RolloutReader

log = logging.getLogger("artgw.groups")


def criteria_of(spec: RulerIn) -> list[ruler.Criterion]:
    return [ruler.Criterion(c.name, c.description, c.weight) for c in spec.criteria]


def no_signal(rewards: list[float]) -> bool:
    """Every reward equal: GRPO has nothing to learn from the group."""
    return max(rewards) - min(rewards) <= 1e-12


class Scorer:
    def __init__(
        self,
        engine: AsyncEngine,
        reader: RolloutReader,
        judge_cache: StoreJudgeCache,
        metrics: GatewayMetrics,
        http: httpx.AsyncClient,
        policy: RulerPolicy,
        *,
        max_concurrent_judges: int = 4,
        tracer: Tracer | None = None,
    ) -> None:
        self.engine = engine
        self.tracer = tracer  # with tracing on: a span per scoring, its judge calls as children
        self.reader = reader
        self.judge_cache = judge_cache
        self.metrics = metrics
        self.http = http  # the webhook checks' client
        self.policy = policy  # the judges and webhook endpoints the operator allows
        self.judge_slots = asyncio.Semaphore(max_concurrent_judges)
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, group_id: str, spec: RulerIn) -> None:
        task = asyncio.create_task(self._score(group_id, spec), name=f"ruler-{group_id}")
        self._tasks[group_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(group_id, None))

    async def resume(self) -> int:
        """Judge again the groups a previous run left `scoring`."""
        async with self.engine.connect() as conn:
            pending = await load_groups(conn, await scoring_group_ids(conn), grant=EVERYTHING)  # every model's
        for row in pending:
            if row.ruler is not None:
                self.start(row.id, msgspec.convert(row.ruler, RulerIn))
        return len(pending)

    async def _score(self, group_id: str, spec: RulerIn) -> None:
        async with self.engine.connect() as conn:
            rows = await load_groups(conn, [group_id], grant=EVERYTHING)
        if not rows:
            return
        with scoring_span(self.tracer, group_id, rows[0].model, spec.judge_model):
            await self._judge(group_id, rows[0], spec)

    async def _judge(self, group_id: str, row: GroupRow, spec: RulerIn) -> None:
        usage: dict[str, Any] | None = None
        try:
            recorded = [
                await self.reader.get(
                    member.rollout_id, owner=member.rollout_owner, grant=EVERYTHING, choice=member.choice
                )
                for member in row.members
            ]
            trajectories = [ruler.Trajectory(messages=t.messages, tools=t.tools) for t in recorded]
            started = time.monotonic()
            result = await ruler.judge_group(
                trajectories,
                judges=self.policy.panel(spec),
                samples=spec.samples,
                key=group_id,  # the orders a group is shown in follow from its id: the same on every run
                rubric=spec.rubric or ruler.DEFAULT_RUBRIC,
                criteria=criteria_of(spec),
                cache=self.judge_cache,
                slots=self.judge_slots,
                tracer=self.tracer,
            )
            panel = len(result.judgements) > 1
            self.metrics.judged(
                row.model,
                time.monotonic() - started,
                result.usage.judge_calls,
                result.usage.prompt_tokens,
                result.usage.completion_tokens,
                result.group_spread if panel else None,
            )
            usage = msgspec.to_builtins(result.usage)
            checks = [msgspec.convert(check, GroupCheck) for check in spec.checks]
            scores = []
            for i, (member, score) in enumerate(zip(row.members, result.scores, strict=True)):
                outcomes = await run_checks(
                    checks, recorded[i].messages, recorded[i].tools, self.http, self.policy.allows_webhook, index=i
                )
                scores.append(
                    MemberScore(
                        member.position,
                        checked_reward(score.score, outcomes),  # the judge never overrides a failed check
                        score.score,
                        score.explanation,
                        score.criteria,
                        result.spread[i] if panel else None,
                        outcomes or None,
                    )
                )
            spread = result.group_spread if panel else None
            dropped = None
            if spread is not None and spec.max_spread is not None and spread > spec.max_spread:
                dropped = f"the judges disagree: spread {spread:.3f} > max_spread {spec.max_spread:g}; not trained"
            scoring_ended(len(row.members), usage, dropped)
            async with self.engine.begin() as conn:
                await scored(
                    conn,
                    group_id,
                    scores,
                    usage,
                    no_signal([s.reward for s in scores]),
                    judge_spread=spread,
                    judge_agreement=result.agreement if panel else None,
                    dropped=dropped,
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # whatever the judge or litellm raised: the group fails with the reason
            self.metrics.judge_errors.labels(row.model).inc()
            plain = isinstance(exc, ruler.RulerError | Refused)  # their messages are written for the caller
            reason = f"RULER failed: {exc}" if plain else f"RULER failed: {exc!r}"
            log.warning("group %s: %s", group_id, reason)
            scoring_ended(len(row.members), usage, reason)
            async with self.engine.begin() as conn:
                await scoring_failed(conn, group_id, reason[:2000], usage)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
