"""A long streamed continuation against the plain stream (issue 44): what a spliced stream costs per token.

The real vLLM (the tests' toy model, supervised by `artgw serve --base-model`, the family's tool parser on) and
one gateway. Each round builds a rollout with a `--turns`-turn history (one short call), then streams a call
that continues it (spliced: render → generate → derender) and the same messages under a fresh rollout id (the
plain path: the engine's own chat stream), each `--tokens` long (`ignore_eos`), tools offered; with and without
logprobs; the order of the two alternates by round. Per call: the time to the first content token, the time per
output token after it, and the CPU seconds of the engine's API server (where derender runs) and of the gateway.
Medians per kind, and the ratio splice / plain.

    flock /tmp/artgw-engine.lock nice -n 5 .venv/bin/python bench/stream_continuation.py             # ~4 min
    .venv/bin/python bench/stream_continuation.py --tokens 2000 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.continuation import ARTGW, Processes, free_port, wait_ready

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def history(turns: int) -> list[dict[str, Any]]:
    """`turns` user/assistant turns, then a user message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: what is the weather in city number {i}?"})
        messages.append({"role": "assistant", "content": f"City {i} has light rain and {10 + i} degrees."})
    messages.append({"role": "user", "content": "And in Rome?"})
    return messages


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def api_server(gateway: psutil.Process, engine_port: int) -> psutil.Process:
    """The supervised vLLM's API server: the gateway's descendant listening on the engine's port."""
    for child in gateway.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(c.laddr.port == engine_port and c.status == "LISTEN" for c in child.net_connections()):
                return child
    raise SystemExit("the engine's API server was not found")


def derenders(engine: str) -> tuple[float, float]:
    """The engine's derender requests so far, and their bytes (vLLM's HTTP metrics)."""
    counts = [0.0, 0.0]
    for line in httpx.get(engine + "/metrics").text.splitlines():
        if 'handler="/v1/chat/completions/derender"' in line:
            for i, name in enumerate(("http_requests_total{", "http_request_size_bytes_sum{")):
                if line.startswith(name):
                    counts[i] += float(line.rsplit(" ", 1)[1])
    return counts[0], counts[1]


def streamed(
    client: httpx.Client, body: dict[str, Any], rollout: str, procs: dict[str, psutil.Process], engine: str
) -> dict[str, float]:
    """One streamed call: its time to the first content token, time per later token, CPU seconds, and the
    derender requests it took."""
    requests, sent = derenders(engine)
    before = {name: _cpu(p) for name, p in procs.items()}
    start = time.perf_counter()
    first = end = 0.0
    tokens = 0
    with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-ART-Rollout-Id": rollout}) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SystemExit(f"error event: {event}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                if not first and (delta.get("content") or delta.get("tool_calls")):
                    first = time.perf_counter()
    end = time.perf_counter()
    cpu = {f"{name} cpu": _cpu(p) - before[name] for name, p in procs.items()}
    requests_after, sent_after = derenders(engine)
    took = {"derenders": requests_after - requests, "derender kB": (sent_after - sent) / 1000}
    return {"ttft": first - start, "tpot": (end - first) / max(1, tokens - 1), "tokens": tokens, **cpu, **took}


