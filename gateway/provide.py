"""The gateway's services, built once: `provide_services(settings)` is the app's lifespan.

Everything is built here, in dependency order, over one store opened through the store's own
provider (`store.provide.open_store`, which the CLI and the trainer use too); handlers get these
services injected (gateway/app.py) and never build anything themselves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import httpx

from engine.placement import this_machines_environments
from engine.pool import EnginePool
from engine.supervisor import EngineConfig, EngineSupervisor, EngineSupervisors, free_ports
from gateway.adapters import AdapterRegistry, AdapterService
from gateway.apis.chat.service import ChatService
from gateway.apis.completions.service import CompletionsService
from gateway.apis.messages.service import MessagesService, Threads
from gateway.apis.responses.service import ResponsesService
from gateway.auth import KeyRing, load_admin_key
from gateway.continuation import Continuations, Splicer
from gateway.groups.policy import RulerPolicy, load_judges
from gateway.groups.scorer import Scorer
from gateway.groups.service import GroupService
from gateway.judge_report import JudgeReportService
from gateway.keys import KeyService
from gateway.loop_watch import LoopWatch
from gateway.metrics import GatewayMetrics
from gateway.promotion.graders import RulerJudge
from gateway.promotion.service import PromotionService
from gateway.proxy import EngineCalls
from gateway.rollouts import RolloutOwners, RolloutService
from gateway.services import Services, UpstreamEngine
from gateway.settings import Settings, served_base_name
from gateway.tracing import CallTracer
from recording.journal import worker_journal_dir
from recording.recorder import Recorder
from store.calls import SqliteRolloutOwners
from store.clock import SYSTEM_CLOCK, Clock
from store.db import create_sync_sqlite_engine
from store.families import EngineParsers, choose_parsers
from store.models import active_models, add_models
from store.provide import open_store
from store.responses import ResponseStore
from store.tracing import start_tracing

log = logging.getLogger("artgw.gateway")
# The collector's thresholds while serving: a call makes and drops hundreds of objects, so CPython's default
# (a young collection every 700 net allocations) collected every few calls and promoted the objects of the calls
# in flight to older generations; 20,000 cut the collector's share of the loop from ~10% to ~1% and took 256
# connections from 1,780 to 2,200 calls/s (bench/README.md, issue 30).
GC_THRESHOLDS = (20_000, 20, 10)


async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
    """Whether the engine at `url` answers its /health with 200 within 2 s."""
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2.0)) as answer:
            return answer.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


def keep_private(data_dir: Path, database: Path) -> None:
    """The data dir 0700 and the SQLite store's files 0600 (it holds every prompt and answer, webhook secrets and
    key hashes), also where an older version left them readable by others."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    data_dir.chmod(0o700)
    for path in (database, database.with_name(database.name + "-wal"), database.with_name(database.name + "-shm")):
        if path.exists():
            path.chmod(0o600)


def with_engine_ports(settings: Settings) -> Settings:
    """The settings with the supervised engines' ports chosen (free ones unless --engine-port names the first); as
    they are with --upstream, or once chosen."""
    if settings.base_model is None or settings.engine_ports:
        return settings
    ports = settings.supervised_ports if settings.engine_port else free_ports(settings.engines)
    return dataclasses.replace(settings, engine_port=ports[0], engine_ports=ports)


def engine_configs(settings: Settings, served_name: str, parsers: EngineParsers, models: int) -> list[EngineConfig]:
    """The supervised engines' configurations (--engines), each on its port with its share of the devices."""
    assert settings.base_model is not None
    places = this_machines_environments(settings.engines)
    return [
        EngineConfig(
            base_model=settings.base_model,
            served_name=served_name,
            port=port,
            max_lora_rank=settings.max_lora_rank,
            # Slots for every model's newest steps; an adapter not in a slot is loaded on demand.
            max_loras=settings.max_loras or max(4, 2 * models),
            max_cpu_loras=max(settings.max_loras, 4, 3 * models),
            max_model_len=settings.max_model_len,
            tool_call_parser=parsers.tool_call_parser,
            reasoning_parser=parsers.reasoning_parser,
            tokenizer_mode=parsers.tokenizer_mode,
            extra_args=settings.engine_args,
            log_path=settings.data_dir / ("engine.log" if i == 0 else f"engine-{i}.log"),
            startup_timeout=settings.engine_startup_timeout,
            max_restarts=settings.engine_max_restarts,
            restart_window=settings.engine_restart_window,
            env={**place, **settings.extra_env},
        )
        for i, (port, place) in enumerate(zip(with_engine_ports(settings).supervised_ports, places, strict=True))
    ]


