"""docs/clients.md, run: every snippet of the guide (a ```python block that starts `# guide: NAME`) runs as
written against a real vLLM behind the gateway, in the environment its framework is tested in, and the calls it
made are recorded under the rollout id it chose, through the API its framework speaks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CLIENTS_PYTHON, ROOT
from tests.recorded import rollout

pytestmark = pytest.mark.engine

GUIDE = ROOT / "docs" / "clients.md"
SNIPPET = re.compile(r"```(?P<lang>python|javascript)\n(?:#|//) guide: (?P<name>[\w-]+)\n(?P<code>.*?)```", re.S)
JS = ROOT / "tests" / "clients-js"  # a JavaScript snippet runs beside the locked node_modules
# Each snippet: the API its calls come through, and what its last printed word may be.
EXPECTED = {
    "openai-sdk": ("chat", {"stop", "length"}),
    "anthropic-sdk": ("messages", None),  # None: a number (here the count of tokens)
    "agents-sdk": ("responses", {"str", "ModelBehaviorError"}),  # the error (0.24+): cut at max_tokens
    "langchain": ("chat", {"get_weather", "None"}),  # None: the random model ran past max_tokens
    "llama-index": ("chat", {"str"}),
    "pydantic-ai": ("responses", {"str"}),
    "instructor": ("chat", {"Paris", "Rome"}),
    "smolagents": ("chat", None),  # the number of steps in its memory
    "autogen": ("chat", {"get_weather"}),
    "strands": ("chat", {"str"}),
    "vercel-ai": ("responses", {"get_weather"}),
    "agents-js": ("responses", {"string", "ModelBehaviorError"}),  # the error: cut at maxTokens
}
IN_MAIN_ENV = {"openai-sdk", "anthropic-sdk"}  # the SDKs the gateway's own environment has


def snippets() -> dict[str, tuple[str, str]]:
    return {m["name"]: (m["lang"], m["code"]) for m in SNIPPET.finditer(GUIDE.read_text())}


def test_every_snippet_is_run() -> None:
    assert set(snippets()) == set(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_the_guides_snippet_runs_and_is_recorded(engine_gateway, tmp_path: Path, name: str) -> None:
    lang, code = snippets()[name]
    if lang == "javascript":
        script = JS / f".guide-{name}-{tmp_path.name}.mjs"
        command = ["node", str(script)]
    else:
        script = tmp_path / f"guide_{name.replace('-', '_')}.py"  # not the name of the package it imports
        command = [sys.executable if name in IN_MAIN_ENV else str(CLIENTS_PYTHON), str(script)]
    script.write_text(code)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ARTGW_URL": engine_gateway.url, "ARTGW_KEY": "unused"}
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    finally:
        script.unlink(missing_ok=True)
    assert run.returncode == 0, run.stderr[-4000:]
    rollout_id, *_, last = run.stdout.strip().splitlines()[-1].split()  # the last line: the SDKs may warn
    api, allowed = EXPECTED[name]
    assert last.isdigit() if allowed is None else last in allowed, run.stdout
    calls = rollout(engine_gateway, rollout_id)["calls"]
    assert calls and all(c["api"] == api and c["status"] == "ok" for c in calls), calls
