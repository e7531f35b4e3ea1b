"""A dead engine, with real vLLM under `artgw serve --base-model`: its API server is SIGKILLed, then its engine core.

Each time: calls in flight (streamed and not) end with a clean OpenAI-shaped error and are recorded
`upstream_error`; every process of the old engine is gone before the new one starts (none is left orphaned under
PID 1, holding memory and CPU). After the first the gateway becomes ready again and serves; after the second it is
stopped while its new engine starts, which ends that engine as whole.

The engine runs in the supervisor's CPU layout (an API server and an engine core; vLLM's multiprocess layout, with a
worker beside the core, took three starts of ~30 s of CPU each and busy-waited between them). The release of the
shared memory that layout's ring buffers leave is proven without vLLM (tests/unit/test_engine_ownership.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from artgw.tiny_model import TinyModelSpec, build_tiny_model
from engine.supervisor import ENGINE_TAG_VAR, shared_memory_of
from engine.vllm_server import FORKED, SPAWNED
from tests.conftest import GatewayProcess, free_port, is_vllm_server, metric, poll, wait_http

pytestmark = pytest.mark.engine

# Tokens each call asks for (ignore_eos: no early stop). The tiny model makes ~1,000 a second here, so 4,000 once
# ended before the test saw both calls running (CI, 2026-11-24); 60,000 take a minute, the kill comes in seconds.
LONG = 60_000
MAX_MODEL_LEN = 65_536  # the engine's context, and the long tiny model's positions


@dataclass
class EngineTree:
    """The supervised engine as it runs: its API server, every descendant, and their environment tag."""

    server: psutil.Process
    processes: list[psutil.Process]
    tag: str

    def describe(self) -> str:
        rows = []
        for proc in self.processes:
            try:
                pid, ppid = proc.pid, proc.ppid()
                rows.append(f"  pid {pid} ppid {ppid} pgid {os.getpgid(pid)} sid {os.getsid(pid)} {proc.name()!r}")
            except (psutil.Error, OSError):
                rows.append(f"  pid {proc.pid} (gone)")
        return "\n".join(rows)

    def core(self) -> psutil.Process:
        (core,) = [p for p in self.processes if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]
        return core


def engine_tree(engine_port: int) -> EngineTree | None:
    """The engine listening on `engine_port`, or None while there is none (or it is still spawning children)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if is_vllm_server(cmdline) and f"--port {engine_port}" in cmdline:
            try:
                return EngineTree(proc, [proc, *proc.children(recursive=True)], proc.environ()[ENGINE_TAG_VAR])
            except psutil.Error:
                return None
    return None


