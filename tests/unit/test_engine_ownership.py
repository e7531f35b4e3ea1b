"""The engine supervisor's port checks, without vLLM: a stand-in engine (tests/stub_engine.py) plays the other
process that holds, or answers on, the engine's port; plain sockets play the rest."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest

from engine.supervisor import (
    ENGINE_TAG_VAR,
    REQUEST_FAULT_MARK,
    EngineConfig,
    EngineConflict,
    EngineFailed,
    EngineSupervisor,
    EngineSupervisors,
    free_ports,
    port_in_use,
    port_owners,
    shared_memory_of,
    wait_until_ready,
)
from tests.conftest import ROOT, apoll, free_port, poll, stop_group, wait_http

STUB = str(ROOT / "tests" / "stub_engine.py")  # serves one model, `stub`


def start_stub(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, STUB, str(port)], start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 30, proc)
    except Exception:
        stop_group(proc)
        raise
    return proc


@pytest.fixture
def stranger() -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A stand-in engine that is not the supervised child: another gateway's engine, as far as we can tell."""
    port = free_port()
    proc = start_stub(port)
    yield port, proc
    stop_group(proc)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A supervised child that never listens (a vLLM still loading its weights)."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    stop_group(proc)


@dataclasses.dataclass(frozen=True)
class FakeEngine(EngineConfig):
    """The supervisor's config with another program in vLLM's place."""

    argv: tuple[str, ...] = ()

    def command(self) -> list[str]:
        return list(self.argv)


def escaped_child(tag: str, server: int) -> psutil.Process | None:
    """The engine's other tagged process, once it is in a session of its own (setsid), else None."""
    others = [p for p in tagged(tag) if p.pid != server]
    try:
        return others[0] if len(others) == 1 and os.getsid(others[0].pid) != os.getsid(server) else None
    except ProcessLookupError:
        return None


def closing_wait(local_port: int) -> bool:
    """The client socket on `local_port` got its peer's FIN (CLOSE_WAIT)."""
    return any(c.laddr.port == local_port and c.status == psutil.CONN_CLOSE_WAIT for c in psutil.net_connections("tcp"))


def test_port_in_use_tells_a_listener_from_harmless_leftovers() -> None:
    port = free_port()
    assert not port_in_use("127.0.0.1", port)
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        # Bound with SO_REUSEADDR but not listening yet, as vLLM holds its port while it loads: taken.
        assert port_in_use("127.0.0.1", port)
        listener.listen()
        assert port_in_use("127.0.0.1", port)
        # A connection the server side closes first leaves a TIME_WAIT on the port, as a killed engine does.
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()
        # The client closes only once the server's FIN reached it: the server side is the one left in TIME_WAIT.
        poll(lambda: closing_wait(client.getsockname()[1]), 60, "the server's FIN to reach the client")
        client.close()
    assert any(c.laddr.port == port and c.status == psutil.CONN_TIME_WAIT for c in psutil.net_connections("tcp"))
    assert not port_in_use("127.0.0.1", port)  # the restarted engine can bind it: no false clash


async def test_an_engine_that_is_not_our_child_is_refused(stranger, sleeper) -> None:
    port, proc = stranger
    assert port_owners("127.0.0.1", port, sleeper.pid).others == [proc.pid]
    with pytest.raises(EngineConflict) as failure:
        await wait_until_ready(f"http://127.0.0.1:{port}", 10, child_pid=sleeper.pid, served_name="tiny-b")
    message = str(failure.value)
    assert f"the engine on port {port} serves `stub`, not `tiny-b`: another process answers on that port" in message
    assert f"pid {proc.pid}: " in message and "stub_engine.py" in message
    assert f"not the vLLM this gateway started (pid {sleeper.pid})" in message


async def test_an_engine_that_is_not_our_child_is_refused_even_if_it_serves_our_model(stranger, sleeper) -> None:
    port, proc = stranger
    with pytest.raises(EngineConflict, match=f"another process answers on that port \\(pid {proc.pid}: "):
        await wait_until_ready(f"http://127.0.0.1:{port}", 10, child_pid=sleeper.pid, served_name="stub")


async def test_our_own_child_is_accepted_and_must_serve_the_expected_model(stranger) -> None:
    port, proc = stranger  # here it is the child itself
    await wait_until_ready(f"http://127.0.0.1:{port}", 10, child_pid=proc.pid, served_name="stub")
    with pytest.raises(EngineFailed, match=f"the engine on port {port} serves `stub`, not `tiny`$"):
        await wait_until_ready(f"http://127.0.0.1:{port}", 10, child_pid=proc.pid, served_name="tiny")


