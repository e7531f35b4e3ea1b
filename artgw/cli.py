"""`artgw`: the command line of ART Gateway.

Every option also reads from an environment variable, named in its help
(`ARTGW_<OPTION>`); the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def _env_default(name: str, default: Any, cast: Callable[[str], Any] = str) -> Any:
    value = os.environ.get(f"ARTGW_{name}")
    return cast(value) if value is not None else default


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _option(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    default: Any = None,
    type: Any = str,
    help: str,
    choices: Sequence[str] | None = None,
) -> None:
    env = flag.lstrip("-").upper().replace("-", "_")
    parser.add_argument(
        flag,
        default=_env_default(env, default, type),
        type=type,
        choices=choices,
        help=f"{help} (env: ARTGW_{env}" + ("" if default is None else f"; default: {default}") + ")",
    )


def _add_db(parser: argparse.ArgumentParser) -> None:
    _option(
        parser,
        "--data-dir",
        default=Path("data"),
        type=Path,
        help="where the SQLite store, logs and spill files live",
    )
    _option(
        parser,
        "--db",
        help="SQLAlchemy URL of the store, e.g. postgresql+asyncpg://user:pw@host/db "
        "(default: SQLite under --data-dir)",
    )


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from artgw.tiny_model import TinyModelSpec, build_tiny_model, fingerprint

    out = build_tiny_model(args.out_dir, TinyModelSpec(seed=args.seed))
    print(f"tiny model written to {out} (sha256 {fingerprint(out)[:16]})")
    return 0


def _settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from gateway.settings import Settings

    return Settings(
        model_name=args.model_name,
        base_model=args.base_model,
        upstream=args.upstream,
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        db=args.db,
        migrate=not args.no_migrate,
        admin_key=args.admin_key,
        engine_port=args.engine_port,
        engine_args=tuple(shlex.split(args.engine_args or "")),
        max_lora_rank=args.max_lora_rank,
        max_model_len=args.max_model_len,
        engine_startup_timeout=args.engine_startup_timeout,
        request_timeout=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app

    try:
        settings = _settings(args)
    except ValueError as exc:
        print(f"artgw serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises the stop signal once it has shut down gracefully; with these handlers in place
    # that re-raise is absorbed, so a requested stop exits 0 and only a fatal error exits non-zero.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    state = getattr(app.state, "gateway", None)
    if state is not None and state.fatal:
        return 1
    return 0 if server.started else 1


def _cmd_migrate(args: argparse.Namespace) -> int:
    from store import create_engine, downgrade, migrate

    url = _store_url(args)

    async def run() -> None:
        engine = create_engine(url)
        try:
            if args.downgrade:
                await downgrade(engine, args.downgrade)
            else:
                await migrate(engine, args.revision)
        finally:
            await engine.dispose()

    asyncio.run(run())
    print(f"store at {url.split('@')[-1]} migrated to {args.downgrade or args.revision}")
    return 0


def _store_url(args: argparse.Namespace) -> str:
    return args.db or f"sqlite+aiosqlite:///{(args.data_dir / 'artgw.sqlite').resolve()}"


def _cmd_export(args: argparse.Namespace) -> int:
    import msgspec

    from gateway.rollouts import RolloutService
    from store import create_engine

    async def run() -> int:
        engine = create_engine(_store_url(args))
        encoder = msgspec.json.Encoder()
        count = 0
        try:
            async for trajectory in RolloutService(engine).export(model=args.model, since=args.since):
                sys.stdout.buffer.write(encoder.encode(trajectory) + b"\n")
                count += 1
        finally:
            await engine.dispose()
        sys.stdout.flush()
        print(f"exported {count} trajectories", file=sys.stderr)
        return 0

    return asyncio.run(run())


def _cmd_train(args: argparse.Namespace) -> int:
    from trainer.config import TrainConfig
    from trainer.train import run

    if not args.base_model:
        print("artgw train: --base-model is required (the same weights vLLM serves)", file=sys.stderr)
        return 2
    try:
        config = TrainConfig(
            model=args.model,
            base_model=args.base_model,
            db=_store_url(args),
            gateway=args.gateway,
            admin_key=args.admin_key,
            checkpoints=args.checkpoints or args.data_dir / "checkpoints",
            groups_per_step=args.groups_per_step,
            min_groups_per_step=min(args.min_groups_per_step, args.groups_per_step),
            max_wait_seconds=args.max_wait,
            max_staleness=args.max_staleness,
            lease_seconds=args.lease_seconds,
            max_steps=args.max_steps,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            learning_rate=args.learning_rate,
            grad_clip=args.grad_clip,
            gradient_checkpointing=args.gradient_checkpointing,
            scale_rewards=args.scale_rewards,
            normalization=args.normalization,
            epsilon_low=args.epsilon_low,
            epsilon_high=args.epsilon_high,
            tis_cap=args.tis_cap if args.tis_cap > 0 else None,
            beta=args.beta,
            mask_truncated=args.mask_truncated,
            train_constrained=args.train_constrained,
            seed=args.seed,
            pause_before_commit=args.pause_before_commit,
        )
    except ValueError as exc:
        print(f"artgw train: {exc}", file=sys.stderr)
        return 2

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)  # finish or abandon the step cleanly, then exit
        await run(config, stop)
        return 0

    return asyncio.run(main())


def _cmd_status(args: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console
    from rich.table import Table

    answer = httpx.get(f"{args.gateway.rstrip('/')}/v1/art/models/{args.model}", timeout=10)
    if answer.status_code != 200:
        print(f"artgw status: {answer.status_code} {answer.text}", file=sys.stderr)
        return 1
    status = answer.json()
    console = Console()
    console.print(
        f"[bold]{status['name']}[/bold] serves step [bold]{status['served_step']}[/bold] "
        f"(base {status['base_model']}; loaded steps {status['loaded_steps']})"
    )
    console.print("groups: " + ", ".join(f"{k}={v}" for k, v in sorted(status["groups"].items())) or "groups: none")
    table = Table("step", "status", "groups", "loss", "reward mean", "tokens/s", "seconds", "error")
    for row in status["steps"]:
        m = row.get("metrics") or {}
        table.add_row(
            str(row["step"]),
            row["status"],
            str(row["group_count"]),
            f"{m.get('loss', float('nan')):.4f}",
            f"{m.get('reward_mean', float('nan')):.3f}",
            f"{m.get('trainable_tokens_per_second', 0):.0f}",
            f"{m.get('step_seconds', 0):.2f}",
            (row.get("error") or "")[:60],
        )
    console.print(table)
    return 0


def _cmd_ruler_score(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    import ruler

    lines = [json.loads(line) for line in args.file.read_text().splitlines() if line.strip()]
    if not lines:
        print(f"artgw ruler score: {args.file} has no trajectories", file=sys.stderr)
        return 2
    # Groups: a `group` field when the lines carry one, else runs of --group-size lines (default: one group).
    groups: dict[str, list[dict]] = {}
    size = args.group_size or len(lines)
    for i, line in enumerate(lines):
        groups.setdefault(str(line.get("group", i // size)), []).append(line)
    rubric = args.rubric.read_text() if args.rubric else ruler.DEFAULT_RUBRIC
    params = json.loads(args.litellm_params) if args.litellm_params else {}
    console = Console()
    table = Table("group", "rollout", "score", "explanation", title=f"RULER scores by {args.judge}")

    async def run() -> int:
        failed = 0
        for name, members in groups.items():
            trajectories = [ruler.Trajectory(messages=m["messages"], tools=m.get("tools")) for m in members]
            try:
                result = await ruler.score_group(
                    trajectories, judge_model=args.judge, rubric=rubric, litellm_params=params
                )
            except ruler.RulerError as exc:
                failed += 1
                table.add_row(name, "-", "-", f"[red]{exc}[/red]")
                continue
            for member, score in zip(members, result.scores, strict=True):
                table.add_row(name, str(member.get("rollout_id", "?")), f"{score.score:.3f}", score.explanation[:80])
            console.print(
                f"group {name}: {result.usage.judge_calls} judge calls, {result.usage.prompt_tokens} prompt tokens, "
                f"cost {result.usage.cost_usd if result.usage.cost_usd is not None else 'unknown'}"
            )
        console.print(table)
        return 1 if failed else 0

    return asyncio.run(run())


def _cmd_demo(args: argparse.Namespace) -> int:
    from artgw.demo import DemoConfig, run

    overrides = {
        name: value
        for name, value in (
            ("steps", args.steps),
            ("groups_per_step", args.groups_per_step),
            ("attempts", args.attempts),
            ("eval_scenarios", args.eval_scenarios),
            ("learning_rate", args.learning_rate),
        )
        if value is not None
    }
    common = {
        "out": args.out,
        "data_dir": args.data_dir,
        "seed": args.seed,
        "port": args.port,
        "trainer_args": tuple(shlex.split(args.trainer_args or "")),
    }
    config = DemoConfig.quick(**common, **overrides) if args.quick else DemoConfig(**common, **overrides)
    return run(config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="artgw",
        description="ART Gateway: an OpenAI-compatible gateway that records every call as token-exact "
        "trajectories and trains the model behind it with GRPO while it serves.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tiny = sub.add_parser(
        "tiny-model",
        help="build a tiny random-weight Qwen2 chat model locally (for tests and demos; no hub needed)",
        description="Build a tiny Qwen2-architecture chat model with random weights, a byte-level BPE "
        "tokenizer trained locally, and a chat template with Hermes/Qwen <tool_call> tools. "
        "Deterministic per seed.",
    )
    tiny.add_argument("out_dir", type=Path, help="directory to write the model to")
    _option(tiny, "--seed", default=0, type=int, help="random seed for weights and tokenizer corpus")
    tiny.set_defaults(func=_cmd_tiny_model)

    serve = sub.add_parser(
        "serve",
        help="run the gateway (and, with --base-model, the vLLM engine it supervises)",
        description="Serve the OpenAI-compatible API. With --base-model the gateway starts vLLM's OpenAI "
        "server as a child process (LoRA runtime loading on), restarts it if it dies and stops it on exit; "
        "with --upstream it uses a vLLM server that is already running. Prints the base_url once ready.",
    )
    _option(serve, "--base-model", help="model path or hub id; the gateway starts and supervises vLLM with it")
    _option(serve, "--upstream", help="URL of a running vLLM OpenAI server (instead of --base-model)")
    _option(serve, "--model-name", default="my-agent", help="the trainable model name clients put in 'model'")
    _option(serve, "--host", default="127.0.0.1", help="address to listen on")
    _option(serve, "--port", default=8000, type=int, help="port to listen on")
    _add_db(serve)
    serve.add_argument(
        "--no-migrate",
        action="store_true",
        default=_env_default("NO_MIGRATE", False, _flag),
        help="do not run store migrations on start (env: ARTGW_NO_MIGRATE)",
    )
    _option(serve, "--admin-key", help="bearer key guarding /v1/art admin endpoints")
    _option(serve, "--engine-port", default=0, type=int, help="port of the supervised vLLM server (0: a free one)")
    _option(serve, "--engine-args", default="", help="extra arguments for vLLM, one shell-quoted string")
    _option(serve, "--max-lora-rank", default=16, type=int, help="vLLM's --max-lora-rank")
    _option(serve, "--max-model-len", default=4096, type=int, help="vLLM's --max-model-len")
    _option(serve, "--engine-startup-timeout", default=600.0, type=float, help="seconds to wait for vLLM")
    _option(serve, "--request-timeout", default=600.0, type=float, help="seconds to wait for an engine answer")
    _option(serve, "--max-body-bytes", default=16 * 1024 * 1024, type=int, help="largest request body accepted")
    _option(serve, "--log-level", default="info", help="log level: debug, info, warning, error")
    serve.set_defaults(func=_cmd_serve)

    mig = sub.add_parser(
        "migrate",
        help="create or upgrade the store schema (Alembic)",
        description="Upgrade the store to the newest schema (or --revision), or --downgrade to a revision.",
    )
    _add_db(mig)
    mig.add_argument("--revision", default="head", help="revision to upgrade to (default: head)")
    mig.add_argument("--downgrade", metavar="REVISION", help="downgrade to REVISION instead ('base' = empty)")
    mig.set_defaults(func=_cmd_migrate)

    export = sub.add_parser(
        "export",
        help="write recorded trajectories as JSON lines to stdout",
        description="Export assembled rollouts (messages, tools, token-level sequences with sampled masks and "
        "logprobs, per-call status) as one JSON object per line, e.g. `artgw export --model my-agent > t.jsonl`.",
    )
    _add_db(export)
    export.add_argument("--model", help="only rollouts of this trainable model (default: all)")
    export.add_argument("--since", type=float, help="only rollouts with a call at or after this unix time")
    export.set_defaults(func=_cmd_export)

    train = sub.add_parser(
        "train",
        help="run the GRPO trainer sidecar for one trainable model",
        description="Claim ready groups from the store (leases: a dead trainer's groups return), train a LoRA "
        "step with GRPO on the recorded token ids, write CHECKPOINTS/NAME/<step>/, and have the gateway load "
        "it as NAME@<step> and point NAME at it. Groups count as trained only once the adapter serves. "
        "Restarts resume from the newest committed checkpoint with its optimizer state.",
    )
    _option(train, "--model", default="my-agent", help="trainable model name (the gateway's --model-name)")
    _option(train, "--base-model", help="path or hub id of the base weights (the same vLLM serves)")
    _add_db(train)
    _option(train, "--gateway", default="http://127.0.0.1:8000", help="gateway URL to post adapters to")
    _option(train, "--admin-key", help="the gateway's admin key")
    _option(train, "--checkpoints", type=Path, help="checkpoint root (default: DATA_DIR/checkpoints)")
    _option(train, "--groups-per-step", default=4, type=int, help="groups per optimizer step")
    _option(train, "--min-groups-per-step", default=1, type=int, help="fewest groups to train after --max-wait")
    _option(train, "--max-wait", default=30.0, type=float, help="seconds to wait for --groups-per-step groups")
    _option(train, "--max-staleness", default=8, type=int, help="drop groups sampled >= this many steps ago; 0 off")
    _option(train, "--lease-seconds", default=600.0, type=float, help="claim lease; an expired claim returns")
    _option(train, "--max-steps", type=int, help="stop after this many committed steps")
    _option(train, "--lora-rank", default=8, type=int, help="LoRA rank (<= the engine's --max-lora-rank)")
    _option(train, "--lora-alpha", default=16, type=int, help="LoRA alpha")
    _option(train, "--learning-rate", default=1e-4, type=float, help="AdamW learning rate")
    _option(train, "--grad-clip", default=1.0, type=float, help="max gradient norm (0: off)")
    train.add_argument("--gradient-checkpointing", action="store_true", help="trade compute for memory")
    _option(train, "--scale-rewards", default="group", help="advantage std scaling", choices=("group", "batch", "none"))
    _option(train, "--normalization", default="grpo", help="loss normalization", choices=("grpo", "dr_grpo", "dapo"))
    _option(train, "--epsilon-low", default=0.2, type=float, help="PPO clip: ratio >= 1 - epsilon_low")
    _option(train, "--epsilon-high", default=0.28, type=float, help="PPO clip: ratio <= 1 + epsilon_high")
    _option(train, "--tis-cap", default=2.0, type=float, help="truncated importance-sampling cap (0: off)")
    _option(train, "--beta", default=0.0, type=float, help="KL-to-base weight (k3); 0: off")
    train.add_argument("--mask-truncated", action="store_true", help="no loss on completions cut by max_tokens")
    train.add_argument(
        "--train-constrained",
        action="store_true",
        help="also train tokens sampled under a grammar (named/required tool_choice, JSON response_format, guided "
        "decoding); off by default because vLLM reports their logprobs after the grammar's mask",
    )
    _option(train, "--seed", default=0, type=int, help="random seed")
    _option(train, "--pause-before-commit", default=0.0, type=float, help="sleep before commit (crash tests)")
    train.set_defaults(func=_cmd_train)

    ruler_cmd = sub.add_parser("ruler", help="RULER, the LLM judge, offline", description="RULER commands.")
    ruler_sub = ruler_cmd.add_subparsers(dest="ruler_command", required=True, metavar="COMMAND")
    score = ruler_sub.add_parser(
        "score",
        help="score groups of exported trajectories with an LLM judge and print a table",
        description="Score trajectories from `artgw export` (JSON lines) with RULER. Lines are grouped by their "
        "`group` field if they have one, else in runs of --group-size (default: all lines are one group).",
    )
    score.add_argument("file", type=Path, help="JSON lines with `messages` (and `tools`), e.g. from artgw export")
    score.add_argument("--judge", required=True, help="litellm model name, e.g. openai/gpt-4o-mini")
    score.add_argument("--rubric", type=Path, help="file with the rubric (default: RULER's)")
    score.add_argument("--group-size", type=int, help="trajectories per group when lines carry no `group`")
    score.add_argument("--litellm-params", help='JSON passed to litellm, e.g. \'{"api_base": "http://..."}\'')
    score.set_defaults(func=_cmd_ruler_score)

    demo = sub.add_parser(
        "demo",
        help="the whole loop end to end: tiny model, gateway + vLLM, trainer, an agent learning a task by RL",
        description="Build the tiny model, start the gateway (supervising vLLM) and the trainer, run an agent "
        "over the unmodified OpenAI SDK (it calls a tool that "
        "returns the ballots on a motion and says whether the motion passed), post rewards to /v1/art/groups, "
        "train GRPO steps that the gateway hot-loads, and evaluate held-out scenarios before and after. Writes a "
        "table, results.json and a reward-curve PNG to --out; stops everything it started on exit or Ctrl-C.",
    )
    _option(demo, "--out", default=Path("demo-out"), type=Path, help="where the table and the PNG go")
    _option(demo, "--data-dir", default=Path("data/demo"), type=Path, help="models, store, checkpoints and logs")
    demo.add_argument("--quick", action="store_true", help="fewer steps and scenarios (CI: a few minutes)")
    _option(demo, "--steps", type=int, help="GRPO steps (default: 16; with --quick: 8)")
    _option(demo, "--groups-per-step", type=int, help="scenarios per step (default: 8)")
    _option(demo, "--attempts", type=int, help="attempts per scenario: the group GRPO compares (default: 8)")
    _option(demo, "--eval-scenarios", type=int, help="held-out scenarios (default: 64; with --quick: 32)")
    _option(demo, "--learning-rate", type=float, help="the trainer's LoRA learning rate (default: 5e-3)")
    _option(demo, "--seed", default=0, type=int, help="seed of the scenarios and the trainer")
    _option(demo, "--port", default=0, type=int, help="the gateway's port (0: a free one)")
    _option(demo, "--trainer-args", default="", help="more `artgw train` options, one shell-quoted string")
    demo.set_defaults(func=_cmd_demo)

    status = sub.add_parser(
        "status",
        help="show a trainable model's served step, groups and last training steps",
        description="Print what GET /v1/art/models/NAME says: served step, group counts by state, step metrics.",
    )
    _option(status, "--model", default="my-agent", help="trainable model name")
    _option(status, "--gateway", default="http://127.0.0.1:8000", help="gateway URL")
    status.set_defaults(func=_cmd_status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "info")).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "alembic"):  # one line per upstream request / migration step otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
