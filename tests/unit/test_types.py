"""The type check: mypy over the packages [tool.mypy] in pyproject.toml names (strict, with its few relaxations
said there), run as `python -m mypy` from the repo root. Its cache (.mypy_cache/, git-ignored) makes a rerun take
seconds; a cold run analyses torch's annotations too (about 20 to 60 s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_finds_no_errors() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, f"mypy exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