@asynccontextmanager
async def provide_services(settings: Settings, clock: Clock = SYSTEM_CLOCK, worker: int = 0) -> AsyncIterator[Services]:
    """Build every service, start the background work, and stop it all on exit. `clock`: the time the rate
    limits, the key ring's refresh and the canary watcher read (tests move one of their own). `worker`: which
    of `serve --workers`' processes this is (each has a journal of its own)."""
    settings = with_engine_ports(settings)
    keep_private(settings.data_dir, settings.sqlite_path)
    tls = httpx.create_ssl_context()  # httpx's default, built once: each build loads the CA bundle (~40 ms of CPU)
    async with (
        open_store(settings.db_url, migrate_schema=settings.migrate, wait_seconds=settings.store_wait) as store,
        httpx.AsyncClient(
            base_url=settings.upstream_url,
            timeout=httpx.Timeout(settings.request_timeout, connect=5.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
            verify=tls,
        ) as client,
        aiohttp.ClientSession(
            # An idle connection is closed before vLLM's server closes it (uvicorn keep-alive: 5 s): reusing one
            # the server is closing at that moment fails the call (ClientOSError, seen in CI as a 502).
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0),
            auto_decompress=False,
        ) as session,
        httpx.AsyncClient(verify=tls) as webhooks,  # the eval sets' webhook graders (the user's reward functions)
    ):
        # The models of the command line join the store's set; the gateway serves the whole set.
        async with store.engine.begin() as conn:
            await add_models(conn, settings.model_names)
            trainable = await active_models(conn)
        admin_key, made = load_admin_key(settings.admin_key, settings.admin_key_path)
        if made:
            print(f"artgw: made an admin key; it is in {settings.admin_key_path} (mode 0600)", flush=True)
        keyring = KeyRing(store.engine, admin_key=admin_key, required=settings.auth_required, clock=clock)
        await keyring.refresh()
        # With --upstream the base model's name is asked of the engine once it answers.
        base_name = served_base_name(settings.base_model) if settings.base_model is not None else None
        registry = AdapterRegistry(
            base_name, trainable, base_model_path=settings.base_model, canary_share=settings.canary
        )
        metrics = GatewayMetrics()
        recorder = Recorder(
            store.engine,
            sync_engine=create_sync_sqlite_engine(settings.db_url),
            data_dir=settings.data_dir,  # journal/, rejected/, and spill/ of older versions (replayed)
            queue_size=settings.recorder_queue_size,
            queue_bytes=settings.recorder_queue_bytes,
            batch_size=settings.recorder_batch_size,
            cache_bytes=settings.recorder_cache_bytes,
            journal_segment_bytes=settings.journal_segment_bytes,
            journal_fsync=settings.journal_fsync,
            journal_fsync_interval=settings.journal_fsync_interval,
            journal_dir=worker_journal_dir(settings.data_dir / "journal", worker),
        )
        metrics.watch_recorder(recorder)
        owners = RolloutOwners(
            store.engine,
            hold_seconds=settings.rollout_pin_seconds,
            clock=clock,
            read_now=SqliteRolloutOwners.of(settings.db_url),
        )
        engines = EnginePool(settings.engine_urls, saturation=settings.engine_saturation)
        metrics.watch_engines(engines)
        adapters = AdapterService(
            registry, client, store.engine, engines, promotion=settings.promotion, held_steps=owners.held_steps
        )
        rollouts = RolloutService(store.rollouts, recorder)
        tracing = start_tracing("artgw-gateway")  # None unless OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT is set
        tracer = tracing.tracer("artgw.gateway") if tracing is not None else None
        scorer = Scorer(
            store.engine,
            store.rollouts,
            store.judge_cache,
            metrics,
            webhooks,
            RulerPolicy(load_judges(settings.judges_file) if settings.judges_file else {}, settings.group_webhooks),
            max_concurrent_judges=settings.max_concurrent_judges,
            tracer=tracer,
        )
        # Each engine's splicer; its renders wait as long as a call's engine request would.
        render_timeout = aiohttp.ClientTimeout(total=None, sock_read=settings.request_timeout)
        splicers = (
            {url: Splicer(session, url, render_timeout) for url in settings.engine_urls}
            if settings.continuity == "splice"
            else None
        )
        splicer = splicers[settings.upstream_url] if splicers is not None else None
        engine: EngineSupervisor | EngineSupervisors | UpstreamEngine
        if settings.base_model is not None:
            assert base_name is not None
            parsers = choose_parsers(
                settings.base_model,
                tool_call_parser=settings.tool_call_parser,
                reasoning_parser=settings.reasoning_parser,
                engine_args=settings.engine_args,
            )
            log.info(
                "vLLM's parsers: tool calls %s, reasoning %s (%s)%s",
                parsers.tool_call_parser,
                parsers.reasoning_parser or "none",
                parsers.why,
                f"; tokenizer mode {parsers.tokenizer_mode}" if parsers.tokenizer_mode else "",
            )
            configs = engine_configs(settings, base_name, parsers, len(trainable))
            if len(configs) == 1:
                engine = EngineSupervisor(
                    configs[0], on_fatal=lambda reason: services.fail(reason), on_ready=adapters.sync_engine
                )
            else:  # each engine restarted gets what it lost loaded again (the pool keeps it out until it holds it)
                engine = EngineSupervisors(
                    configs,
                    on_fatal=lambda reason: services.fail(reason),
                    on_ready=adapters.sync_engine,
                    on_restart=lambda i: adapters.restore_engine(engines.engines[i]),
                )
        else:
            engine = UpstreamEngine(settings.upstream_url, settings.engine_startup_timeout, client, adapters, splicer)
        calls = EngineCalls(
            splicers=splicers,
            # A rollout's last call not held here is read from the store: to splice, and with several engines to
            # send the call to the engine that served it (another replica's call, or one from before a restart).
            continuations=Continuations(
                settings.continuation_cache_bytes,
                read=store.rollouts.last_chat_call if splicers is not None or len(engines) > 1 else None,
                read_seconds=settings.continuation_read_seconds,
                counted=metrics.continuation_read,
            ),
            session=session,
            engines=engines,
            restore=adapters.restore_engine,
            request_timeout=settings.request_timeout,
            registry=registry,
            recorder=recorder,
            owners=owners,
            engine_state=lambda: engine.state,
            metrics=metrics,
            limits=keyring.limits,
            tracer=CallTracer(tracer, settings.upstream_url) if tracer is not None else None,
        )
        chat = ChatService(calls)
        promotions = PromotionService(
            adapters=adapters,
            store=store.engine,
            chat=chat,
            rollouts=rollouts,
            http=webhooks,
            judge=RulerJudge(cache=store.judge_cache),  # the judge model: each ruler grader names its own
            margin=settings.gate_margin,
            confidence=settings.gate_confidence,
            concurrency=settings.eval_concurrency,
            canary_min_rewards=settings.canary_min_rewards,
            clock=clock,
        )
        kept = ResponseStore(store.engine)  # stored Responses and message threads, each API's own
        services = Services(
            settings=settings,
            store=store,
            keyring=keyring,
            keys=KeyService(store.engine, keyring, registry),
            registry=registry,
            recorder=recorder,
            chat=chat,
            promotions=promotions,
            completions=CompletionsService(calls),
            responses=ResponsesService(calls, kept),
            messages=MessagesService(calls, Threads(kept)),
            rollouts=rollouts,
            groups=GroupService(store.engine, rollouts, registry, scorer, metrics=metrics),
            scorer=scorer,
            adapters=adapters,
            judge_reports=JudgeReportService(
                store.engine, registry, metrics, threshold=settings.judge_agreement_threshold
            ),
            metrics=metrics,
            engine=engine,
            engines=engines,
            client=client,
        )
        await recorder.start()
        await scorer.resume()
        # Everything made so far (modules, litestar, SQLAlchemy, litellm: hundreds of thousands of objects) lives
        # as long as the process: out of the collector's sight, a full collection no longer walks it on the event
        # loop (it took ~100 ms, the gateway's p99 at one connection; bench/README.md, issue 30).
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        background = [
            asyncio.create_task(services.bring_up_engine(), name="engine-bring-up"),
            asyncio.create_task(adapters.follow_store(), name="adapters-follow-store"),
            asyncio.create_task(keyring.follow(), name="keys-follow-store"),
            asyncio.create_task(promotions.watch_live_rewards(), name="promotion-live-rewards"),
            asyncio.create_task(LoopWatch(metrics.registry, profile=settings.loop_profile).run(), name="loop-watch"),
        ]
        if len(engines) > 1:  # one engine stays in rotation whatever its health: nowhere else to send a call
            probe = functools.partial(_healthy, session)
            # An engine back (or quarantined) gets every served step loaded before it takes a call.
            watch = engines.watch(probe, settings.engine_health_interval, prepare=adapters.prepare_engine)
            background.append(asyncio.create_task(watch, name="engines-health"))
        try:
            yield services
        finally:
            for task in background:
                task.cancel()
            await promotions.close()
            await scorer.close()
            await recorder.close()
            await engine.stop()
            if tracing is not None:  # the spans still queued, for a few seconds at most
                await asyncio.to_thread(tracing.shutdown)