def live(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def tagged(tag: str) -> list[psutil.Process]:
    """Every live process of this user that carries the engine tag `tag`, wherever it was reparented."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(ENGINE_TAG_VAR) == tag and live(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@dataclass
class InFlight:
    """A long call running in a thread: what the client got back."""

    gateway: GatewayProcess
    rollout_id: str
    stream: bool
    status: int | None = None
    body: Any = None  # the JSON error body (non-streamed), or the list of SSE data payloads (streamed)
    failure: BaseException | None = None
    first_event: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        request = {
            "model": "my-agent",
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": LONG,
            "ignore_eos": True,
            "stream": self.stream,
        }
        headers = {"X-ART-Rollout-Id": self.rollout_id}
        url = f"{self.gateway.base_url}/chat/completions"
        try:
            if not self.stream:
                r = httpx.post(url, json=request, headers=headers, timeout=300)
                self.status, self.body = r.status_code, r.json()
                return
            with httpx.stream("POST", url, json=request, headers=headers, timeout=300) as r:
                self.status, self.body = r.status_code, []
                if r.status_code != 200:  # refused before any event: its error body says why
                    self.body = [r.read().decode(errors="replace")]
                    return
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.body.append(line[6:])
                        self.first_event.set()
        except BaseException as exc:  # the test asserts there was none: an unclean end (reset, cut stream)
            self.failure = exc
        finally:
            self.first_event.set()

    def join(self) -> None:
        assert self.thread is not None
        self.thread.join(120)
        assert not self.thread.is_alive(), f"the {'streamed' if self.stream else 'plain'} call never ended"


def assert_clean_error(call: InFlight) -> None:
    assert call.failure is None, f"the client saw an unclean end: {call.failure!r}"
    if call.stream:
        assert call.status == 200, call.body
        events = call.body
        assert events[-1] == "[DONE]" or events[-1].startswith("{"), events[-3:]
        errors = [json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e)]
        assert errors, f"the stream ended without an error event: {events[-3:]}"
        error = errors[-1]["error"]
    else:
        assert call.status in (502, 503), (call.status, call.body)
        error = call.body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] in ("upstream_error", "upstream_unreachable", "engine_unavailable"), error


def readiness(gateway: GatewayProcess) -> tuple[int, str]:
    r = httpx.get(f"{gateway.url}/readyz", timeout=10)
    return r.status_code, r.json()["engine"]


def recorded_status(gateway: GatewayProcess, rollout_id: str) -> str | None:
    r = httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", timeout=10, headers=gateway.admin)
    if r.status_code != 200:
        return None
    calls = r.json()["calls"]
    return calls[0]["status"] if calls else None


def unanswered(call: InFlight) -> bool:
    """The call's connection closed before any answer (no status line)."""
    return call.status is None and isinstance(call.failure, httpx.RemoteProtocolError)


def generating_calls(gateway: GatewayProcess, engine_url: str, victim: str, running_before: float) -> list[InFlight]:
    """A streamed and a plain call, both generating and both with at least half their tokens still to come, so
    that the kill lands mid-generation however fast the machine is (a slow scrape of the engine's metrics once
    let the stream reach its last token first). Calls that got too far are left to end, and a new pair starts."""
    for attempt in range(3):
        run = uuid.uuid4().hex[:8]
        calls = [
            InFlight(gateway, f"restart-{victim}-{run}-stream", True),
            InFlight(gateway, f"restart-{victim}-{run}", False),
        ]
        for call in calls:
            call.start()
        calls[0].first_event.wait(300)

        def both_generating(calls: list[InFlight] = calls) -> bool | str:
            ended = [c for c in calls if c.thread is not None and not c.thread.is_alive()]
            if ended and all(unanswered(c) for c in ended):
                return "unanswered"
            if ended:  # before the kill: the gateway's log says why
                ends = [(c.rollout_id, c.status, str(c.body)[-300:], repr(c.failure)) for c in ended]
                raise AssertionError(f"a call ended before the kill: {ends}\n{gateway.log()[-6000:]}")
            return metric(engine_url, "vllm:num_requests_running") >= running_before + 2

        # Bounded generously: a fresh clone's run under load once took longer than 60 s to get both going.
        if poll(both_generating, 300, "both calls to be generating", alive=[gateway.proc]) == "unanswered":
            # Seen once in a fresh-clone run, on a loaded machine, for a call sent after a restart: the connection
            # closed with no answer at all. Not what this test is about (the kill is): a new pair, and it is printed.
            print(f"attempt {attempt}: a call got no answer at all; starting a new pair\n{gateway.log()[-2000:]}")
            for call in calls:
                call.join()
            continue
        streamed = len(calls[0].body or [])  # one event a token
        if streamed < LONG // 2:
            print(f"the stream had {streamed} of {LONG} tokens when both calls were generating")
            return calls
        print(f"attempt {attempt}: the stream already had {streamed} of {LONG} tokens; starting a new pair")
        for call in calls:
            call.join()
    raise AssertionError(f"three pairs of calls got past {LONG // 2} tokens before the kill could be sent")


def crash_and_recover(
    gateway: GatewayProcess, engine_port: int, victim: str, *, until_ready: bool = True
) -> EngineTree:
    """Kill the engine's `victim`; the in-flight calls end cleanly and are recorded, and the supervisor ends the
    whole old tree before it spawns a new one. `until_ready`: then the gateway is ready again and serves. Returns the
    new engine's tree."""
    old = engine_tree(engine_port)
    assert old is not None, "no engine process found"
    print(f"\nthe engine's process tree before killing its {victim}:\n{old.describe()}")
    engine_url = f"http://127.0.0.1:{engine_port}"
    running_before = metric(engine_url, "vllm:num_requests_running")

    shared = set().union(*(shared_memory_of(p.pid) for p in old.processes))  # vLLM's ring buffers
    target = old.server if victim == "api-server" else old.core()
    calls = generating_calls(gateway, engine_url, victim, running_before)  # nothing slow between this and the kill
    killed_at = time.monotonic()
    target.send_signal(signal.SIGKILL)
    # While it restarts the engine, the gateway says so (vLLM takes far longer to start than this poll's bound).
    poll(lambda: readiness(gateway) == (503, "restarting"), 60, "the gateway to say its engine is restarting")

    for call in calls:
        call.join()
        assert_clean_error(call)

    # The supervisor ends the whole old tree before it spawns the new server: once a new one runs, none is left.
    new = poll(
        lambda: (tree := engine_tree(engine_port)) is not None and tree.server.pid != old.server.pid and tree,
        120,
        "a new engine to be spawned",
        every=0.1,
        alive=[gateway.proc],
    )
    spawned_after = time.monotonic() - killed_at
    survivors = [p for p in old.processes if live(p)] + tagged(old.tag)
    assert not survivors, (
        "processes of the old engine outlived it:\n" + EngineTree(old.server, survivors, "").describe()
    )
    assert new.tag != old.tag
    assert not [path for path in shared if os.path.exists(path)], "the old engine's shared memory was left behind"
    for call in calls:
        status = poll(lambda c=call: recorded_status(gateway, c.rollout_id), 30, f"{call.rollout_id} to be recorded")
        assert status == "upstream_error", (call.rollout_id, status)
    if not until_ready:
        print(f"killed its {victim}: new engine spawned after {spawned_after:.1f}s")
        return new

    wait_http(f"{gateway.url}/readyz", 600, gateway.proc)
    ready_after = time.monotonic() - killed_at
    print(
        f"killed its {victim}: new engine spawned after {spawned_after:.1f}s, gateway ready after {ready_after:.1f}s; "
        f"{len(shared)} shared-memory files released"
    )
    assert not tagged(old.tag)

    r = httpx.post(
        f"{gateway.base_url}/chat/completions",
        json={"model": "my-agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return new


@pytest.fixture(scope="module")
def long_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with room for LONG tokens."""
    return build_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-long", TinyModelSpec(max_position_embeddings=MAX_MODEL_LEN)
    )


def test_a_killed_engine_is_ended_whole_and_restarted(long_tiny_model: Path, gateway_factory) -> None:
    engine_port = free_port()
    started = time.monotonic()
    gateway = gateway_factory(
        *("--base-model", str(long_tiny_model), "--engine-port", str(engine_port)),
        *("--max-model-len", str(MAX_MODEL_LEN)),
        wait=False,
    )
    wait_http(f"{gateway.url}/readyz", 600, gateway.proc)
    print(f"cold start: gateway ready after {time.monotonic() - started:.1f}s")

    crash_and_recover(gateway, engine_port, "api-server")
    # Both engine cores so far were forked from their API server (engine/vllm_server.py), not spawned afresh.
    engine_log = (gateway.data_dir / "engine.log").read_text()
    assert (engine_log.count(FORKED), engine_log.count(SPAWNED)) == (2, 0), engine_log[-3000:]
    # The second engine is not waited for (the first recovery showed a new engine serving): the gateway is stopped
    # while it starts, which must end it as whole as a running one.
    last = crash_and_recover(gateway, engine_port, "engine-core", until_ready=False)

    # On exit too, nothing of the engine is left.
    gateway.proc.send_signal(signal.SIGTERM)
    assert gateway.proc.wait(60) == 0
    poll(lambda: not tagged(last.tag), 60, "the engine's processes to be gone after the gateway's exit")
