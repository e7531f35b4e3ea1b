#!/usr/bin/env python3
"""What the gateway adds to every call: latency, throughput and records, against a fixed upstream.

Starts a fixed-response stand-in for vLLM (nginx, ~0.03 ms a call; a Python
stub if nginx cannot be had), starts `artgw serve --upstream` in front of it
with a fresh SQLite store, and drives both with wrk (one thread) at each
concurrency: direct to the upstream and through the gateway, side by side.
Then it stops the gateway gracefully (so the recorder flushes) and checks that
every call made through the gateway has its row in the store's `calls` table.

Prints a table (req/s, p50/p99, added p50 per concurrency) and PASS/FAIL
against the targets: added p50 < 1 ms at one connection; gateway throughput
>= 70% of direct at 256 connections and >= 2,000 req/s at 32-256 (DESIGN.md);
not one record lost.

    .venv/bin/python bench/gateway_overhead.py --duration 5
    .venv/bin/python bench/gateway_overhead.py --duration 5 --baseline HEAD~3 --rounds 3
    .venv/bin/python bench/gateway_overhead.py --duration 5 --auth-compare --rounds 3

With --baseline REV it also exports that git revision's tree (`git archive REV |
tar -x` into the temp dir: no worktree, the repo untouched) and runs a second
gateway from it, on the same Python with PYTHONPATH (and cwd) set to that tree,
behind its own upstream port and with its own store. Each concurrency then runs
direct, then baseline and current gateway --rounds times, the order swapped
every round, the same pause between runs; the report adds a side-by-side table
(pooled runs), the record check of both and `not slower than baseline:
PASS/FAIL` (a single comparison, not a statistic; the tolerances are in --help).

With --auth-compare (not with --baseline) the two gateways are both the
current tree, the same way: one `--auth off`, called with no key, and one
`--auth required`, called with one client key made at start through
`POST /v1/art/keys` (the admin key from its data dir; wrk sends
`Authorization: Bearer <key>`). The report puts auth off and auth on side by
side with their ratios, checks the records of both (and that every auth-on
record carries the key's id in `calls.key_id`) and prints `auth on within 10%
of auth off: PASS/FAIL`; the main table is then the auth-on gateway's.

Needs `wrk` and (preferably) `nginx`; installs the Debian packages with
apt-get if they are missing (unless --no-install). Every child process is
stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
WRK_SCRIPT = BENCH_DIR / "wrk_chat.lua"
MODEL_NAME = "my-agent"
CHAT_REQUEST = json.dumps(
    {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
).encode()

sys.path.insert(0, str(BENCH_DIR))
from fixed_upstream import CHAT_BODY, MODELS_BODY, NOT_FOUND_BODY  # noqa: E402

# --baseline: the current gateway is "not slower" when its req/s is at least this share of the
# baseline's at every concurrency, and its p50 at one connection at most this much above the baseline's.
BASELINE_MIN_RPS_RATIO = 0.95
BASELINE_P50_SLACK_MS = 0.05
# --auth-compare: auth on (one client key) is "within 10% of auth off" when its req/s is at least this share of
# auth off's at every concurrency, and its p50 at one connection at most this much above auth off's.
AUTH_MIN_RPS_RATIO = 0.90
AUTH_P50_SLACK_MS = 0.05
# How the baseline gateway is started: its tree's own `artgw serve`, found first on PYTHONPATH.
BASELINE_MAIN = "import sys; from artgw.cli import main; sys.exit(main())"
# Run in the baseline's environment: where artgw and every package of both trees resolve from.
BASELINE_PROBE = """
import importlib.util, json, sys
import artgw, artgw.cli
names = sys.argv[1].split(",")
found = {n: getattr(importlib.util.find_spec(n), "origin", None) for n in names}
loaded = sorted({f for m in list(sys.modules.values()) if (f := getattr(m, "__file__", None))})
print(json.dumps({"artgw": artgw.__file__, "cli": artgw.cli.__file__, "found": found, "loaded": loaded}))
"""


def say(msg: str = "") -> None:
    print(msg, flush=True)


@dataclass(frozen=True)
class Comparison:
    """Two gateways side by side: a reference ("old" slot) and the one judged against it ("new" slot)."""

    old: str  # how the report names each slot
    new: str
    old_name: str  # each slot's Gateway name: its wrk target, data dir and log file
    new_name: str
    verdict: str  # the verdict line's name
    min_rps_ratio: float  # new req/s >= this share of old's, at every concurrency
    p50_slack_ms: float  # new p50 <= old p50 + this, at concurrency 1


BASELINE = Comparison(
    old="baseline",
    new="current",
    old_name="baseline",
    new_name="gateway",
    verdict="not slower than baseline",
    min_rps_ratio=BASELINE_MIN_RPS_RATIO,
    p50_slack_ms=BASELINE_P50_SLACK_MS,
)
AUTH = Comparison(
    old="auth off",
    new="auth on",
    old_name="auth-off",
    new_name="auth-on",
    verdict=f"auth on within {1 - AUTH_MIN_RPS_RATIO:.0%} of auth off",
    min_rps_ratio=AUTH_MIN_RPS_RATIO,
    p50_slack_ms=AUTH_P50_SLACK_MS,
)


# ---------------------------------------------------------------- child processes


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if this script dies, however it dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Children:
    """Every process this script starts, each in its own session, all stopped on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []

    def start(self, cmd: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent, **kwargs)
        self.procs.append(proc)
        return proc

    def sessions(self) -> set[int]:
        return {p.pid for p in self.procs}

    @staticmethod
    def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 10.0) -> bool:
        """Signal the child's whole session (nginx workers included); SIGKILL if it will not go.

        Returns False when it had to be killed.
        """
        graceful = True
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                graceful = False
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers in the session, if any
        return graceful

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(
    method: str, url: str, body: bytes | None = None, timeout: float = 5.0, key: str | None = None
) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_http_ok(url: str, proc: subprocess.Popen[Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before it was ready")
        with contextlib.suppress(OSError):
            if http("GET", url, timeout=2.0)[0] == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s ({url})")


def ensure_tool(binary: str, package: str, install: bool) -> bool:
    if shutil.which(binary):
        return True
    if not install:
        return False
    command = ["apt-get", "install", "-y", "--no-install-recommends", package]
    say(f"{binary} not found; running: {' '.join(command)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    quiet = {"stdout": subprocess.DEVNULL, "env": env}
    if subprocess.run(command, check=False, **quiet).returncode != 0:
        say("install failed; running: apt-get update, then the install again")
        subprocess.run(["apt-get", "update"], check=False, **quiet)
        subprocess.run(command, check=False, **quiet)
    return shutil.which(binary) is not None


# ---------------------------------------------------------------- the fixed upstream


def _nginx_string(data: bytes) -> str:
    text = data.decode()
    if any(c in text for c in "'$\\"):
        raise ValueError("canned body must not contain ' $ or \\ (nginx string)")
    return f"'{text}'"


class NginxUpstream:
    """nginx with `return 200 '<json>'`: one server for direct runs, one (logging) behind each gateway."""

    kind = "nginx"

    def __init__(
        self,
        children: Children,
        workdir: Path,
        chat_body: bytes = CHAT_BODY,
        chat_type: str = "application/json",
        gateways: int = 1,
    ) -> None:
        self.children = children
        self.chat_body, self.chat_type = chat_body, chat_type
        self.dir = workdir / "nginx"
        self.dir.mkdir()
        self.direct_port = free_port()
        self.gateway_ports = [free_port() for _ in range(gateways)]  # each gateway's calls logged apart
        self.gateway_port = self.gateway_ports[0]
        self.calls_logs = {port: self.dir / f"gateway_upstream_calls-{port}.log" for port in self.gateway_ports}
        self.proc: subprocess.Popen[Any] | None = None

    def _server(self, port: int, calls_log: Path | None) -> str:
        access = f"access_log {calls_log} calls buffer=64k flush=1s;" if calls_log else ""
        return f"""
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location = /health {{ return 200; }}
        location = /v1/models {{ return 200 {_nginx_string(MODELS_BODY)}; }}
        location = /v1/chat/completions {{
            {access} default_type {self.chat_type}; return 200 {_nginx_string(self.chat_body)};
        }}
        location / {{ return 404 {_nginx_string(NOT_FOUND_BODY)}; }}
    }}"""

    def start(self) -> None:
        d = self.dir
        conf = d / "nginx.conf"
        conf.write_text(
            f"""daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    default_type application/json;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
    client_body_temp_path {d}/client_body;
    log_format calls '$status';
{self._server(self.direct_port, None)}
{"".join(self._server(port, log) for port, log in self.calls_logs.items())}
}}
"""
        )
        self.proc = self.children.start(
            ["nginx", "-e", str(d / "error.log"), "-p", str(d), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=(d / "stderr.log").open("wb"),
        )
        for port in (self.direct_port, *self.gateway_ports):
            wait_http_ok(f"http://127.0.0.1:{port}/health", self.proc, 10, "nginx")

    def stop(self) -> None:
        if self.proc is not None:
            Children.stop(self.proc, signal.SIGQUIT)  # graceful: flushes the buffered access log

    def gateway_calls(self, port: int | None = None) -> Counter[str]:
        """Chat calls the upstream behind a gateway (the first by default) answered, by HTTP status (after stop())."""
        calls_log = self.calls_logs[self.gateway_port if port is None else port]
        if not calls_log.exists():
            return Counter()
        return Counter(line.strip() for line in calls_log.read_text().splitlines() if line.strip())


class PythonUpstream:
    """Fallback: bench/fixed_upstream.py (raw ASGI under uvicorn), one instance per role."""

    kind = "Python stub (bench/fixed_upstream.py: raw ASGI + uvicorn)"

    def __init__(self, children: Children, workdir: Path, gateways: int = 1) -> None:
        self.children = children
        self.dir = workdir
        self.direct_port = free_port()
        self.gateway_ports = [free_port() for _ in range(gateways)]
        self.gateway_port = self.gateway_ports[0]
        self.procs: list[subprocess.Popen[Any]] = []
        self._gateway_calls: dict[int, Counter[str]] = {}

    def start(self) -> None:
        for port in (self.direct_port, *self.gateway_ports):
            proc = self.children.start(
                [sys.executable, str(BENCH_DIR / "fixed_upstream.py"), "--port", str(port)],
                stdout=subprocess.DEVNULL,
                stderr=(self.dir / f"stub-{port}.log").open("wb"),
            )
            self.procs.append(proc)
            wait_http_ok(f"http://127.0.0.1:{port}/health", proc, 20, "python stub upstream")

    def stop(self) -> None:
        for port in self.gateway_ports:
            with contextlib.suppress(OSError):
                _, data = http("GET", f"http://127.0.0.1:{port}/_stats")
                self._gateway_calls[port] = Counter({"200": json.loads(data)["chat_calls"]})
        for proc in self.procs:
            Children.stop(proc)

    def gateway_calls(self, port: int | None = None) -> Counter[str]:
        return self._gateway_calls.get(self.gateway_port if port is None else port, Counter())


# ---------------------------------------------------------------- the gateway


def tree_env(tree: Path) -> dict[str, str]:
    """The environment that makes a Python import a source tree's own packages (ahead of the editable install)."""
    return {**os.environ, "PYTHONPATH": str(tree)}


class Gateway:
    """`artgw serve`: the installed `artgw`, or (source=TREE) `python -c ...` run from an exported tree.

    auth: None passes no --auth (the tree's default); "required" also makes one client key once it is up
    (`api_key`, `key_id`), which every call through it then sends.
    """

    def __init__(
        self,
        children: Children,
        artgw: str,
        upstream_port: int,
        workdir: Path,
        name: str = "gateway",
        source: Path | None = None,
        python: str = sys.executable,
        auth: str | None = None,
        workers: int = 1,
    ) -> None:
        self.children = children
        self.workers = workers  # `serve --workers`: processes on the gateway's port
        self.artgw = artgw
        self.upstream_port = upstream_port
        self.name = name
        self.source = source
        self.python = python
        self.auth = auth
        self.port = free_port()
        self.data_dir = workdir / f"{name}-data"
        self.log = workdir / f"{name}.log"
        self.proc: subprocess.Popen[Any] | None = None
        self.api_key: str | None = None  # the client key calls send (auth required)
        self.key_id: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def label(self) -> str:
        return "gateway" if self.name == "gateway" else f"{self.name} gateway"

    def start(self) -> None:
        args = [
            "serve",
            "--upstream",
            f"http://127.0.0.1:{self.upstream_port}",
            "--model-name",
            MODEL_NAME,
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            "--log-level",
            "warning",
        ]
        if self.auth is not None:
            args += ["--auth", self.auth]
        if self.workers > 1:
            args += ["--workers", str(self.workers)]
        label = f"{self.name + ':':9}"
        kwargs: dict[str, Any] = {}
        if self.source is None:
            cmd = [self.artgw, *args]
            say(f"{label} {' '.join(cmd)}")
        else:
            cmd = [self.python, "-c", BASELINE_MAIN, *args]
            kwargs = {"cwd": self.source, "env": tree_env(self.source)}
            say(f"{label} cd {self.source} && PYTHONPATH={self.source} {shlex.join(cmd)}")
        self.proc = self.children.start(cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, **kwargs)
        try:
            wait_http_ok(f"{self.url}/readyz", self.proc, 60, f"the {self.label}")
            deadline = time.monotonic() + 60
            while self.log.read_text(errors="replace").count("ART Gateway ready") < self.workers:  # each worker's
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"the {self.label}'s {self.workers} workers did not all get ready")
                time.sleep(0.2)
        except RuntimeError:
            say(self.log_tail())
            raise
        if self.auth == "required":
            self.api_key, self.key_id = self._make_key()
            say(
                f"{label} client key {self.key_id} made with POST /v1/art/keys (scopes: infer); "
                "wrk sends Authorization: Bearer <key>"
            )

    def admin_key(self) -> str:
        """What `artgw serve` uses: ARTGW_ADMIN_KEY, else the file (ARTGW_ADMIN_KEY_FILE or DATA_DIR/admin_key)."""
        if os.environ.get("ARTGW_ADMIN_KEY"):
            return os.environ["ARTGW_ADMIN_KEY"]
        path = Path(os.environ.get("ARTGW_ADMIN_KEY_FILE") or self.data_dir / "admin_key")
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise RuntimeError(f"the {self.label}'s admin key file cannot be read: {exc}") from None

    def _make_key(self) -> tuple[str, str]:
        """One client key (scope infer), made by the admin over HTTP as a deployment would: (secret, id)."""
        body = json.dumps({"name": "bench", "scopes": ["infer"]}).encode()
        status, data = http("POST", f"{self.url}/v1/art/keys", body, key=self.admin_key())
        made = json.loads(data) if status == 201 else {}
        if status != 201 or not made.get("key") or not made.get("id"):
            raise RuntimeError(f"POST /v1/art/keys on the {self.label} answered {status} {data[:300]!r}")
        return str(made["key"]), str(made["id"])

    def log_tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def cpu_seconds(self) -> float:
        """User + system CPU time of the gateway's processes (all their threads; its workers with --workers)."""
        assert self.proc is not None
        pids = [self.proc.pid]
        if self.workers > 1:
            with contextlib.suppress(OSError):
                pids += [
                    int(p) for p in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
                ]
        ticks = 0
        for pid in pids:
            try:
                rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks += int(rest[11]) + int(rest[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self, timeout: float = 90.0) -> str:
        """SIGTERM and wait: uvicorn drains, the lifespan closes the recorder, which flushes."""
        assert self.proc is not None
        started = time.monotonic()
        graceful = Children.stop(self.proc, signal.SIGTERM, timeout)
        seconds = time.monotonic() - started
        if not graceful:
            return f"did NOT stop within {timeout:.0f}s of SIGTERM: killed"
        code = self.proc.returncode
        # uvicorn re-raises the signal it caught once it has shut down: -15 is a clean stop.
        how = "exit 0" if code == 0 else ("re-raised SIGTERM" if code == -signal.SIGTERM else f"exit {code}")
        return f"stopped on SIGTERM in {seconds:.1f}s ({how})"

    @property
    def stopped_cleanly(self) -> bool:
        return self.proc is not None and self.proc.returncode in (0, -signal.SIGTERM)


def key_id_counts(data_dir: Path) -> Counter[str | None]:
    """Rows in `calls` by `key_id` (None: made without a key)."""
    db = data_dir / "artgw.sqlite"
    if not db.exists():
        return Counter()
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return Counter(dict(conn.execute("SELECT key_id, count(*) FROM calls GROUP BY key_id").fetchall()))


def store_counts(data_dir: Path) -> tuple[int, Counter[str], int]:
    """(rows in `calls`, rows by status/http_status, records left in spill files)."""
    db = data_dir / "artgw.sqlite"
    by_status: Counter[str] = Counter()
    total = 0
    if db.exists():
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            total = conn.execute("SELECT count(*) FROM calls").fetchone()[0]
            for status, http_status, n in conn.execute(
                "SELECT status, http_status, count(*) FROM calls GROUP BY status, http_status"
            ):
                by_status[f"{status}/{http_status}"] = n
    spilled = sum(
        sum(1 for line in p.read_bytes().splitlines() if line.strip())
        for p in (data_dir / "spill").glob("unrecorded-*.jsonl")
    )
    return total, by_status, spilled


# ---------------------------------------------------------------- the baseline


def artgw_python(artgw: str) -> str:
    """The interpreter `artgw` runs on (its shebang), so that the baseline gateway runs on the same Python."""
    path = Path(artgw) if Path(artgw).exists() else Path(shutil.which(artgw) or artgw)
    with contextlib.suppress(OSError, UnicodeDecodeError), path.open("rb") as f:
        first = f.readline(500)
        if first.startswith(b"#!"):
            interpreter = first[2:].decode().split()[0]
            if Path(interpreter).name.startswith("python") and os.access(interpreter, os.X_OK):
                return interpreter
    return sys.executable


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)


def export_tree(rev: str, dest: Path) -> str:
    """`git archive REV | tar -x -C dest`: no worktree, nothing in the repo changes. Returns 'hash subject'."""
    found = _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if found.returncode != 0:
        raise RuntimeError(f"--baseline {rev!r} is not a commit of {REPO}")
    commit = found.stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(REPO), "archive", commit], stdout=subprocess.PIPE)
    assert archive.stdout is not None
    tar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, capture_output=True, check=False)
    archive.stdout.close()
    if archive.wait() != 0 or tar.returncode != 0:
        raise RuntimeError(f"git archive {commit} | tar -x -C {dest} failed: {tar.stderr.decode(errors='replace')}")
    line = _git("log", "-1", "--format=%h %s", commit).stdout.strip()
    return line if len(line) <= 72 else line[:71] + "…"


