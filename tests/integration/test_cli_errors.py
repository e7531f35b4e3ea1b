"""The errors a user makes end `artgw` with one line on stderr and a non-zero exit, never a traceback;
and nothing is created on the way. Runs the real console script as a subprocess, with the shell's
ARTGW_* variables removed so only what each test sets counts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ARTGW, ROOT, free_port, poll, stop_group, wait_http


@pytest.fixture
def stub_url() -> Iterator[str]:
    """A stand-in vLLM (tests/stub_engine.py): enough for a gateway to start and answer /v1/art."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "stub_engine.py"), str(port)], start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", 30, proc)
        yield url
    finally:
        stop_group(proc)


def artgw(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ARTGW_")}
    return subprocess.run(
        [ARTGW, *args], cwd=cwd, env={**clean, **(env or {})}, capture_output=True, text=True, timeout=120
    )


def one_line_error(result: subprocess.CompletedProcess[str], prefix: str) -> str:
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{prefix}: "), lines[0]
    return lines[0]


def test_status_without_a_gateway_says_where_it_looked(tmp_path: Path) -> None:
    port = free_port()  # nobody listens there
    result = artgw("status", "--model", "my-agent", cwd=tmp_path, env={"ARTGW_PORT": str(port)})
    line = one_line_error(result, "artgw status")
    assert f"http://127.0.0.1:{port}" in line and "ARTGW_GATEWAY" in line
    assert result.returncode == 1


def test_export_without_a_store_creates_nothing(tmp_path: Path) -> None:
    result = artgw("export", "--model", "my-agent", cwd=tmp_path)
    line = one_line_error(result, "artgw export")
    assert "no store at" in line and "ARTGW_DATA_DIR" in line
    assert list(tmp_path.iterdir()) == [], "export must not create a store, a data/ dir or anything else"


def test_export_of_an_unmigrated_store_says_migrate(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "artgw.sqlite").touch()  # exists, but no schema
    result = artgw("export", cwd=tmp_path)
    line = one_line_error(result, "artgw export")
    assert "artgw migrate" in line


@pytest.mark.parametrize(
    "command",
    [
        ("migrate",),
        ("export",),
        ("train", "--base-model", "x"),
        ("serve", "--upstream", "http://127.0.0.1:1"),
    ],
    ids=lambda c: c[0],
)
@pytest.mark.parametrize("db", ["notaurl", "mysql://bob:hunter2@db.example/art"])
def test_a_db_that_is_not_a_store_url_is_one_line(tmp_path: Path, command: tuple[str, ...], db: str) -> None:
    """#27: a 40-line SQLAlchemy traceback before; a password is not echoed."""
    result = artgw(*command, "--db", db, cwd=tmp_path)
    line = one_line_error(result, f"artgw {command[0]}")
    assert "is not a store URL" in line and "hunter2" not in line
    assert result.returncode == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("given", "says"), [("/no/such/model", "does not exist"), (".", "has no config.json")])
def test_serve_of_a_base_model_directory_that_is_not_one_is_one_line(tmp_path: Path, given: str, says: str) -> None:
    """#27: vLLM started, died, and its 30-line traceback was printed twice."""
    result = artgw("serve", "--base-model", given, cwd=tmp_path)
    assert f"--base-model {given}: the directory {says}" in one_line_error(result, "artgw serve")
    assert result.returncode == 2


def test_serve_says_within_seconds_that_its_upstream_does_not_answer(tmp_path: Path) -> None:
    """#27: `--upstream` at a port nobody listens on showed the engine `starting` for ever, saying nothing."""
    nobody = f"http://127.0.0.1:{free_port()}"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ARTGW_")}
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [ARTGW, "serve", "--upstream", nobody, "--port", str(free_port())],
            cwd=tmp_path,
            env=clean,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # Refused at once (ConnectError), or, on a loop starved past the probe's 2 s, ConnectTimeout (CI saw it)
        said = re.compile(
            rf"the upstream engine at {re.escape(nobody)} is not ready: nothing answers there "
            r"\((ConnectError|ConnectTimeout)\); still waiting"
        )
        poll(lambda: said.search(log.read_text()), 60, "serve to say its upstream does not answer")
        assert proc.poll() is None  # it goes on waiting: the engine may come up later
    finally:
        stop_group(proc)


