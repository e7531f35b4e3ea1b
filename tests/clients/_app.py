"""What every client app here shares: it says which framework versions it runs (stderr, so a failing test
shows them) and hands its result to the test as one JSON line on stdout."""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from typing import Any

INSTRUCTIONS = "You answer briefly."
QUESTION = "What is the weather?"


def announce(*distributions: str) -> None:
    print("running on " + ", ".join(f"{d} {version(d)}" for d in distributions), file=sys.stderr, flush=True)


def result(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)
