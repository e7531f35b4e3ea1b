"""`artgw ruler score`: groups an export's lines, scores them, prints a table.

The judge here is litellm's own mocking (`mock_response`): a paid judge API cannot run in tests. The real
judge path (litellm → vLLM with JSON-schema output) is tests/integration/test_groups.py's RULER test."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import ARTGW


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
    out = subprocess.run(
        [
            ARTGW,
            "ruler",
            "score",
            str(export),
            "--judge",
            "openai/gpt-4o-mini",
            "--litellm-params",
            json.dumps({"mock_response": json.dumps(answer), "api_key": "sk-test"}),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "│" in line and ("r0" in line or "r3" in line)]
    assert any("g1" in r and "r0" in r and "0.900" in r for r in rows), out.stdout
    assert any("g2" in r and "r3" in r and "0.100" in r for r in rows), out.stdout
    assert out.stdout.count("judge calls") == 2
