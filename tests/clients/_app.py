"""What every client app here shares: it says which framework versions it runs (stderr, so a failing test
shows them) and hands its result to the test as one JSON line on stdout."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

INSTRUCTIONS = "You answer briefly."
QUESTION = "What is the weather?"


def announce(*distributions: str) -> None:
    print("running on " + ", ".join(f"{d} {version(d)}" for d in distributions), file=sys.stderr, flush=True)


def result(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def first_success(attempt: Callable[[int], Any], what: str, seeds: int = 8) -> tuple[Any, list[str]]:
    """`attempt(seed)` for seed 0, 1, ... until one returns (a random-weight model may pad its JSON past the
    token limit on a seed): its value and the failures before it; the app exits saying why when none does."""
    failures = []
    for seed in range(seeds):
        try:
            return attempt(seed), failures
        except Exception as exc:
            failures.append(f"seed {seed}: {type(exc).__name__}: {str(exc)[:300]}")
    sys.exit(f"no {what} in {seeds} seeded attempts:\n" + "\n".join(failures))