def packages(tree: Path) -> list[str]:
    """The top-level Python packages of a source tree (directories with an __init__.py)."""
    return sorted(d.name for d in tree.iterdir() if (d / "__init__.py").is_file())


def check_tree_imports(python: str, tree: Path) -> str:
    """Make sure `python` with tree_env(tree), run in `tree`, imports artgw and every package from `tree`.

    Imports artgw.cli (what the baseline gateway runs), then checks where each of the tree's top-level
    packages resolves and that no module was loaded from the current tree's packages.
    """
    names = packages(tree)
    probe = subprocess.run(
        [python, "-c", BASELINE_PROBE, ",".join(names)],
        cwd=tree,
        env=tree_env(tree),
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        raise RuntimeError(f"the baseline's artgw does not import ({python}):\n{probe.stderr[-3000:]}")
    found = json.loads(probe.stdout.strip().splitlines()[-1])

    def inside(path: str | None, root: Path) -> bool:
        return path is not None and Path(path).resolve().is_relative_to(root.resolve())

    stray = [f"{n}: {o}" for n, o in found["found"].items() if not inside(o, tree)]
    stray += [f for f in found["loaded"] if any(inside(f, REPO / n) for n in packages(REPO))]
    if not inside(found["artgw"], tree) or not inside(found["cli"], tree) or stray:
        raise RuntimeError(
            f"the baseline's Python does not import from {tree}: artgw from {found['artgw']}; "
            f"from elsewhere: {', '.join(stray) or '-'}"
        )
    return (
        f"{python} with PYTHONPATH={tree} imports artgw from {found['artgw']} "
        f"({', '.join(names)}: all from there, nothing from {REPO})"
    )


# ---------------------------------------------------------------- load


@dataclass
class WrkResult:
    target: str
    connections: int
    requests: int
    seconds: float
    non2xx: int
    connect: int
    read: int
    write: int
    timeout: int
    p50_ms: float
    p99_ms: float
    cpu_pct: float | None = None  # the gateway's CPU use during the run
    p90_ms: float = 0.0
    p999_ms: float = 0.0
    loop_lag_ms: float | None = None  # the gateway's longest event-loop lag in the run's last 10 s (its /metrics)
    cpu_seconds: float | None = None  # the gateway's CPU time over the run (user + system, all its processes)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def cpu_ms_per_call(self) -> float | None:
        """The gateway's CPU per call answered: what a busy machine leaves alone, unlike req/s (the CPU it spent
        on calls wrk's stop cut is counted, over the answered ones: a few in thousands)."""
        return 1000 * self.cpu_seconds / self.requests if self.cpu_seconds is not None and self.requests else None

    @property
    def error_counts(self) -> tuple[int, int, int, int]:
        return self.connect, self.read, self.write, self.timeout


def _pooled(runs: list[WrkResult]) -> WrkResult:
    """Several runs of one target as one: requests over seconds, the median p50 and p99, the mean CPU."""
    if len(runs) == 1:
        return runs[0]
    cpus = [r.cpu_pct for r in runs if r.cpu_pct is not None]
    cpu_seconds = [r.cpu_seconds for r in runs if r.cpu_seconds is not None]
    return WrkResult(
        target=runs[0].target,
        connections=runs[0].connections,
        requests=sum(r.requests for r in runs),
        seconds=sum(r.seconds for r in runs),
        non2xx=sum(r.non2xx for r in runs),
        connect=sum(r.connect for r in runs),
        read=sum(r.read for r in runs),
        write=sum(r.write for r in runs),
        timeout=sum(r.timeout for r in runs),
        p50_ms=statistics.median(r.p50_ms for r in runs),
        p99_ms=statistics.median(r.p99_ms for r in runs),
        cpu_pct=statistics.fmean(cpus) if cpus else None,
        p90_ms=statistics.median(r.p90_ms for r in runs),
        p999_ms=statistics.median(r.p999_ms for r in runs),
        loop_lag_ms=max((r.loop_lag_ms for r in runs if r.loop_lag_ms is not None), default=None),
        cpu_seconds=sum(cpu_seconds) if cpu_seconds else None,
    )


def progress(r: WrkResult) -> None:
    cpu = f"  (gateway CPU {r.cpu_pct:.0f}%, {_ms(r.cpu_ms_per_call)} ms a call)" if r.cpu_pct is not None else ""
    say(f"  c={r.connections:<4} {r.target:8} {r.rps:>9,.0f} req/s  p50 {r.p50_ms:.3f} ms  p99 {r.p99_ms:.3f} ms{cpu}")


def run_wrk(
    children: Children,
    url: str,
    connections: int,
    seconds: int,
    rollout_id: str,
    target: str,
    api_key: str | None = None,
    rollouts: str = "long",
) -> WrkResult:
    """One wrk run of bench/wrk_chat.lua; with `api_key`, every request sends `Authorization: Bearer <key>`.
    `rollouts`: "long" (every call names `rollout_id`), "fresh" (each call a rollout of its own, never named
    before: ids unique to this run) or "none" (no rollout id)."""
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s", "--latency"]
    cmd += ["-s", str(WRK_SCRIPT), url]
    env = {k: v for k, v in os.environ.items() if k != "BENCH_API_KEY"}  # no key unless this run's
    env["BENCH_ROLLOUTS"] = rollouts
    env["BENCH_ROLLOUT_ID"] = f"{rollout_id}-{uuid.uuid4().hex[:8]}" if rollouts == "fresh" else rollout_id
    if api_key is not None:
        env["BENCH_API_KEY"] = api_key
    proc = children.start(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        out, _ = proc.communicate(timeout=seconds + 60)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"wrk did not finish within {seconds + 60}s") from None
    children.procs.remove(proc)
    line = next((x for x in out.splitlines() if x.startswith("BENCH_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed (exit {proc.returncode}):\n{out}")
    r = json.loads(line.split(" ", 1)[1])
    return WrkResult(
        target=target,
        connections=connections,
        requests=r["requests"],
        seconds=r["duration_us"] / 1e6,
        non2xx=r["status"],
        connect=r["connect"],
        read=r["read"],
        write=r["write"],
        timeout=r["timeout"],
        p50_ms=r["p50_us"] / 1000,
        p99_ms=r["p99_us"] / 1000,
        p90_ms=r["p90_us"] / 1000,
        p999_ms=r["p999_us"] / 1000,
    )


# ---------------------------------------------------------------- machine


def _proc_times() -> dict[int, tuple[str, int, float]]:
    """pid -> (name, session id, CPU seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, int, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            raw = (entry / "stat").read_text()
            name = raw[raw.index("(") + 1 : raw.rindex(")")]
            rest = raw.rsplit(")", 1)[1].split()
            out[int(entry.name)] = (name, int(rest[3]), (int(rest[11]) + int(rest[12])) / tick)
    return out


def other_load(before: dict[int, tuple[str, int, float]], seconds: float, ours: set[int]) -> list[str]:
    """Processes not started by this benchmark that used >= 3% of a core over the run."""
    after = _proc_times()
    me = os.getsid(0)
    busy = []
    for pid, (name, sid, cpu) in after.items():
        if sid in ours or sid == me or pid == os.getpid():
            continue
        used = cpu - before[pid][2] if pid in before else cpu
        pct = 100 * used / seconds if seconds else 0
        if pct >= 3:
            busy.append((pct, f"{name}[{pid}] {pct:.0f}%"))
    return [text for _, text in sorted(busy, reverse=True)]


def machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores, {model or platform.machine()}, Python {platform.python_version()}"


def tool_versions() -> str:
    parts = []
    with contextlib.suppress(Exception):
        out = subprocess.run(["nginx", "-v"], capture_output=True, text=True, check=False).stderr
        parts.append(out.strip().replace("nginx version: ", ""))
    with contextlib.suppress(Exception):
        out = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False).stdout
        parts.append(out.split("[")[0].strip().replace("debian/", ""))
    return ", ".join(parts)


# ---------------------------------------------------------------- report


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def verdict(ok: bool | None) -> str:
    return "n/a " if ok is None else ("PASS" if ok else "FAIL")


def parse_concurrency(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1")
    return values


def default_artgw() -> str:
    for candidate in (Path(sys.executable).parent / "artgw", REPO / ".venv" / "bin" / "artgw"):
        if candidate.exists():
            return str(candidate)
    return shutil.which("artgw") or str(REPO / ".venv" / "bin" / "artgw")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gateway_overhead.py",
        description=__doc__,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--duration", type=int, default=10, help="seconds of load per run (wrk -d)")
    parser.add_argument(
        "--concurrency",
        type=parse_concurrency,
        default="1,32,256",
        metavar="N[,N...]",
        help="wrk connection counts, comma-separated; each is run direct and through the gateway",
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="seconds of load through the gateway before measuring (0: none)"
    )
    parser.add_argument(
        "--upstream",
        choices=["auto", "nginx", "python"],
        default="auto",
        help="fixed-response upstream: nginx (preferred), the Python stub, or auto (nginx, else Python)",
    )
    parser.add_argument("--artgw", default=default_artgw(), help="the artgw executable to benchmark")
    parser.add_argument(
        "--no-install", action="store_true", help="never apt-get install wrk/nginx when they are missing"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --baseline or --auth-compare: pairs of runs per concurrency, the two gateways in swapped "
        "order every round, pooled (req/s over all runs, median p50/p99); 3 or more to see past the order bias",
    )
    parser.add_argument(
        "--rollouts",
        choices=["long", "fresh", "none"],
        default="long",
        help="the rollout id the measured calls name: long (one per run: a rollout of many calls), fresh (a new "
        "one per call, never seen before: every call is a rollout's first, as in RL tasks of one call) or none "
        "(no X-ART-Rollout-Id: the gateway makes one up)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="the current tree's gateway as `serve --workers N` (the baseline's and auth off's: one process); its "
        "CPU%% is all its processes'",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (store, logs, configs)")
    parser.add_argument(
        "--pause", type=float, default=1.0, help="seconds of idle between runs (the recorder catches up)"
    )
    compare = parser.add_mutually_exclusive_group()
    compare.add_argument(
        "--baseline",
        metavar="REV",
        help=(
            "a git revision (HEAD~3, a commit hash, a tag) to compare with: its tree is exported with "
            "`git archive REV | tar -x` into the temp dir and served by a second gateway (the same Python as "
            "--artgw, PYTHONPATH and cwd = that tree; checked at start), behind its own upstream port, with its "
            "own store; per concurrency: direct, then baseline and current (--rounds pairs, order swapped every "
            "round). Adds a side-by-side table, the baseline's "
            f"record check and 'not slower than baseline: PASS/FAIL': PASS when the current req/s >= "
            f"{BASELINE_MIN_RPS_RATIO:.0%}% of the baseline's at every concurrency and its p50 at concurrency 1 "
            f"<= the baseline's + {BASELINE_P50_SLACK_MS} ms, with no non-2xx or socket errors in the current's "
            "runs (a single comparison, not a statistic); without it or --auth-compare, no comparison"
        ),
    )
    compare.add_argument(
        "--auth-compare",
        action="store_true",
        help=(
            "compare auth off with auth on, both gateways the current tree (--artgw): one `--auth off`, "
            "called with no key, and one `--auth required`, called with one client key (scope infer) made at "
            "start with POST /v1/art/keys and the admin key from its data dir, each behind its own upstream "
            "port, with its own store; per concurrency: direct, then both (--rounds pairs, order swapped every "
            "round). Adds a side-by-side table with ratios (auth on / auth off), the record check of both, how "
            "many auth-on records carry the key id (calls.key_id), and 'auth on within "
            f"{1 - AUTH_MIN_RPS_RATIO:.0%}% of auth off: PASS/FAIL': PASS when auth on's req/s >= "
            f"{AUTH_MIN_RPS_RATIO:.0%}% of auth off's at every concurrency and its p50 at concurrency 1 <= auth "
            f"off's + {AUTH_P50_SLACK_MS} ms, with no non-2xx or socket errors in auth on's runs"
        ),
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not ensure_tool("wrk", "wrk", not args.no_install):
        say("error: wrk is required (apt-get install wrk)")
        return 2
    use_nginx = args.upstream in ("auto", "nginx") and ensure_tool("nginx", "nginx-light", not args.no_install)
    if args.upstream == "nginx" and not use_nginx:
        say("error: nginx is not available (apt-get install nginx-light)")
        return 2
    if not Path(args.artgw).exists() and not shutil.which(args.artgw):
        say(f"error: artgw not found at {args.artgw} (use --artgw)")
        return 2
    if args.baseline and not shutil.which("git"):
        say("error: --baseline needs git")
        return 2

    workdir = Path(tempfile.mkdtemp(prefix="artgw-bench-"))
    children = Children()

    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    try:
        return _bench(args, children, workdir, use_nginx)
    except KeyboardInterrupt:
        say("\ninterrupted: stopping child processes")
        return 130
    except RuntimeError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        children.stop_all()
        if args.keep:
            say(f"kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _check_answer(gateway: Gateway) -> None:
    """One call: the gateway must answer like the upstream, token fields hidden; with auth required, a call
    without a key must get 401 (so that the key is what lets the bench's calls through)."""
    status, data = http("POST", f"{gateway.url}/v1/chat/completions", CHAT_REQUEST, key=gateway.api_key)
    answer = json.loads(data) if status == 200 else {}
    if status != 200 or answer.get("model") != MODEL_NAME or answer.get("prompt_token_ids") is not None:
        raise RuntimeError(f"the {gateway.label}'s answer is wrong: {status} {data[:300]!r}")
    if gateway.auth == "required":
        status, data = http("POST", f"{gateway.url}/v1/chat/completions", CHAT_REQUEST)
        if status != 401:
            raise RuntimeError(f"the {gateway.label} answered a call without a key {status}, not 401: {data[:300]!r}")


def _through(
    children: Children, gateway: Gateway, connections: int, seconds: int, target: str, rollouts: str
) -> WrkResult:
    """One wrk run through a gateway (with its key, if it has one), with the gateway's CPU use over it."""
    cpu0 = gateway.cpu_seconds()
    rollout = f"bench-{target}-c{connections}"
    result = run_wrk(children, gateway.url, connections, seconds, rollout, target, gateway.api_key, rollouts)
    result.cpu_seconds = gateway.cpu_seconds() - cpu0
    result.cpu_pct = 100 * result.cpu_seconds / result.seconds
    result.loop_lag_ms = loop_lag_ms(gateway.url)
    return result


def loop_lag_ms(url: str) -> float | None:
    """The gateway's `artgw_event_loop_lag_max_seconds` (the last 10 s), in ms; None if it has no such gauge."""
    status, data = http("GET", f"{url}/metrics")
    for line in data.decode(errors="replace").splitlines() if status == 200 else ():
        if line.startswith("artgw_event_loop_lag_max_seconds "):
            return 1000 * float(line.split()[1])
    return None


def _account(
    who: str,
    calls_made: int,
    runs: list[WrkResult],
    upstream_calls: Counter[str],
    counts: tuple[int, Counter[str], int],
    stopped: str,
) -> tuple[bool, str]:
    """Print the record accounting of one gateway; returns (no record lost, detail)."""
    records, by_status, spilled = counts
    served = sum(upstream_calls.values())
    lost = calls_made - records
    non2xx = sum(r.non2xx for r in runs)
    socket_errors = sum(sum(r.error_counts) for r in runs)
    say(
        f"calls made through the {who}: {calls_made:,} (wrk-completed responses, warmup and 1 check call "
        f"included; non-2xx {non2xx}, socket errors/timeouts {socket_errors})"
    )
    say(
        f"upstream chat calls via the {who}: {served:,} {dict(upstream_calls)} "
        f"(includes calls still in flight when wrk stopped)"
    )
    say(f"records written (calls table): {records:,} {dict(by_status)}; spilled: {spilled}; {who} {stopped}")
    say(
        f"lost = calls - records = {lost:,}"
        + (" (< 0: in-flight calls at wrk's stop were recorded too)" if lost < 0 else "")
    )
    # Every call the upstream answered 200 must have its record: `ok`, or `cancelled` for a call still in flight
    # when wrk stopped and closed its connections (the gateway then records the hang-up, never `ok`); and every
    # call wrk got an answer for must be among the `ok` ones.
    served_ok, records_ok = upstream_calls.get("200", 0), by_status.get("ok/200", 0)
    hung_up = by_status.get("cancelled/499", 0)
    unrecorded = max(0, served_ok - records_ok - hung_up)
    say(
        f"upstream 200s without a record: {unrecorded:,} ({served_ok:,} served, {records_ok:,} ok records, "
        f"{hung_up:,} cancelled by wrk's stop)"
    )
    no_loss = records >= calls_made and records_ok >= calls_made and unrecorded == 0 and spilled == 0
    return no_loss, f"{records:,} records, {calls_made:,} calls made, {served:,} served upstream, {spilled} spilled"


def _keyed(gateway: Gateway, records: int) -> tuple[bool, str]:
    """Print how many of a gateway's records carry its client key's id (none, for a gateway called without a
    key); returns (as expected, detail)."""
    by_key = key_id_counts(gateway.data_dir)
    others = {k: n for k, n in by_key.items() if k is not None and k != gateway.key_id}
    if gateway.key_id is not None:
        carried = by_key.get(gateway.key_id, 0)
        detail = f"{carried:,} of {records:,} records carry key id {gateway.key_id}"
        ok = records > 0 and carried == records
    else:
        carried = sum(n for k, n in by_key.items() if k is not None)
        detail = f"{carried:,} of {records:,} records carry a key id"
        ok = carried == 0
    extra = f"; without a key id: {by_key.get(None, 0):,}" + (f"; other key ids: {others}" if others else "")
    say(f"key ids (calls.key_id): {detail}{extra}")
    return ok, detail


def tail_table(pairs: list[tuple[WrkResult, WrkResult]]) -> str:
    """The added latency at the tail (a gateway's percentile minus the direct run's) and the gateway's longest
    event-loop lag over the run's last 10 s, per target and concurrency."""
    headers = ["target", "conc", "added p50 ms", "added p90 ms", "added p99 ms", "added p99.9 ms", "loop lag max ms"]
    rows = [
        [
            g.target,
            str(d.connections),
            f"{g.p50_ms - d.p50_ms:+.3f}",
            f"{g.p90_ms - d.p90_ms:+.3f}",
            f"{g.p99_ms - d.p99_ms:+.3f}",
            f"{g.p999_ms - d.p999_ms:+.3f}",
            f"{g.loop_lag_ms:.1f}" if g.loop_lag_ms is not None else "-",
        ]
        for d, g in pairs
    ]
    return table(headers, rows)


def _compare_table(runs: list[tuple[WrkResult, WrkResult, WrkResult]], cmp: Comparison) -> str:
    """(direct, old slot, new slot) per concurrency, side by side."""
    old, new = cmp.old, cmp.new
    headers = ["conc", f"{old} req/s", f"{new} req/s", f"{new}/{old} req/s", f"{old} p50 ms", f"{new} p50 ms"]
    headers += [f"{new}/{old} p50", f"{old} added p50 ms", f"{new} added p50 ms", f"{old} added p99 ms"]
    headers += [f"{new} added p99 ms", f"CPU {old} / {new}", f"CPU ms a call {old} / {new}"]
    rows = [
        [
            str(d.connections),
            f"{b.rps:,.0f}",
            f"{g.rps:,.0f}",
            f"{g.rps / b.rps:.1%}" if b.rps else "-",
            f"{b.p50_ms:.3f}",
            f"{g.p50_ms:.3f}",
            f"{g.p50_ms / b.p50_ms:.1%}" if b.p50_ms else "-",
            f"{b.p50_ms - d.p50_ms:+.3f}",
            f"{g.p50_ms - d.p50_ms:+.3f}",
            f"{b.p99_ms - d.p99_ms:+.3f}",
            f"{g.p99_ms - d.p99_ms:+.3f}",
            f"{b.cpu_pct:.0f}% / {g.cpu_pct:.0f}%",
            f"{_ms(b.cpu_ms_per_call)} / {_ms(g.cpu_ms_per_call)}",
        ]
        for d, b, g in runs
    ]
    return table(headers, rows)


def _ms(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def _compare_verdict(runs: list[tuple[WrkResult, WrkResult, WrkResult]], cmp: Comparison) -> tuple[bool, list[str]]:
    """Does the new slot hold up against the old one? (verdict, one line per criterion)."""
    old, new = cmp.old, cmp.new
    ratios = [(d.connections, g.rps / b.rps if b.rps else 0.0) for d, b, g in runs]
    rps_ok = all(r >= cmp.min_rps_ratio for _, r in ratios)
    lines = [
        f"{verdict(rps_ok)}  {new} req/s >= {cmp.min_rps_ratio:.0%} of {old}'s at every "
        f"concurrency: {', '.join(f'{r:.1%} at {c}' for c, r in ratios)}"
    ]
    p50_name = f"{new} p50 <= {old} p50 + {cmp.p50_slack_ms:.2f} ms at concurrency 1"
    at_one = [(b, g) for d, b, g in runs if d.connections == 1]
    p50_ok: bool | None = None
    if at_one:
        b, g = at_one[0]
        p50_ok = g.p50_ms <= b.p50_ms + cmp.p50_slack_ms
        diff = g.p50_ms - b.p50_ms
        lines.append(f"{verdict(p50_ok)}  {p50_name}: {g.p50_ms:.3f} vs {b.p50_ms:.3f} ms ({diff:+.3f})")
    else:
        lines.append(f"{verdict(None)}  {p50_name}: concurrency 1 not run")
    # A gateway that answers errors fast would look quick: the compared runs must be clean.
    clean = all(g.non2xx == 0 and not any(g.error_counts) for _, _, g in runs)
    lines.append(f"{verdict(clean)}  {new} gateway: no non-2xx, socket errors or timeouts in the compared runs")
    if any(b.non2xx or any(b.error_counts) for _, b, _ in runs):
        lines.append(f"note  the {old} gateway had non-2xx or socket errors (see the runs table)")
    return rps_ok and p50_ok is not False and clean, lines


def _bench(args: argparse.Namespace, children: Children, workdir: Path, use_nginx: bool) -> int:
    started_at = dt.datetime.now().astimezone()
    say(f"machine:  {machine()}; load average {os.getloadavg()[0]:.2f}")
    say(f"tools:    {tool_versions()}")
    cmp = BASELINE if args.baseline else AUTH if args.auth_compare else None
    baseline_tree, baseline_rev, python = None, "", artgw_python(args.artgw)
    if args.baseline:
        baseline_tree = workdir / "baseline"
        baseline_rev = export_tree(args.baseline, baseline_tree)
        say(f"baseline: {args.baseline} = {baseline_rev}, exported to {baseline_tree} (git archive | tar -x)")
        say(f"baseline: {check_tree_imports(python, baseline_tree)}")
    n = 1 if cmp is None else 2  # gateways behind the upstream, each on its own port
    upstream: NginxUpstream | PythonUpstream = (
        NginxUpstream(children, workdir, gateways=n) if use_nginx else PythonUpstream(children, workdir, n)
    )
    upstream.start()
    direct_url = f"http://127.0.0.1:{upstream.direct_port}"
    if not use_nginx and args.upstream == "auto":
        say("upstream: nginx is not available: falling back to the Python stub (much slower than nginx)")
    # The new slot (the current tree: the gateway; auth on) and, with a comparison, the old one (baseline; auth off).
    gateway = Gateway(
        children,
        args.artgw,
        upstream.gateway_port,
        workdir,
        name=cmp.new_name if cmp else "gateway",
        auth="required" if args.auth_compare else None,
        workers=args.workers,
    )
    baseline: Gateway | None = None
    if baseline_tree is not None:
        baseline = Gateway(children, args.artgw, upstream.gateway_ports[1], workdir, "baseline", baseline_tree, python)
    elif args.auth_compare:
        baseline = Gateway(children, args.artgw, upstream.gateway_ports[1], workdir, AUTH.old_name, auth="off")
    behind = f":{upstream.gateway_port} (behind the {gateway.label})"
    if baseline is not None:
        behind += f", :{upstream.gateway_ports[1]} (behind the {baseline.label})"
    say(f"upstream: {upstream.kind} at {direct_url} (direct), {behind}")
    gateway.start()
    if baseline is not None:
        baseline.start()

    # One call each way: the gateway must answer like the upstream, token fields hidden.
    _check_answer(gateway)
    calls_made = base_calls_made = 1
    if baseline is not None:
        _check_answer(baseline)
    if http("POST", f"{direct_url}/v1/chat/completions", CHAT_REQUEST)[0] != 200:
        raise RuntimeError("the upstream does not answer chat completions")

    before = _proc_times()
    measure_started = time.monotonic()
    warm = base_warm = None
    if args.warmup:
        if baseline is not None:
            say(f"warmup:   {args.warmup}s through the {baseline.label} at 32 connections")
            base_warm = run_wrk(
                children, baseline.url, 32, args.warmup, "bench-warmup", baseline.name, baseline.api_key
            )
            base_calls_made += base_warm.requests
            time.sleep(args.pause)
        say(f"warmup:   {args.warmup}s through the {gateway.label} at 32 connections")
        warm = run_wrk(children, gateway.url, 32, args.warmup, "bench-warmup", gateway.name, gateway.api_key)
        calls_made += warm.requests
        time.sleep(args.pause)

    # Per concurrency: direct, [old slot,] new slot, one after the other, so machine noise hits all alike.
    results: list[tuple[WrkResult, WrkResult]] = []
    base_results: list[WrkResult] = []
    for c in args.concurrency:
        direct = run_wrk(children, direct_url, c, args.duration, f"bench-direct-c{c}", "direct")
        progress(direct)
        time.sleep(args.pause)
        # With a comparison: --rounds pairs of runs, the order swapped every round (the second gateway of a pair
        # tends to come out ahead on this VM), pooled into one result each.
        olds: list[WrkResult] = []
        vias: list[WrkResult] = []
        for k in range(args.rounds if baseline is not None else 1):
            pair = [(baseline, olds), (gateway, vias)]
            for gw, into in pair if k % 2 == 0 else pair[::-1]:
                if gw is None:
                    continue
                run = _through(children, gw, c, args.duration, gw.name, args.rollouts)
                progress(run)
                into.append(run)
                time.sleep(args.pause)
        if baseline is not None:
            old = _pooled(olds)
            base_calls_made += old.requests
            base_results.append(old)
        via = _pooled(vias)
        calls_made += via.requests
        results.append((direct, via))
    busy = other_load(before, time.monotonic() - measure_started, children.sessions())

    stopped = gateway.stop()
    counts = store_counts(gateway.data_dir)
    base_stopped = baseline.stop() if baseline is not None else ""
    base_counts = store_counts(baseline.data_dir) if baseline is not None else (0, Counter(), 0)
    upstream.stop()

    # ------------------------------------------------------------ report
    say()
    say(
        f"## Gateway overhead — {started_at:%Y-%m-%d %H:%M %Z}, {machine()}, "
        f"{args.duration}s per run, wrk -t1, upstream: {upstream.kind}, rollout ids: {args.rollouts}"
    )
    say()
    if args.auth_compare:
        say(f"gateway = the {gateway.label} (--auth required, one client key); auth off is compared below")
        say()
    headers = ["conc", "direct req/s", "gateway req/s", "ratio", "direct p50/p99 ms"]
    headers += ["gateway p50/p99 ms", "added p50 ms", "gateway CPU", "CPU ms a call"]
    rows = [
        [
            str(d.connections),
            f"{d.rps:,.0f}",
            f"{g.rps:,.0f}",
            f"{g.rps / d.rps:.1%}" if d.rps else "-",
            f"{d.p50_ms:.3f} / {d.p99_ms:.3f}",
            f"{g.p50_ms:.3f} / {g.p99_ms:.3f}",
            f"{g.p50_ms - d.p50_ms:+.3f}",
            f"{g.cpu_pct:.0f}%",
            _ms(g.cpu_ms_per_call),
        ]
        for d, g in results
    ]
    say(table(headers, rows))
    say()
    say(tail_table([(d, g) for d, g in results] + [(d, b) for (d, _), b in zip(results, base_results, strict=False)]))
    say()
    # (direct, old slot, new slot) per concurrency; empty without a comparison.
    compared = [(d, b, g) for (d, g), b in zip(results, base_results, strict=False)]
    runs: list[tuple[WrkResult, ...]] = [*compared] if compared else [*results]
    err_rows = [
        [f"{r.target} c={r.connections}", f"{r.requests:,}", str(r.non2xx), *map(str, r.error_counts)]
        for run in runs
        for r in run
    ]
    say(table(["run", "responses", "non-2xx", "connect", "read", "write", "timeout"], err_rows))
    say()

    each_way = f"{args.rounds} run{'s' if args.rounds > 1 else ''} each way"
    if cmp is not None and compared:
        if args.baseline:
            short = baseline_rev.split()[0]
            named = "" if short.startswith(args.baseline) or args.baseline.startswith(short) else f" ({args.baseline})"
            say(f"### Baseline {short}{named} vs the current tree")
        else:
            say(f"### Auth off (no key) vs auth on (one client key, {gateway.key_id}), both the current tree")
        say()
        say(_compare_table(compared, cmp))
        say()
        say(
            f"per gateway and concurrency {each_way} after the direct run, the order swapped every round, the "
            f"same pause between runs, pooled (req/s over all runs, median p50): a single comparison, not a "
            f"statistic; added p50 = p50 - direct p50 of the same concurrency"
        )
        say()
        say(f"{gateway.label if args.auth_compare else 'current gateway'}:")

    no_loss, loss_detail = _account(
        gateway.label,
        calls_made,
        [g for _, g in results] + ([warm] if warm else []),
        upstream.gateway_calls(),
        counts,
        stopped,
    )
    keyed: list[tuple[bool, str]] = []
    if args.auth_compare:
        keyed.append(_keyed(gateway, counts[0]))
    base_no_loss, base_loss_detail = None, ""
    if baseline is not None:
        say()
        say(f"{baseline.label} ({baseline_rev.split()[0] if args.baseline else 'no key sent'}):")
        base_no_loss, base_loss_detail = _account(
            baseline.label,
            base_calls_made,
            base_results + ([base_warm] if base_warm else []),
            upstream.gateway_calls(baseline.upstream_port),
            base_counts,
            base_stopped,
        )
        if args.auth_compare:
            keyed.append(_keyed(baseline, base_counts[0]))
    if busy:
        say(f"note: other processes used CPU during the runs: {', '.join(busy[:6])}")
    say()

    by_c = {d.connections: (d, g) for d, g in results}
    checks: list[tuple[str, bool | None, str]] = []
    if 1 in by_c:
        d, g = by_c[1]
        added = g.p50_ms - d.p50_ms
        checks.append(("added p50 < 1 ms at concurrency 1", added < 1.0, f"{added:.3f} ms"))
    else:
        checks.append(("added p50 < 1 ms at concurrency 1", None, "concurrency 1 not run"))
    if 256 in by_c:
        d, g = by_c[256]
        ratio = g.rps / d.rps if d.rps else 0.0
        checks.append(("gateway req/s >= 70% of direct at 256", ratio >= 0.7, f"{ratio:.1%}"))
    else:
        checks.append(("gateway req/s >= 70% of direct at 256", None, "concurrency 256 not run"))
    mid = [(c, g.rps) for c, (_, g) in sorted(by_c.items()) if 32 <= c <= 256]
    if mid:
        detail = ", ".join(f"{rps:,.0f} at {c}" for c, rps in mid)
        checks.append(("gateway >= 2,000 req/s at 32-256 (DESIGN)", all(r >= 2000 for _, r in mid), detail))
    else:
        checks.append(("gateway >= 2,000 req/s at 32-256 (DESIGN)", None, "no concurrency in 32-256 run"))
    checks.append(
        ("zero records lost" + ("" if gateway.name == "gateway" else f" ({gateway.label})"), no_loss, loss_detail)
    )
    if baseline is not None:
        checks.append((f"zero records lost ({baseline.label})", base_no_loss, base_loss_detail))
    if keyed:
        (on_ok, on_detail), (off_ok, off_detail) = keyed
        checks.append(("every auth-on record carries the key id", on_ok, on_detail))
        checks.append(("no auth-off record carries a key id", off_ok, off_detail))
    say("targets:" + (f" (gateway = the {gateway.label})" if args.auth_compare else ""))
    for name, ok, detail in checks:
        say(f"  {verdict(ok)}  {name}: {detail}")
    if cmp is not None and compared:
        ok, lines = _compare_verdict(compared, cmp)
        say()
        say(f"{cmp.verdict}: {verdict(ok)}")
        for line in lines:
            say(f"  {line}")
        say(f"  ({each_way}, not a statistic: re-run with --rounds 3+ before trusting a verdict near the tolerances)")
    for gw in (gateway, baseline):
        if gw is not None and not gw.stopped_cleanly:
            say(f"\n{gw.label} log tail:\n{gw.log_tail()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
