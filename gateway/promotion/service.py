"""Gated promotion: each step committed under `--promotion gated` is evaluated on the model's eval sets against
the promoted step, and promoted only when every set's gate passes (gateway/promotion/gate.py).

The candidate (`NAME@K`) and the promoted step answer the same scenarios, side by side, through the gateway's
own chat path: their calls are recorded as rollouts `artgw-eval:...`, which no group may take, so they are
never trained on. One evaluation runs per model at a time; steps committed meanwhile wait, and only the
newest of them is evaluated next (an older candidate is superseded).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import uuid
from typing import Any

import httpx
import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.adapters import AdapterService, adapter_name
from gateway.apis.chat.service import ChatService
from gateway.asgi import JSONBody
from gateway.auth import ADMIN, Caller
from gateway.errors import OpenAIError, invalid_request, model_not_found
from gateway.promotion.decision import CanaryJudged, Evaluated, LiveWatched, decide
from gateway.promotion.gate import paired_gate, unpaired_gate
from gateway.promotion.graders import (
    Answer,
    EvalScenario,
    EvalSetCreate,
    GraderFailed,
    RulerGrader,
    RulerJudge,
    grade,
    masked_url,
    ruler_compare,
)
from gateway.proxy import EVAL_ROLLOUT_PREFIX, CallOrigin
from gateway.rollouts import RolloutService
from store.api import AdapterLoad, ModelStatus
from store.clock import SYSTEM_CLOCK, Clock
from store.promotions import (
    CANARY,
    EvalSetRow,
    EvaluationRow,
    delete_eval_set,
    eval_sets_of,
    evaluations_of,
    finish_canary,
    live_rewards,
    promotion_history,
    put_eval_set,
    put_reward,
    running_canaries,
    save_evaluation,
)
from store.records import RolloutKey

log = logging.getLogger("artgw.promotion")


class EvalFailed(Exception):
    """An evaluation that could not be finished (an eval call failed, a webhook grader gave up)."""


class PromotionService:
    def __init__(
        self,
        *,
        adapters: AdapterService,
        store: AsyncEngine,
        chat: ChatService,
        rollouts: RolloutService,
        http: httpx.AsyncClient,
        judge: RulerJudge,
        margin: float,
        confidence: float,
        concurrency: int,
        canary_min_rewards: int = 50,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.adapters = adapters
        self.registry = adapters.registry
        self.store = store
        self.chat = chat
        self.rollouts = rollouts  # what a single reward is checked against
        self.http = http  # webhook graders
        self.judge = judge  # RULER's judge settings (ruler graders)
        self.margin = margin
        self.confidence = confidence
        self.concurrency = concurrency
        self.canary_min_rewards = canary_min_rewards
        self.clock = clock  # the live-reward watcher's pace
        self._pending: dict[str, int] = {}  # model -> newest committed step not evaluated yet
        self._workers: dict[str, asyncio.Task[None]] = {}

    # ------------------------------------------------------------ eval sets (admin)

    async def put_set(self, model: str, body: EvalSetCreate) -> tuple[EvalSetRow, bool]:
        self._check_model(model)
        if body.name == CANARY:
            raise invalid_request(f"`{CANARY}` is the name the canary's results go under.", param="name")
        unjudged = [
            i
            for i, s in enumerate(body.scenarios)
            if isinstance(s.grader, RulerGrader) and s.grader.judge_model is None and self.judge.default_model is None
        ]
        if unjudged:
            raise invalid_request(
                "A `ruler` grader needs a `judge_model` (a litellm model name): the gateway has no default judge.",
                param=f"scenarios[{unjudged[0]}].grader.judge_model",
            )
        async with self.store.begin() as conn:
            return await put_eval_set(conn, model, body.name, msgspec.to_builtins(body))

    async def sets(self, model: str) -> list[EvalSetRow]:
        """The model's eval sets, webhook headers masked: they may hold the user's secrets."""
        self._check_model(model)
        async with self.store.connect() as conn:
            rows = await eval_sets_of(conn, model)
        return [msgspec.structs.replace(row, spec=_masked(row.spec)) for row in rows]

    async def delete_set(self, model: str, name: str) -> None:
        self._check_model(model)
        async with self.store.begin() as conn:
            if not await delete_eval_set(conn, model, name):
                raise OpenAIError(404, f"No eval set `{name}` for `{model}`.", code="eval_set_not_found")

    def _check_model(self, model: str) -> None:
        if model not in self.registry.models:
            raise model_not_found(model)

    # ------------------------------------------------------------ the gate

    async def commit(self, name: str, spec: AdapterLoad) -> ModelStatus:
        """A trainer's new step (AdapterService.load), which the gate then evaluates under `--promotion gated`."""
        decision = await self.adapters.load(name, spec)
        if decision.kind == "evaluate":
            self.step_committed(name, spec.step)
        return await self.adapters.status(name, ADMIN)  # the trainer's commit: an admin endpoint

    def step_committed(self, model: str, step: int) -> None:
        """A new step of a gated model: evaluate it (after any evaluation of the model under way)."""
        self._pending[model] = max(step, self._pending.get(model, 0))
        worker = self._workers.get(model)
        if worker is None or worker.done():
            self._workers[model] = asyncio.create_task(self._work(model), name=f"promotion-gate-{model}")

    async def resume(self) -> None:
        """After a start: a gated model whose newest step is neither promoted nor judged (its evaluation was cut
        short by the stop) is evaluated."""
        async with self.store.connect() as conn:
            for model in list(self.registry.models.values()):
                if model.latest_step <= model.served_step:
                    continue
                judged = [e for e in await evaluations_of(conn, model.name) if e.step == model.latest_step]
                if not judged or any(e.status == "running" and e.eval_set != CANARY for e in judged):
                    self.step_committed(model.name, model.latest_step)

    async def close(self) -> None:
        for worker in self._workers.values():
            worker.cancel()
        await asyncio.gather(*self._workers.values(), return_exceptions=True)

    async def _work(self, model: str) -> None:
        while (step := self._pending.pop(model, None)) is not None:
            try:
                await self.evaluate(model, step)
            except asyncio.CancelledError:
                raise
            except Exception:  # the gate must keep working for the next step
                log.exception("%s: the evaluation of step %d failed", model, step)

    async def evaluate(self, model: str, step: int) -> bool:
        """Evaluate `step` on every eval set of the model against the promoted step; promote it if all pass."""
        trainable = self.registry.models.get(model)
        if trainable is None or step <= trainable.served_step:
            return False
        baseline = trainable.served_step
        async with self.store.connect() as conn:
            sets = await eval_sets_of(conn, model)
        canary = self.registry.canary_share > 0
        results = tuple([await self._evaluate_set(model, step, baseline, row) for row in sets])
        served_now = self.registry.models[model].served_step
        decision = decide(Evaluated(step, baseline, served_now, results, canary))
        match decision.kind:
            case "promote":
                await self.adapters.promote(model, decision)
                return True
            case "start_canary":  # live traffic decides now (watch_live_rewards)
                await self._start_canary(model, step, baseline)
            case "evaluate":
                self.step_committed(model, step)
            case _:
                log.info("%s: step %d: %s", model, step, decision.reason)
        return False

    async def _evaluate_set(self, model: str, step: int, baseline: int, row: EvalSetRow) -> EvaluationRow:
        spec = msgspec.convert(row.spec, EvalSetCreate)
        started = EvaluationRow.running(model, step, row.name, baseline, self.margin)
        async with self.store.begin() as conn:
            await save_evaluation(conn, started)
        try:
            candidate, promoted = await self._score_set(model, step, baseline, spec)
        except EvalFailed as exc:
            done = msgspec.structs.replace(
                started, status="error", error=str(exc)[:2000], finished_at=self.clock.time()
            )
        else:
            verdict = paired_gate(candidate, promoted, margin=self.margin, confidence=self.confidence)
            done = msgspec.structs.replace(
                started,
                status="passed" if verdict.passed else "failed",
                scores=candidate,
                mean=math.fsum(candidate) / len(candidate),
                baseline_mean=math.fsum(promoted) / len(promoted),
                ci_low=verdict.ci_low if math.isfinite(verdict.ci_low) else None,
                ci_high=verdict.ci_high if math.isfinite(verdict.ci_high) else None,
                finished_at=self.clock.time(),
            )
        async with self.store.begin() as conn:
            await save_evaluation(conn, done)
        return done

    async def _score_set(
        self, model: str, step: int, baseline: int, spec: EvalSetCreate
    ) -> tuple[list[float], list[float]]:
        """Per scenario, the mean reward of the candidate's samples and of the promoted step's."""
        limit = asyncio.Semaphore(self.concurrency)

        async def one(index: int, scenario: EvalScenario) -> tuple[float, float]:
            async with limit:
                mine, theirs = await asyncio.gather(
                    self._answers(model, step, scenario, spec.samples),
                    self._answers(model, baseline, scenario, spec.samples),
                )
                try:
                    if isinstance(scenario.grader, RulerGrader):
                        # Every other sample shows the judge the promoted step's answer first: no position bias.
                        pairs = [
                            await ruler_compare(scenario.grader, scenario, a, b, self.judge, baseline_first=k % 2 == 1)
                            for k, (a, b) in enumerate(zip(mine, theirs, strict=True))
                        ]
                        return _mean(p[0] for p in pairs), _mean(p[1] for p in pairs)
                    return (
                        _mean([await grade(scenario.grader, scenario, a, self.http, index=index) for a in mine]),
                        _mean([await grade(scenario.grader, scenario, a, self.http, index=index) for a in theirs]),
                    )
                except GraderFailed as exc:
                    raise EvalFailed(f"scenario {index}: {exc}") from None

        scored = await asyncio.gather(*(one(i, s) for i, s in enumerate(spec.scenarios)))
        return [c for c, _ in scored], [b for _, b in scored]

    async def _answers(self, model: str, step: int, scenario: EvalScenario, samples: int) -> list[Answer]:
        """`samples` answers of `NAME@step` to the scenario, through the gateway's chat path (recorded)."""
        body: dict[str, Any] = {**(scenario.params or {}), "model": adapter_name(model, step)}
        body["messages"] = scenario.messages
        if scenario.tools:
            body["tools"] = scenario.tools
        body["n"] = samples
        body["stream"] = False
        origin = CallOrigin(f"{EVAL_ROLLOUT_PREFIX}{step}:{uuid.uuid4().hex}", True, ADMIN)
        try:
            answer = await self.chat.complete(json.dumps(body).encode(), origin)
        except OpenAIError as exc:
            raise EvalFailed(f"the eval call to {body['model']} failed: {exc}") from None
        if not isinstance(answer, JSONBody) or answer.status != 200:
            detail = answer.body[:300].decode(errors="replace") if isinstance(answer, JSONBody) else "a stream"
            raise EvalFailed(f"the eval call to {body['model']} answered {detail}")
        choices = json.loads(answer.body)["choices"]
        return [Answer.from_choice(c) for c in sorted(choices, key=lambda c: c["index"])]

    # ------------------------------------------------------------ the canary (live rewards)

    async def _start_canary(self, model: str, step: int, baseline: int) -> None:
        """Serve `step` to the canary share of `model`'s rollouts; a canary under way for an older step ends."""
        now = self.clock.time()
        async with self.registry.models[model].changing:
            async with self.store.begin() as conn:
                old = (await running_canaries(conn)).get(model)
                if old is not None:
                    await finish_canary(
                        conn,
                        msgspec.structs.replace(
                            old, status="failed", error=f"superseded by step {step}", finished_at=now
                        ),
                    )
                await save_evaluation(conn, EvaluationRow.running(model, step, CANARY, baseline, self.margin))
            self.registry.models[model].canary_step = step
            self.registry.models[model].changed += 1
        log.info("%s: step %d serves %.0f%% of the rollouts (canary)", model, step, 100 * self.registry.canary_share)

    async def record_reward(self, rollout_id: str, reward: float, caller: Caller) -> bool:
        """`POST /v1/art/rewards`: one rollout's reward, given after the fact; True if it is new."""
        if rollout_id.startswith(EVAL_ROLLOUT_PREFIX):
            raise invalid_request(f"`{rollout_id}` is an eval rollout of the promotion gate.", param="rollout_id")
        # The caller's own rollout (its namespace's id); `find` waits for calls on their way to the store.
        trajectory = await self.rollouts.find(rollout_id, caller=caller)
        if trajectory is None or trajectory.model is None:
            # As GET /v1/art/rollouts/{id} says it: another key's rollout does not exist for this one.
            raise OpenAIError(404, f"No rollout `{rollout_id}` has been recorded.", code="rollout_not_found")
        async with self.store.begin() as conn:
            stored = await put_reward(conn, RolloutKey(trajectory.owner, rollout_id), trajectory.model, reward)
        if stored is None:
            raise OpenAIError(
                409, f"Rollout `{rollout_id}` was given a different reward before.", code="reward_conflict"
            )
        return stored

    async def watch_live_rewards(self, every: float = 1.0) -> None:
        """Decide canaries that have their rewards; roll back a promoted step that does clearly worse live."""
        if self.registry.canary_share <= 0:
            return
        while True:
            await self.clock.sleep(every)
            for name in list(self.registry.models):
                try:
                    await self._decide_canary(name)
                    await self._check_rollback(name)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a store hiccup: next round
                    log.exception("%s: could not judge live rewards", name)

    async def _decide_canary(self, name: str) -> None:
        async with self.store.connect() as conn:
            row = (await running_canaries(conn)).get(name)
            if row is None or row.baseline_step is None:
                return
            arms = await live_rewards(conn, name, [row.step, row.baseline_step], since=row.created_at)
        candidate, promoted = arms[row.step], arms[row.baseline_step]
        if min(len(candidate), len(promoted)) < self.canary_min_rewards:
            return
        verdict = unpaired_gate(candidate, promoted, margin=self.margin, confidence=self.confidence)
        done = msgspec.structs.replace(
            row,
            status="passed" if verdict.passed else "failed",
            scores=None,
            mean=_mean(candidate),
            baseline_mean=_mean(promoted),
            ci_low=verdict.ci_low,
            ci_high=verdict.ci_high,
            finished_at=self.clock.time(),
        )
        async with self.registry.models[name].changing:
            async with self.store.begin() as conn:
                if not await finish_canary(conn, done):  # another replica decided it first
                    return
            self.registry.models[name].canary_step = None
            self.registry.models[name].changed += 1
        served_now = self.registry.models[name].served_step
        decision = decide(
            CanaryJudged(
                row.step,
                row.baseline_step,
                served_now,
                verdict,
                len(candidate),
                _mean(candidate),
                len(promoted),
                _mean(promoted),
            )
        )
        if decision.moves:
            await self.adapters.promote(name, decision)
        else:
            log.info("%s: step %d dropped (%s)", name, row.step, decision.reason)

    async def _check_rollback(self, name: str) -> None:
        """The promoted step, once it has its rewards, against the step promoted before it."""
        current = self.registry.models[name].served_step
        async with self.store.connect() as conn:
            history = await promotion_history(conn, name, limit=50)
            promoted = next((p for p in history if p.step == current), None)
            if promoted is None or promoted.action != "promote" or promoted.actor not in ("gate", "canary"):
                return
            previous = promoted.previous_step
            if previous is None or previous == current:
                return
            mine = (await live_rewards(conn, name, [current], since=promoted.created_at))[current]
            theirs = (await live_rewards(conn, name, [previous], since=0.0))[previous]
        if len(mine) < self.canary_min_rewards or len(theirs) < 2:
            return
        verdict = unpaired_gate(mine, theirs, margin=self.margin, confidence=self.confidence)
        decision = decide(
            LiveWatched(current, previous, verdict, self.margin, len(mine), _mean(mine), len(theirs), _mean(theirs))
        )
        if decision.moves:
            await self.adapters.promote(name, decision)


def _mean(values: Any) -> float:
    values = list(values)
    return math.fsum(values) / len(values)


def _masked(spec: dict[str, Any]) -> dict[str, Any]:
    scenarios = []
    for scenario in spec.get("scenarios", []):
        grader = scenario.get("grader") or {}
        if grader.get("type") == "webhook":  # header values, and the URL's user info and query, may be secrets
            grader = {**grader, "url": masked_url(grader["url"])}
            if grader.get("headers"):
                grader["headers"] = dict.fromkeys(grader["headers"], "***")
        scenarios.append({**scenario, "grader": grader})
    return {**spec, "scenarios": scenarios}
