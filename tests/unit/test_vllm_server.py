"""engine/vllm_server.py: the engine core is forked from vLLM's API server only when no thread but ZeroMQ's runs
beside the one forking. Real threads, real multiprocessing contexts, in a fresh interpreter (a pytest worker runs
threads of its own); the engine tests start every engine through it (tests/integration/test_engine_restart.py
reads its line in the engine log at each start)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from engine.vllm_server import fork_is_safe, other_threads

# Threads named as the kernel shows them (prctl PR_SET_NAME: Python 3.11 does not name OS threads), each kept
# running until the script ends; the start method the wrapped context gives as soon as each is started.
CHOICES = textwrap.dedent(
    """
    import ctypes, json, multiprocessing, threading, time
    import engine.vllm_server as server

    server.NAMING_WAIT = 0.5
    libc, stop = ctypes.CDLL(None), threading.Event()

    def named(name, after=0.0):  # a thread that takes `after` seconds to name itself `name`, then runs on
        started = threading.Event()

        def run():
            started.set()
            time.sleep(after)
            libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
            stop.wait()

        threading.Thread(target=run, daemon=True).start()
        started.wait()

    def choice(method):
        return server.forking_when_safe(lambda: multiprocessing.get_context(method))().get_start_method()

    seen = [(server.other_threads(), choice("spawn"), choice("forkserver"))]
    for name, after in (("ZMQbg/IO/0", 0.0), ("ZMQbg/Reaper", 0.2), ("python", 0.0)):
        named(name, after)
        seen.append((choice("spawn"), sorted(server.other_threads()), choice("forkserver")))
    print(json.dumps(seen))
    """
)


def test_only_zeromqs_threads_are_safe_to_fork_beside() -> None:
    assert fork_is_safe([])
    assert fork_is_safe(["ZMQbg/IO/0", "ZMQbg/Reaper", "ZMQbg/IO/0"])
    # an OpenMP pool's threads carry the process's name; tokenizers' and others carry their own
    assert not fork_is_safe(["ZMQbg/IO/0", "python"])
    assert not fork_is_safe(["tokio-runtime-w"])


def test_the_engine_core_is_forked_until_another_thread_runs() -> None:
    done = subprocess.run([sys.executable, "-c", CHOICES], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == [
        [[], "fork", "forkserver"],  # vLLM's spawn becomes a fork; any other choice of vLLM's stands
        ["fork", ["ZMQbg/IO/0"], "forkserver"],
        ["fork", ["ZMQbg/IO/0", "ZMQbg/Reaper"], "forkserver"],  # a ZeroMQ thread not named yet is waited for
        ["spawn", ["ZMQbg/IO/0", "ZMQbg/Reaper", "python"], "forkserver"],  # a nameless one stays: no fork
    ]


def test_a_thread_that_ends_while_the_names_are_read_is_left_out(tmp_path: Path) -> None:
    for tid, name in (("101", "ZMQbg/IO/0"), ("102", None), ("103", "python")):
        (tmp_path / tid).mkdir()
        if name is not None:
            (tmp_path / tid / "comm").write_text(f"{name}\n")
    assert sorted(other_threads(tmp_path)) == ["ZMQbg/IO/0", "python"]
