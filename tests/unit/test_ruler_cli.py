"""`artgw ruler score`: groups an export's lines, scores them, prints a table.

The judge here is litellm's own mocking (`mock_response`): a paid judge API cannot run in tests. The real
judge path (litellm → vLLM with JSON-schema output) is tests/integration/test_groups.py's RULER test."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import ARTGW


def ruler_score(export: Path, answer: dict, *extra: str) -> subprocess.CompletedProcess[str]:
    """`artgw ruler score` of an export, the judge answering `answer` every time (litellm's mock)."""
    params = json.dumps({"mock_response": json.dumps(answer), "api_key": "sk-test"})
    return subprocess.run(
        [ARTGW, "ruler", "score", str(export), "--judge", "openai/gpt-4o-mini", "--litellm-params", params, *extra],
        capture_output=True,
        text=True,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        timeout=120,
    )


def test_ruler_score_prints_a_table_per_group(tmp_path: Path) -> None:
    lines = [
        {
            "rollout_id": f"r{i}",
            "group": "g1" if i < 2 else "g2",
            "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": str(3 + i)}],
        }
        for i in range(4)
    ]
    export = tmp_path / "t.jsonl"
    export.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    answer = {"scores": {"1": {"explanation": "right", "score": 0.9}, "2": {"explanation": "wrong", "score": 0.1}}}
    out = ruler_score(export, answer)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "│" in line and ("r0" in line or "r3" in line)]
    assert any("g1" in r and "r0" in r and "0.900" in r for r in rows), out.stdout
    assert any("g2" in r and "r3" in r and "0.100" in r for r in rows), out.stdout
    assert out.stdout.count("judge calls") == 2


def test_ruler_score_with_samples_shows_the_spread(tmp_path: Path) -> None:
    """Two samples of a two-trajectory group: two orders, two judge calls; litellm's mock answers the same
    scores by position both times, so each trajectory gets 0.9 once and 0.1 once: 0.5 each, spread 0.4."""
    lines = [
        {
            "rollout_id": f"r{i}",
            "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": str(i)}],
        }
        for i in range(2)
    ]
    export = tmp_path / "t.jsonl"
    export.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    answer = {"scores": {"1": {"explanation": "first", "score": 0.9}, "2": {"explanation": "second", "score": 0.1}}}
    out = ruler_score(export, answer, "--samples", "2")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "│" in line and ("r0" in line or "r1" in line)]
    assert len(rows) == 2 and all("0.500" in r and "0.400" in r for r in rows), out.stdout
    assert "2 judge calls" in out.stdout and "2 samples" in out.stdout
