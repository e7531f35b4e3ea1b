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
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
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


def say(msg: str = "") -> None:
    print(msg, flush=True)


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


def http(method: str, url: str, body: bytes | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        request.add_header("Content-Type", "application/json")
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
    """nginx with `return 200 '<json>'`: one server for direct runs, one (logging) behind the gateway."""

    kind = "nginx"

    def __init__(
        self, children: Children, workdir: Path, chat_body: bytes = CHAT_BODY, chat_type: str = "application/json"
    ) -> None:
        self.children = children
        self.chat_body, self.chat_type = chat_body, chat_type
        self.dir = workdir / "nginx"
        self.dir.mkdir()
        self.direct_port, self.gateway_port = free_port(), free_port()
        self.calls_log = self.dir / "gateway_upstream_calls.log"
        self.proc: subprocess.Popen[Any] | None = None

    def _server(self, port: int, log_calls: bool) -> str:
        access = f"access_log {self.calls_log} calls buffer=64k flush=1s;" if log_calls else ""
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
{self._server(self.direct_port, False)}
{self._server(self.gateway_port, True)}
}}
"""
        )
        self.proc = self.children.start(
            ["nginx", "-e", str(d / "error.log"), "-p", str(d), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=(d / "stderr.log").open("wb"),
        )
        for port in (self.direct_port, self.gateway_port):
            wait_http_ok(f"http://127.0.0.1:{port}/health", self.proc, 10, "nginx")

    def stop(self) -> None:
        if self.proc is not None:
            Children.stop(self.proc, signal.SIGQUIT)  # graceful: flushes the buffered access log

    def gateway_calls(self) -> Counter[str]:
        """Chat calls the upstream behind the gateway answered, by HTTP status (after stop())."""
        if not self.calls_log.exists():
            return Counter()
        return Counter(line.strip() for line in self.calls_log.read_text().splitlines() if line.strip())


class PythonUpstream:
    """Fallback: bench/fixed_upstream.py (raw ASGI under uvicorn), one instance per role."""

    kind = "Python stub (bench/fixed_upstream.py: raw ASGI + uvicorn)"

    def __init__(self, children: Children, workdir: Path) -> None:
        self.children = children
        self.dir = workdir
        self.direct_port, self.gateway_port = free_port(), free_port()
        self.procs: list[subprocess.Popen[Any]] = []
        self._gateway_calls: Counter[str] = Counter()

    def start(self) -> None:
        for port in (self.direct_port, self.gateway_port):
            proc = self.children.start(
                [sys.executable, str(BENCH_DIR / "fixed_upstream.py"), "--port", str(port)],
                stdout=subprocess.DEVNULL,
                stderr=(self.dir / f"stub-{port}.log").open("wb"),
            )
            self.procs.append(proc)
            wait_http_ok(f"http://127.0.0.1:{port}/health", proc, 20, "python stub upstream")

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            _, data = http("GET", f"http://127.0.0.1:{self.gateway_port}/_stats")
            self._gateway_calls = Counter({"200": json.loads(data)["chat_calls"]})
        for proc in self.procs:
            Children.stop(proc)

    def gateway_calls(self) -> Counter[str]:
        return self._gateway_calls


# ---------------------------------------------------------------- the gateway


class Gateway:
    def __init__(self, children: Children, artgw: str, upstream_port: int, workdir: Path) -> None:
        self.children = children
        self.artgw = artgw
        self.upstream_port = upstream_port
        self.port = free_port()
        self.data_dir = workdir / "gateway-data"
        self.log = workdir / "gateway.log"
        self.proc: subprocess.Popen[Any] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            self.artgw,
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
        say(f"gateway:  {' '.join(cmd)}")
        self.proc = self.children.start(cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        try:
            wait_http_ok(f"{self.url}/readyz", self.proc, 60, "the gateway")
        except RuntimeError:
            say(self.log_tail())
            raise

    def log_tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def cpu_seconds(self) -> float:
        """User + system CPU time of the gateway process (all its threads)."""
        assert self.proc is not None
        try:
            rest = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")

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

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def error_counts(self) -> tuple[int, int, int, int]:
        return self.connect, self.read, self.write, self.timeout


def progress(r: WrkResult) -> None:
    cpu = f"  (gateway CPU {r.cpu_pct:.0f}%)" if r.cpu_pct is not None else ""
    say(f"  c={r.connections:<4} {r.target:8} {r.rps:>9,.0f} req/s  p50 {r.p50_ms:.3f} ms  p99 {r.p99_ms:.3f} ms{cpu}")


def run_wrk(children: Children, url: str, connections: int, seconds: int, rollout_id: str, target: str) -> WrkResult:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s", "--latency"]
    cmd += ["-s", str(WRK_SCRIPT), url]
    proc = children.start(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "BENCH_ROLLOUT_ID": rollout_id},
        text=True,
    )
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
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (store, logs, configs)")
    parser.add_argument(
        "--pause", type=float, default=1.0, help="seconds of idle between runs (the recorder catches up)"
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


def _bench(args: argparse.Namespace, children: Children, workdir: Path, use_nginx: bool) -> int:
    started_at = dt.datetime.now().astimezone()
    say(f"machine:  {machine()}; load average {os.getloadavg()[0]:.2f}")
    say(f"tools:    {tool_versions()}")
    upstream: NginxUpstream | PythonUpstream = (
        NginxUpstream(children, workdir) if use_nginx else PythonUpstream(children, workdir)
    )
    upstream.start()
    direct_url = f"http://127.0.0.1:{upstream.direct_port}"
    if not use_nginx and args.upstream == "auto":
        say("upstream: nginx is not available: falling back to the Python stub (much slower than nginx)")
    say(f"upstream: {upstream.kind} at {direct_url} (direct), :{upstream.gateway_port} (behind the gateway)")
    gateway = Gateway(children, args.artgw, upstream.gateway_port, workdir)
    gateway.start()

    # One call each way: the gateway must answer like the upstream, token fields hidden.
    calls_made = 0
    status, data = http("POST", f"{gateway.url}/v1/chat/completions", CHAT_REQUEST)
    calls_made += 1
    answer = json.loads(data) if status == 200 else {}
    if status != 200 or answer.get("model") != MODEL_NAME or answer.get("prompt_token_ids") is not None:
        raise RuntimeError(f"the gateway's answer is wrong: {status} {data[:300]!r}")
    if http("POST", f"{direct_url}/v1/chat/completions", CHAT_REQUEST)[0] != 200:
        raise RuntimeError("the upstream does not answer chat completions")

    before = _proc_times()
    measure_started = time.monotonic()
    warm = None
    if args.warmup:
        say(f"warmup:   {args.warmup}s through the gateway at 32 connections")
        warm = run_wrk(children, gateway.url, 32, args.warmup, "bench-warmup", "gateway")
        calls_made += warm.requests
        time.sleep(args.pause)

    results: list[tuple[WrkResult, WrkResult]] = []
    for c in args.concurrency:
        direct = run_wrk(children, direct_url, c, args.duration, f"bench-direct-c{c}", "direct")
        progress(direct)
        time.sleep(args.pause)
        cpu0 = gateway.cpu_seconds()
        via = run_wrk(children, gateway.url, c, args.duration, f"bench-gateway-c{c}", "gateway")
        via.cpu_pct = 100 * (gateway.cpu_seconds() - cpu0) / via.seconds
        calls_made += via.requests
        progress(via)
        results.append((direct, via))
        time.sleep(args.pause)
    busy = other_load(before, time.monotonic() - measure_started, children.sessions())

    stopped = gateway.stop()
    records, by_status, spilled = store_counts(gateway.data_dir)
    upstream.stop()
    upstream_calls = upstream.gateway_calls()

    # ------------------------------------------------------------ report
    say()
    say(
        f"## Gateway overhead — {started_at:%Y-%m-%d %H:%M %Z}, {machine()}, "
        f"{args.duration}s per run, wrk -t1, upstream: {upstream.kind}"
    )
    say()
    headers = ["conc", "direct req/s", "gateway req/s", "ratio", "direct p50/p99 ms"]
    headers += ["gateway p50/p99 ms", "added p50 ms", "gateway CPU"]
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
        ]
        for d, g in results
    ]
    say(table(headers, rows))
    say()
    err_rows = [
        [f"{r.target} c={r.connections}", f"{r.requests:,}", str(r.non2xx), *map(str, r.error_counts)]
        for pair in results
        for r in pair
    ]
    say(table(["run", "responses", "non-2xx", "connect", "read", "write", "timeout"], err_rows))
    say()

    served = sum(upstream_calls.values())
    lost = calls_made - records
    non2xx = sum(g.non2xx for _, g in results) + (warm.non2xx if warm else 0)
    socket_errors = sum(sum(g.error_counts) for _, g in results) + (sum(warm.error_counts) if warm else 0)
    say(
        f"calls made through the gateway: {calls_made:,} (wrk-completed responses, warmup and 1 check call "
        f"included; non-2xx {non2xx}, socket errors/timeouts {socket_errors})"
    )
    say(
        f"upstream chat calls via the gateway: {served:,} {dict(upstream_calls)} "
        f"(includes calls still in flight when wrk stopped)"
    )
    say(f"records written (calls table): {records:,} {dict(by_status)}; spilled: {spilled}; gateway {stopped}")
    say(
        f"lost = calls - records = {lost:,}"
        + (" (< 0: in-flight calls at wrk's stop were recorded too)" if lost < 0 else "")
    )
    # Every call the upstream answered 200 must have its `ok` record (a stricter check than
    # calls - records, which the calls still in flight when wrk stopped push below zero).
    served_ok, records_ok = upstream_calls.get("200", 0), by_status.get("ok/200", 0)
    unrecorded = max(0, served_ok - records_ok)
    say(f"upstream 200s without an ok record: {unrecorded:,} ({served_ok:,} served, {records_ok:,} ok records)")
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
    no_loss = records >= calls_made and unrecorded == 0 and spilled == 0
    checks.append(
        (
            "zero records lost",
            no_loss,
            f"{records:,} records, {calls_made:,} calls made, {served:,} served upstream, {spilled} spilled",
        )
    )
    say("targets:")
    for name, ok, detail in checks:
        say(f"  {verdict(ok)}  {name}: {detail}")
    if not gateway.stopped_cleanly:
        say(f"\ngateway log tail:\n{gateway.log_tail()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