def spliced_calls(client: httpx.Client) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("artgw_continued_calls_total") and 'how="spliced"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1000, help="tokens of each measured answer (ignore_eos)")
    parser.add_argument("--turns", type=int, default=20, help="user/assistant turns of each call's history")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each streams one call of each path and kind")
    parser.add_argument("--artgw", default=ARTGW, help="the artgw to measure")
    args = parser.parse_args()
    from artgw.tiny_model import build_tiny_model

    procs = Processes()
    with tempfile.TemporaryDirectory(prefix="artgw-stream-continuation-") as tmp:
        workdir = Path(tmp)
        try:
            model_dir = build_tiny_model(workdir / "tiny")
            port, engine_port = free_port(), free_port()
            cmd = [args.artgw, "serve", "--base-model", str(model_dir), "--port", str(port)]
            cmd += ["--engine-port", str(engine_port), "--data-dir", str(workdir / "gw"), "--auth", "off"]
            gateway = procs.start([*cmd, "--log-level", "warning"], workdir / "gw.log")
            url = f"http://127.0.0.1:{port}"
            print("starting the gateway and its vLLM ...", flush=True)
            wait_ready(url + "/readyz", gateway, 900)
            watched = {"engine API server": api_server(psutil.Process(gateway.pid), engine_port)}
            watched["gateway"] = psutil.Process(gateway.pid)
            engine = f"http://127.0.0.1:{engine_port}"
            rows: dict[tuple[str, str], list[dict[str, float]]] = {}
            with httpx.Client(base_url=url, timeout=600) as client:
                for round_ in range(args.rounds):
                    for logprobs in (False, True):
                        rid = f"bench-{uuid.uuid4().hex[:8]}"
                        messages = history(args.turns)
                        setup = {"model": "my-agent", "messages": messages, "max_tokens": 8, "tools": TOOLS}
                        setup["tool_choice"] = "none"
                        answer = client.post("/v1/chat/completions", json=setup, headers={"X-ART-Rollout-Id": rid})
                        assert answer.status_code == 200, answer.text
                        reply = answer.json()["choices"][0]["message"]
                        reply = {"role": "assistant", "content": reply.get("content") or ""}
                        body = {
                            "model": "my-agent",
                            "messages": [*messages, reply, {"role": "user", "content": "More."}],
                        }
                        body |= {"tools": TOOLS, "stream": True, "stream_options": {"include_usage": True}}
                        body |= {"max_tokens": args.tokens, "ignore_eos": True, "logprobs": logprobs}
                        kind = "logprobs" if logprobs else "no logprobs"
                        paths = [("splice", rid), ("plain", f"bench-plain-{uuid.uuid4().hex[:8]}")]
                        for path, rollout in paths if round_ % 2 == 0 else paths[::-1]:
                            rows.setdefault((kind, path), []).append(streamed(client, body, rollout, watched, engine))
                spliced = spliced_calls(client)
        finally:
            procs.stop_all()
    expected = 2 * args.rounds
    print(
        f"\n{args.rounds} rounds, {args.tokens} tokens a call, {args.turns}-turn histories;"
        f" spliced {spliced:.0f} of {expected}"
    )
    keys = ["ttft", "tpot", "engine API server cpu", "gateway cpu"]
    print(
        "\n| kind | path | tokens | TTFT (ms) | per token (ms) | engine API server CPU (s) | gateway CPU (s) |"
        " derender requests | derender kB sent |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    medians: dict[tuple[str, str], dict[str, float]] = {}
    for (kind, path), calls in rows.items():
        columns = [*keys, "tokens", "derenders", "derender kB"]
        med = medians[kind, path] = {k: statistics.median(c[k] for c in calls) for k in columns}
        print(
            f"| {kind} | {path} | {med['tokens']:.0f} | {1000 * med['ttft']:.1f} | {1000 * med['tpot']:.2f} |"
            f" {med['engine API server cpu']:.2f} | {med['gateway cpu']:.2f} | {med['derenders']:.0f} |"
            f" {med['derender kB']:.0f} |"
        )
    print(
        "\n| kind | TTFT splice/plain | per token splice/plain | engine API server CPU splice/plain |"
        " gateway CPU splice/plain |"
    )
    print("|---|---|---|---|---|")
    for kind in ("no logprobs", "logprobs"):
        s, p = medians[kind, "splice"], medians[kind, "plain"]
        ratios = [s[k] / p[k] if p[k] else float("inf") for k in keys]
        print(f"| {kind} | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")
    return 0 if spliced == expected else 1


if __name__ == "__main__":
    raise SystemExit(main())