async def test_upstream_mode_checks_health_only(stranger) -> None:
    port, _ = stranger  # `--upstream`: the engine is not ours, and its base model is discovered later
    await wait_until_ready(f"http://127.0.0.1:{port}", 10)


async def test_supervisor_refuses_a_taken_port_before_spawning(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = FakeEngine(
            base_model="unused", served_name="stub", port=port, log_path=tmp_path / "engine.log", argv=("true",)
        )
        supervisor = EngineSupervisor(config, on_fatal=pytest.fail)
        with pytest.raises(EngineConflict) as failure:
            await supervisor.start()
    assert str(failure.value) == (
        f"engine port {port} on 127.0.0.1 is already in use (another vLLM or gateway?): "
        "pass another --engine-port, or 0 for a free one"
    )
    assert supervisor.process is None  # refused before anything was spawned


async def test_supervisor_accepts_its_own_child(tmp_path: Path) -> None:
    port = free_port()
    config = FakeEngine(
        base_model="unused",
        served_name="stub",
        port=port,
        log_path=tmp_path / "engine.log",
        startup_timeout=30,
        argv=(sys.executable, STUB, str(port)),
    )
    supervisor = EngineSupervisor(config, on_fatal=pytest.fail)
    await supervisor.start()
    try:
        assert supervisor.state == "ready"
        assert supervisor.process is not None
        assert port_owners("127.0.0.1", port, supervisor.process.pid).ours == [supervisor.process.pid]
    finally:
        await supervisor.stop()
    assert not port_in_use("127.0.0.1", port)


async def test_supervisor_refuses_a_stranger_that_takes_the_port_after_the_check(tmp_path: Path) -> None:
    """The race: the port is free when checked, then another process binds it before our child does."""
    port = free_port()
    # The child starts a stand-in engine that is NOT its descendant (double fork: it is orphaned at once),
    # then idles like a vLLM still loading.
    orphan = f"({sys.executable} {STUB} {port} >/dev/null 2>&1 &); exec sleep 60"
    config = FakeEngine(
        base_model="unused",
        served_name="tiny-b",
        port=port,
        log_path=tmp_path / "engine.log",
        startup_timeout=30,
        argv=("sh", "-c", orphan),
    )
    supervisor = EngineSupervisor(config, on_fatal=pytest.fail)
    try:
        with pytest.raises(EngineConflict, match=f"the engine on port {port} serves `stub`, not `tiny-b`: another"):
            await supervisor.start()
        assert supervisor.process is not None and supervisor.process.returncode is not None  # our child is stopped
    finally:
        await supervisor.stop()
        for c in psutil.net_connections("tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid is not None:
                psutil.Process(c.pid).kill()


# A stand-in API server for the restart tests: answers /v1/models (`stub`) and /health, which says 503 (vLLM's
# answer once its engine core is dead) while the flag file exists; a fresh start clears the flag.
HEALTH_SERVER = """
import http.server, json, os, sys
port, flag = int(sys.argv[1]), sys.argv[2]
if os.path.exists(flag):
    os.remove(flag)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code, body = 404, b""
        if self.path == "/health":
            code = 503 if os.path.exists(flag) else 200
        elif self.path == "/v1/models":
            code, body = 200, json.dumps({"data": [{"id": "stub"}]}).encode()
        self.send_response(code)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def tagged(tag: str) -> list[psutil.Process]:
    """Live processes carrying the engine tag `tag` in their environment."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(ENGINE_TAG_VAR) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


# The escaped child maps a shared-memory file, as vLLM's engine core and workers map their ring buffers (psm_*), and
# never unlinks it: a killed engine leaves them behind unless the supervisor does.
SHM_HOLDER = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
held = mmap.mmap(fd, 4096)
time.sleep(300)
"""


class Escaping(NamedTuple):
    config: FakeEngine
    flag: Path  # touched: /health answers 503 (the engine core dead behind a live server)
    shm_prefix: str  # the escaped child maps the file {shm_prefix}{server pid}


@pytest.fixture
def escaping_engine(tmp_path: Path) -> Iterator[Escaping]:
    """An engine like vLLM's tree, made harder: the API server has a child that left its process group and
    session (`setsid`), as an engine core could; only the environment tag still ties it to the engine. That child
    maps a file in /dev/shm of its own, named with a prefix of this test's: the tests that use it run on several
    workers at once, and each one's teardown removes only its own (a teardown that removed every `artgw-test-*`
    unlinked another test's file under it: a fresh clone's escaped child then mapped only "(deleted)")."""
    name = f"artgw-test-{uuid.uuid4().hex[:8]}-"
    shm_prefix = f"/dev/shm/{name}"
    port = free_port()
    script = tmp_path / "health_server.py"
    script.write_text(HEALTH_SERVER)
    holder = tmp_path / "shm_holder.py"
    holder.write_text(SHM_HOLDER)
    flag = tmp_path / "engine-core-dead"
    config = FakeEngine(
        base_model="unused",
        served_name="stub",
        port=port,
        log_path=tmp_path / "engine.log",
        startup_timeout=30,
        health_interval=0.1,
        crash_grace=1.0,
        stop_grace=2.0,
        # each start maps a shared-memory file of its own (the name is random, as vLLM's are)
        argv=(
            "sh",
            "-c",
            f'setsid {sys.executable} {holder} "{shm_prefix}$$" & exec {sys.executable} {script} {port} {flag}',
        ),
    )
    yield Escaping(config, flag, shm_prefix)
    for leftover in Path("/dev/shm").glob(f"{name}*"):  # a failed test's; the assertions say so first
        if leftover.stat().st_uid == os.getuid():
            leftover.unlink(missing_ok=True)


async def test_a_killed_server_is_ended_with_its_whole_tree_then_restarted(escaping_engine: Escaping) -> None:
    config = escaping_engine.config
    readied: list[float] = []

    async def on_ready() -> None:
        readied.append(time.monotonic())

    supervisor = EngineSupervisor(config, on_fatal=pytest.fail, on_ready=on_ready)
    await supervisor.start()
    try:
        assert supervisor.process is not None and supervisor.tag is not None
        server, tag = supervisor.process.pid, supervisor.tag
        # Until the child has escaped: `sh` forks it, and only then does it call setsid (a fresh-clone run once
        # found it forked but not yet escaped).
        escaped = await apoll(lambda: escaped_child(tag, server), 60, "the server's child to leave its session")
        assert os.getpgid(escaped.pid) != server

        shm = f"{escaping_engine.shm_prefix}{server}"  # `sh` execs the server: its pid is the shell's `$$`
        await apoll(lambda: shm in shared_memory_of(escaped.pid), 60, "the escaped child to map its shared memory")

        os.kill(server, signal.SIGKILL)  # the escaped child is reparented and lives on, until the supervisor acts
        await apoll(lambda: supervisor.tag != tag and supervisor.state == "ready", 30, "the restarted engine")
        assert supervisor.process.pid != server
        assert tagged(tag) == []  # the escaped child too (gone, or a zombie if PID 1 does not reap it)
        assert not await asyncio.to_thread(os.path.exists, shm), "the killed engine's shared memory was left behind"
        assert len(readied) == 2  # on_ready ran again: the serving adapters are reloaded
        new_tag = supervisor.tag
    finally:
        await supervisor.stop()
    assert tagged(new_tag) == []  # stop ends the escaped child too
    assert supervisor.state == "stopped"


async def test_a_dead_engine_core_behind_a_live_server_is_restarted(escaping_engine: Escaping) -> None:
    config, flag, _ = escaping_engine
    supervisor = EngineSupervisor(config, on_fatal=pytest.fail)
    await supervisor.start()
    try:
        assert supervisor.process is not None and supervisor.tag is not None
        server, tag = supervisor.process, supervisor.tag
        flag.touch()  # /health answers 503 from now on, while the server process lives
        await apoll(lambda: supervisor.tag != tag and supervisor.state == "ready", 30, "the restarted engine")
        assert server.returncode is not None and supervisor.process is not server
        assert tagged(tag) == []
    finally:
        await supervisor.stop()


async def test_a_death_a_request_caused_does_not_spend_the_restart_budget(escaping_engine: Escaping) -> None:
    """Issue #40: four bursts of seeded calls killed vLLM four times and the gateway exited. A death whose log
    shows vLLM's dump of the step that raised is restarted uncounted; any other death spends the budget."""
    config, flag, _ = escaping_engine
    config = dataclasses.replace(config, max_restarts=1)
    fatal: list[str] = []
    supervisor = EngineSupervisor(config, on_fatal=fatal.append)
    await supervisor.start()

    async def die(*, of_a_request: bool) -> None:
        tag = supervisor.tag
        if of_a_request:  # what vLLM's engine core writes when a step of requests raised
            with config.log_path.open("a") as log:
                log.write(f"(EngineCore pid=1) ERROR [dump_input.py:79] {REQUEST_FAULT_MARK}: SchedulerOutput()\n")
        flag.touch()
        await apoll(
            lambda: (supervisor.tag != tag and supervisor.state == "ready") or supervisor.state == "failed",
            30,
            "the engine restarted or given up",
        )

    try:
        for _ in range(3):
            await die(of_a_request=True)
        assert (fatal, supervisor.state) == ([], "ready")
        await die(of_a_request=False)  # the budget's one restart
        assert (fatal, supervisor.state) == ([], "ready")
        await die(of_a_request=False)
        assert supervisor.state == "failed"
        assert len(fatal) == 1 and "restarted 1 times" in fatal[0]
    finally:
        await supervisor.stop()


def test_the_request_fault_mark_is_what_vllm_logs() -> None:
    """The supervisor reads REQUEST_FAULT_MARK in vLLM's log: a vLLM that words it otherwise must fail here."""
    spec = importlib.util.find_spec("vllm")  # found, not imported (slow)
    assert spec is not None and spec.submodule_search_locations
    source = Path(next(iter(spec.submodule_search_locations))) / "logging_utils" / "dump_input.py"
    assert REQUEST_FAULT_MARK in source.read_text()


def test_a_cpu_engine_never_prefills_a_prompt_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #40: vLLM 0.32 on CPU dies on a seeded prompt prefilled in chunks; --engine-args may choose otherwise."""
    monkeypatch.setattr("engine.supervisor._cpu_build", lambda: True)
    config = EngineConfig(base_model="m", served_name="m", port=1, max_model_len=1000)
    command = config.command()
    assert "--no-enable-chunked-prefill" in command
    assert command[command.index("--max-num-batched-tokens") + 1] == "2000"
    own = dataclasses.replace(config, extra_args=("--enable-chunked-prefill", "--max-num-batched-tokens=512"))
    assert not {"--no-enable-chunked-prefill", "--max-num-batched-tokens"} & set(own.command())


def stand_ins(tmp_path: Path, *argvs: tuple[str, ...], ports: tuple[int, ...]) -> list[EngineConfig]:
    """One stand-in engine's config per port (its program, else the stand-in engine on that port)."""
    return [
        FakeEngine(
            base_model="unused",
            served_name="stub",
            port=port,
            log_path=tmp_path / f"engine-{i}.log",
            startup_timeout=30,
            argv=argv or (sys.executable, STUB, str(port)),
        )
        for i, (port, argv) in enumerate(zip(ports, argvs, strict=True))
    ]


async def test_several_engines_start_together_and_one_killed_is_restarted_alone(tmp_path: Path) -> None:
    """`serve --engines 2`'s supervisors (EngineSupervisors) with stand-in engines: the adapters are loaded once
    both are up; one killed is restarted by its own supervisor and its adapters loaded again there (on_restart
    with its index), the other untouched, and the gateway's engine state stays ready meanwhile."""
    events: list[str] = []

    async def on_ready() -> None:
        events.append("all ready")

    async def on_restart(index: int) -> None:
        events.append(f"{index} restarted")

    group = EngineSupervisors(
        stand_ins(tmp_path, (), (), ports=free_ports(2)), pytest.fail, on_ready=on_ready, on_restart=on_restart
    )
    await group.start()
    try:
        assert (events, group.state) == (["all ready"], "ready")
        first, second = (s.process for s in group.supervisors)
        assert first is not None and second is not None
        os.kill(second.pid, signal.SIGKILL)
        await apoll(lambda: events[1:] == ["1 restarted"], 30, "the killed engine to be restarted")
        assert group.state == "ready"
        assert [s.state for s in group.supervisors] == ["ready", "ready"]
        assert group.supervisors[0].process is first and first.returncode is None  # the other one untouched
        assert group.supervisors[1].process is not second
    finally:
        await group.stop()
    assert group.state == "stopped"
    assert not any(port_in_use("127.0.0.1", s.config.port) for s in group.supervisors)


async def test_several_engines_fail_at_the_first_that_cannot_start(tmp_path: Path) -> None:
    """One engine that dies at start fails the start at once, naming it, without waiting for the others."""
    ports = free_ports(2)
    group = EngineSupervisors(
        stand_ins(tmp_path, ("sleep", "60"), ("false",), ports=ports),
        pytest.fail,
        on_ready=pytest.fail,
        on_restart=pytest.fail,
    )
    try:
        said = rf"^the engine at http://127.0.0.1:{ports[1]}: the engine process exited during start-up"
        with pytest.raises(EngineFailed, match=said):
            await group.start()
        loading = group.supervisors[0].process
        assert loading is not None and loading.returncode is None  # not waited for: still "loading"
    finally:
        await group.stop()
    assert loading.returncode is not None