def test_train_with_a_bad_variable_names_it(tmp_path: Path) -> None:
    result = artgw("train", "--base-model", "x", cwd=tmp_path, env={"ARTGW_LEARNING_RATE": "abc"})
    line = one_line_error(result, "artgw train")
    assert "ARTGW_LEARNING_RATE" in line
    assert result.returncode == 2


def test_train_rejects_min_groups_above_groups_per_step(tmp_path: Path) -> None:
    result = artgw("train", "--base-model", "x", "--groups-per-step", "2", "--min-groups-per-step", "3", cwd=tmp_path)
    assert "--min-groups-per-step" in one_line_error(result, "artgw train")
    assert result.returncode == 2


def test_train_with_a_bad_boolean_variable_names_it(tmp_path: Path) -> None:
    result = artgw("train", "--base-model", "x", cwd=tmp_path, env={"ARTGW_MASK_TRUNCATED": "sometimes"})
    assert "ARTGW_MASK_TRUNCATED" in one_line_error(result, "artgw train")


def test_ruler_score_of_a_missing_file(tmp_path: Path) -> None:
    result = artgw("ruler", "score", "nothere.jsonl", "--judge", "openai/gpt-4o-mini", cwd=tmp_path)
    assert "nothere.jsonl" in one_line_error(result, "artgw ruler score")


def test_debug_variable_gives_the_traceback(tmp_path: Path) -> None:
    result = artgw("export", cwd=tmp_path, env={"ARTGW_DEBUG": "1"})
    assert result.returncode != 0 and "Traceback" in result.stderr and "StoreMissing" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_status_and_export_find_the_gateway_and_store_like_serve(
    stub_url: str, gateway_factory: object, tmp_path: Path
) -> None:
    gateway = gateway_factory("--upstream", stub_url)  # type: ignore[operator]
    port = gateway.url.rsplit(":", 1)[1]
    # the same variables serve reads: ARTGW_PORT for status, ARTGW_DATA_DIR for export and status's admin key
    keyless = artgw("status", cwd=tmp_path, env={"ARTGW_PORT": port})
    message = one_line_error(keyless, "artgw status")
    assert "answered 401" in message and f"none in {Path('data') / 'admin_key'}; set --data-dir" in message
    found = {"ARTGW_PORT": port, "ARTGW_DATA_DIR": str(gateway.data_dir)}
    ok = artgw("status", cwd=tmp_path, env=found)
    assert ok.returncode == 0, ok.stderr
    assert "my-agent" in ok.stdout and "serves step 0" in ok.stdout
    as_json = artgw("status", "--json", cwd=tmp_path, env=found)
    assert as_json.returncode == 0, as_json.stderr
    (shown,) = json.loads(as_json.stdout)
    assert (shown["name"], shown["served_step"], shown["object"]) == ("my-agent", 0, "art.model")
    unknown = artgw("status", "--model", "nope", cwd=tmp_path, env=found)
    assert "404" in one_line_error(unknown, "artgw status")
    exported = artgw("export", cwd=tmp_path, env={"ARTGW_DATA_DIR": str(gateway.data_dir)})
    assert exported.returncode == 0, exported.stderr
    assert exported.stderr.strip().startswith("exported ")


@pytest.mark.parametrize("command", [("keys", "list"), ("status",)])
def test_the_gateway_option_says_what_it_is_for(tmp_path: Path, command: tuple[str, ...]) -> None:
    """#27: `keys list --help` called --gateway the gateway that "loads the new adapters"."""
    shown = artgw(*command, "--help", cwd=tmp_path)
    assert shown.returncode == 0
    text = " ".join(shown.stdout.split())
    assert "loads the new adapters" not in text and "URL of the gateway to talk to" in text and "--json" in text


@pytest.mark.parametrize(
    ("source", "says"),
    [("missing.whl", "no such file"), ("model.bin", "not a .whl or .gguf file"), ("broken.whl", "not a wheel")],
)
def test_real_model_from_a_bad_source_says_what_is_wrong(tmp_path: Path, source: str, says: str) -> None:
    if source != "missing.whl":
        (tmp_path / source).write_bytes(b"not a model")
    result = artgw("real-model", "--source", source, "out", cwd=tmp_path)
    assert says in one_line_error(result, "artgw real-model")
    assert not (tmp_path / "out").exists()
