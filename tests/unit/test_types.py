"""The type check: mypy over the packages [tool.mypy] in pyproject.toml names (strict, with its few relaxations
said there), run as `python -m mypy` from the repo root. A cold run analyses torch's annotations too (about 20 to 60
s of CPU); its cache makes a rerun take seconds. The cache lives outside the checkout (MYPY_CACHE_DIR, else
~/.cache/artgw/mypy), so a fresh clone on the same machine starts warm, as pip's and Docker's caches do: mypy checks
each cached module against its source's hash, so a stale or foreign entry is only re-checked, never trusted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_finds_no_errors() -> None:
    cache = os.environ.get("MYPY_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "artgw" / "mypy"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mypy"],
        cwd=ROOT,
        env={**os.environ, "MYPY_CACHE_DIR": cache},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"mypy exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
