"""The gateway's services as one object, `Services`: what `provide_services` (gateway/provide.py) builds and the
HTTP layer reads (gateway/app.py's dependencies, gateway/apis/routes.py and gateway/guards.py through
`services_of`), so that no handler imports the module that builds them."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import httpx
import sqlalchemy as sa
from litestar.datastructures import State
from sqlalchemy.exc import SQLAlchemyError

from engine.answers import ModelList, read
from engine.pool import Engine, EnginePool
from engine.supervisor import EngineFailed, EngineState, EngineSupervisor, EngineSupervisors, wait_until_ready
from gateway.adapters import AdapterRegistry, AdapterService
from gateway.apis.chat.service import ChatService
from gateway.apis.completions.service import CompletionsService
from gateway.apis.messages.service import MessagesService
from gateway.apis.responses.service import ResponsesService
from gateway.auth import KeyRing
from gateway.continuation import Splicer
from gateway.groups.scorer import Scorer
from gateway.groups.service import GroupService
from gateway.judge_report import JudgeReportService
from gateway.keys import KeyService
from gateway.metrics import GatewayMetrics
from gateway.promotion.service import PromotionService
from gateway.rollouts import RolloutService
from gateway.settings import Settings
from recording.recorder import Recorder
from store.provide import Store

log = logging.getLogger("artgw.gateway")


class UpstreamEngine:
    """A vLLM server the gateway does not own (`--upstream`): wait for it, learn its base model."""

    def __init__(
        self,
        url: str,
        startup_timeout: float,
        client: httpx.AsyncClient,
        adapters: AdapterService,
        splicer: Splicer | None = None,
    ) -> None:
        self.url = url
        self.splicer = splicer  # --continuity splice: whether this engine serves the scale-out endpoints, said at start
        self.startup_timeout = startup_timeout
        self.client = client
        self.adapters = adapters
        self.state: EngineState = "starting"
        self.ready_seconds: float | None = None

    async def start(self) -> None:
        await wait_until_ready(self.url, self.startup_timeout, on_waiting=self._say_waiting)
        registry = self.adapters.registry
        registry.base_model, registry.base_model_path = await self._base_model()
        await self.adapters.sync_engine()
        if self.splicer is not None:
            await self.splicer.probe()  # logs a warning when it does not
        self.state = "ready"

    def _say_waiting(self, problem: str) -> None:
        log.warning(
            "the upstream engine at %s is not ready: %s; still waiting, up to %.0f s (--engine-startup-timeout)",
            self.url,
            problem,
            self.startup_timeout,
        )

    async def _base_model(self) -> tuple[str, str]:
        """The model entry that is not a LoRA adapter: (its served name, the path or hub id it was loaded from)."""
        answer = await self.client.get("/v1/models", timeout=10.0)
        answer.raise_for_status()
        for card in read(answer.content, ModelList).data:
            if not card.parent:
                return card.id, card.root or card.id
        raise EngineFailed("the upstream engine serves no base model")

    async def stop(self) -> None:
        self.state = "stopped"


class Services:
    """Every service of one gateway process. A plain class, not a dataclass: Litestar validates an injected
    dataclass field by field on every request, while a plain class is only an isinstance check."""

    def __init__(
        self,
        *,
        settings: Settings,
        store: Store,
        keyring: KeyRing,
        keys: KeyService,
        registry: AdapterRegistry,
        recorder: Recorder,
        chat: ChatService,
        completions: CompletionsService,
        responses: ResponsesService,
        messages: MessagesService,
        rollouts: RolloutService,
        groups: GroupService,
        scorer: Scorer,
        adapters: AdapterService,
        judge_reports: JudgeReportService,
        promotions: PromotionService,
        metrics: GatewayMetrics,
        engine: EngineSupervisor | EngineSupervisors | UpstreamEngine,
        engines: EnginePool,
        client: httpx.AsyncClient,
    ) -> None:
        self.settings = settings
        self.store = store
        self.keyring = keyring  # who is calling (gateway/auth.py)
        self.keys = keys
        self.registry = registry
        self.recorder = recorder
        self.chat = chat
        self.completions = completions
        self.responses = responses
        self.messages = messages
        self.rollouts = rollouts
        self.groups = groups
        self.scorer = scorer
        self.adapters = adapters
        self.judge_reports = judge_reports
        self.promotions = promotions  # the promotion gate: eval sets and their evaluations
        self.metrics = metrics
        self.engine = engine
        self.engines = engines  # every engine calls go to (the supervised one, or each --upstream)
        self.client = client  # the engine's control API (health, models, LoRA loading)
        self.fatal: list[str] = []  # why the gateway gave up, if it did

    def fail(self, reason: str) -> None:
        """Fail loudly: say why, then stop the server (the CLI exits non-zero)."""
        log.critical(reason)
        print(f"artgw: fatal: {reason}", file=sys.stderr, flush=True)
        self.fatal.append(reason)
        os.kill(os.getpid(), signal.SIGTERM)

    async def readiness(self) -> tuple[bool, dict[str, str]]:
        """Ready when the engine is started (base model known, adapters synced) and answers its /health, and the
        journal takes records (`"journal": "ok" | "unavailable (...)"`).

        The store's state is reported (`"store": "ok" | "unavailable"`) but does not make the gateway unready:
        inference keeps serving and recording while the store is away (the recorder catches up), so a load
        balancer must keep sending chat traffic; only the store-backed `/v1/art/*` endpoints answer 503 then.
        """
        ready = self.engine.state == "ready"
        several = len(self.engines) > 1
        if ready and several:  # ready while any engine is in rotation (each probed every --engine-health-interval)
            ready = bool(self.engines.in_rotation)
        elif ready:
            # Any failure is "not ready", never a 500: httpx has raised AttributeError on a connection cut by the
            # engine's death.
            try:
                ready = (await self.client.get("/health", timeout=2.0)).status_code == 200
            except Exception as exc:
                log.info("readiness: the engine's /health failed: %r", exc)
                ready = False
        # A journal that cannot take records makes every call a 503 (recording/recorder.py): not ready until the
        # disk takes writes again (probed here, so that a gateway taken out of its load balancer comes back).
        journal = self.recorder.journal_failure is None or await asyncio.to_thread(self.recorder.journal_writable)
        ready = ready and journal
        body = {"status": "ready" if ready else "not ready", "engine": self.engine.state}
        if several:
            each = ", ".join(f"{e.url} {_rotation(e)} ({e.in_flight} in flight)" for e in self.engines.engines)
            body["engines"] = f"{len(self.engines.in_rotation)} of {len(self.engines)} in rotation: {each}"
        body["store"] = await self.store_state()
        body["journal"] = "ok" if journal else f"unavailable ({self.recorder.journal_failure})"
        return ready, body

    async def store_state(self) -> str:
        """`ok` if the store answers a read of its schema version within 2 s and the recorder's last write went in;
        `unavailable` if it does not answer; `failing writes (...)` if it answers but takes no write (a full disk,
        a read-only file)."""
        try:
            async with asyncio.timeout(2.0), self.store.engine.connect() as conn:
                await conn.execute(sa.text("SELECT version_num FROM alembic_version"))
        except (SQLAlchemyError, OSError, TimeoutError) as exc:
            log.warning("readiness: the store is unavailable: %s", exc)
            return "unavailable"
        failure = self.recorder.store_failure
        return "ok" if failure is None else f"failing writes ({failure})"

    async def bring_up_engine(self) -> None:
        try:
            await self.engine.start()
        except EngineFailed as exc:
            self.fail(f"the inference engine did not start: {exc}")
            return
        log.info("engine ready in %.1fs", self.engine.ready_seconds or 0)
        if self.settings.promotion == "gated":
            await self.promotions.resume()
        s = self.settings
        models = ",".join(self.registry.models)
        auth = "required" if s.auth_required else "off"
        print(f"ART Gateway ready: base_url=http://{s.host}:{s.port}/v1  models={models}  auth={auth}", flush=True)


def _rotation(engine: Engine) -> str:
    """Whether an engine takes calls, as /readyz and `artgw status` say it."""
    if not engine.healthy:
        return "out of rotation"
    if engine.quarantined is not None:
        return f"quarantined: {engine.quarantined}"
    return "in rotation"


def services_of(state: State) -> Services:
    """The app's services, as its lifespan left them in its state (gateway/app.py::create_app)."""
    return state.services  # type: ignore[no-any-return]
