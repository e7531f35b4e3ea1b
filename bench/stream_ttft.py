"""What the gateway adds to a streamed call's time to first token (DESIGN.md: <= 1 ms).

Two stand-ins for vLLM's streaming answer (events shaped like vLLM 0.32's with `return_token_ids` and
`logprobs`): nginx (the default, as in gateway_overhead.py: ~0.03 ms a call) returns the whole event stream
at once, so what the gateway adds is all there is to see; `--upstream python` (aiohttp, this file's
`--serve PORT`) sends the role event and the first token at once and the other tokens `--gap` ms apart, so
the time to the first token and the time to the whole answer differ as they do with a real engine.
`artgw serve --upstream` runs in front of it (a fresh SQLite store), and one client process times, per
call, the first content token and the last byte, direct and through the gateway, the two paths interleaved
call by call so both see the same machine. At each concurrency it prints median / p90 / p99 TTFT both ways
and what the gateway adds; then it stops the gateway (the recorder flushes) and checks that every streamed
call through it was recorded `ok` with all its token ids.

    .venv/bin/python bench/stream_ttft.py                    # nginx; 1 and 16 concurrent streams, 400 calls each
    .venv/bin/python bench/stream_ttft.py --upstream python --calls 1000 --concurrency 1,4,32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from gateway_overhead import (  # noqa: E402
    MODEL_NAME,
    Children,
    Gateway,
    NginxUpstream,
    ensure_tool,
    free_port,
    say,
    wait_http_ok,
)

from store.codec import decode_ids  # noqa: E402

PROMPT_IDS = list(range(100, 124))
TOKENS = [(" properties", 373, -6.7468), ("ct", 176, -7.1481), ("to", 452, -7.06), ("49", 500, -7.123)]


# ---------------------------------------------------------------- the streaming upstream


def _event(delta: dict[str, Any], token: tuple[str, int, float] | None, finish: str | None, **extra: Any) -> bytes:
    logprobs = None
    if token is not None:
        logprobs = {"content": [{"token": token[0], "logprob": token[2], "bytes": list(token[0].encode())}]}
    choice = {
        "index": 0,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish,
        "token_ids": [token[1]] if token is not None else [],
    }
    body = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "tiny", **extra}
    body["choices"] = [choice]
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def stream_events() -> tuple[bytes, list[bytes], bytes]:
    """(the role event and the first token, one event per later token, the usage event and [DONE])."""
    first = _event({"role": "assistant", "content": ""}, None, None, prompt_token_ids=PROMPT_IDS)
    first += _event({"content": TOKENS[0][0]}, TOKENS[0], None)
    rest = [_event({"content": t[0]}, t, "length" if t is TOKENS[-1] else None) for t in TOKENS[1:]]
    usage = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": len(TOKENS)}
    done = b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n"
    return first, rest, done


def serve_upstream(port: int, gap: float) -> None:
    from aiohttp import web

    first, rest, done = stream_events()

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(first)
        for event in rest:
            await asyncio.sleep(gap)
            await response.write(event)
        await response.write(done)
        return response

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model", "root": "tiny"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---------------------------------------------------------------- the client


async def timed_stream(session: Any, url: str, body: bytes) -> tuple[float, float]:
    """(seconds to the first content token, seconds to the end) of one streamed call."""
    started = time.perf_counter()
    first = None
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as answer:
        assert answer.status == 200, answer.status
        async for line in answer.content:
            if first is None and line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                    first = time.perf_counter() - started
    assert first is not None, "no content token"
    return first, time.perf_counter() - started


async def measure(direct: str, gateway: str, calls: int, concurrency: int) -> dict[str, list[tuple[float, float]]]:
    import aiohttp

    body = json.dumps(
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": len(TOKENS),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    results: dict[str, list[tuple[float, float]]] = {"direct": [], "gateway": []}
    urls = {"direct": f"{direct}/v1/chat/completions", "gateway": f"{gateway}/v1/chat/completions"}
    queue = [("direct", "gateway")[i % 2] for i in range(2 * calls)]  # interleaved: same machine state for both

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            path = queue.pop(0)
            results[path].append(await timed_stream(session, urls[path], body))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(20):  # warm both paths' connections up
            await timed_stream(session, urls["direct"], body)
            await timed_stream(session, urls["gateway"], body)
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return results


# ---------------------------------------------------------------- the report


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(concurrency: int, results: dict[str, list[tuple[float, float]]]) -> tuple[str, float]:
    ms = {path: [first * 1e3 for first, _ in samples] for path, samples in results.items()}
    total = {path: statistics.median(t * 1e3 for _, t in samples) for path, samples in results.items()}
    added = statistics.median(ms["gateway"]) - statistics.median(ms["direct"])
    cells = [
        f"{concurrency:>4}",
        f"{len(ms['direct']):>6}",
        *(
            f"{statistics.median(ms[p]):.3f} / {quantile(ms[p], 0.9):.3f} / {quantile(ms[p], 0.99):.3f}"
            for p in ("direct", "gateway")
        ),
        f"{added:+.3f}",
        f"{total['direct']:.2f} / {total['gateway']:.2f}",
    ]
    return "| " + " | ".join(cells) + " |", added


def count_records(db: Path) -> tuple[int, int]:
    """(streamed ok calls, of them with every sampled token id) in the gateway's store."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT completion_ids FROM calls WHERE status = 'ok' AND stream").fetchall()
    finally:
        conn.close()
    expected = [t[1] for t in TOKENS]  # one choice: its sampled ids are the whole blob (store/codec.py)
    complete = sum(1 for (blob,) in rows if decode_ids(blob) == expected)
    return len(rows), complete


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=400, help="streamed calls each way per concurrency")
    parser.add_argument("--concurrency", default="1,16", help="concurrent streams, comma-separated")
    parser.add_argument(
        "--upstream", choices=("nginx", "python"), default="nginx", help="the stand-in engine (see above)"
    )
    parser.add_argument("--gap", type=float, default=0.005, help="python upstream: seconds between later tokens")
    parser.add_argument("--artgw", default=str(Path(sys.executable).with_name("artgw")), help="artgw to measure")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the upstream child
    args = parser.parse_args()
    if args.serve:
        serve_upstream(args.serve, args.gap)
        return 0

    children = Children()
    try:
        with tempfile.TemporaryDirectory(prefix="artgw-ttft-") as tmp:
            if args.upstream == "nginx":
                if not ensure_tool("nginx", "nginx-light", install=True):
                    raise SystemExit("nginx is needed (Debian's nginx-light), or use --upstream python")
                first, rest, done = stream_events()
                nginx = NginxUpstream(children, Path(tmp), b"".join([first, *rest, done]), "text/event-stream")
                nginx.start()
                direct_port, port = nginx.direct_port, nginx.gateway_port
                say("upstream: nginx, the whole event stream at once")
            else:
                direct_port = port = free_port()
                upstream = children.start(
                    [sys.executable, __file__, "--serve", str(port), "--gap", str(args.gap)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                )
                wait_http_ok(f"http://127.0.0.1:{port}/health", upstream, 30, "the streaming upstream")
                later = f"{len(TOKENS) - 1} more {args.gap * 1e3:g} ms apart"
                say(f"upstream: aiohttp stand-in, the first token at once, then {later}")
            gateway = Gateway(children, args.artgw, port, Path(tmp))
            gateway.start()
            say("\n## Streaming time to first token, direct vs through the gateway (ms)\n")
            say(
                "| conc | calls | direct p50 / p90 / p99 | gateway p50 / p90 / p99 | added p50 "
                "| whole call p50 direct / gateway |"
            )
            say("|-----:|------:|---:|---:|---:|---:|")
            added = []
            made = 0
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                results = asyncio.run(measure(f"http://127.0.0.1:{direct_port}", gateway.url, args.calls, concurrency))
                line, delta = row(concurrency, results)
                say(line)
                added.append((concurrency, delta))
                made += len(results["gateway"]) + 20
            say(f"\ngateway {gateway.stop()}")
            recorded, complete = count_records(gateway.data_dir / "artgw.sqlite")
            say(f"streamed calls through the gateway: {made:,}; recorded ok: {recorded:,}, {complete:,} of them whole")
            one = dict(added).get(1)
            if one is not None:
                verdict = "PASS" if one <= 1.0 else "FAIL"
                say(f"{verdict}  streaming TTFT added at one connection <= 1 ms (DESIGN.md): {one:+.3f} ms")
            say(f"{'PASS' if recorded == complete == made else 'FAIL'}  every streamed call recorded with its tokens")
    finally:
        children.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
