"""A stand-in for vLLM's OpenAI server, for the failure paths a real engine cannot be made to show on cue
(a hang past the gateway's timeout, a 5xx answer, dying mid-stream, vLLM's 400 for a negative temperature,
its runtime LoRA API with what is loaded in `GET /loras` and `GET /v1/models`, a LoRA it does not hold answered
404 as vLLM does, and `PUT /loads` {"refuse": true, "delay": SECONDS} making it refuse, or take that long over,
every load until told otherwise; `PUT /hold` {"hold": true} holds every inference call until {"hold": false}: a
call in flight for as long as a test needs one) and for watching the engine's side of a client hang-up:
with --endless-stream it streams a token every 20 ms until its client goes away, and `GET /stats` counts the
streams it started and
the ones whose client hung up (vLLM aborts the request then, but on a busy CPU its own event loop may only
notice once the generation is over), and shows the W3C `traceparent` of the last inference request (vLLM's
tracing parents its spans on it) and, once one came, how many plain inference `requests` came.
A plain stream (role, three tokens, usage, [DONE]) serves load tests. Everything else is tested against the
real vLLM.
Run: python tests/stub_engine.py PORT [--delay SECONDS] [--status CODE] [--die-mid-stream] [--endless-stream]
[--end-stream-early] [--garbled bad-line|no-logprob|text-ids] [--answers JSON].
--answers scripts the content of a plain answer per requested model (a LoRA step is `NAME@K`; "*": any other), so
that what an eval grades, and what a gate decides, is known in advance."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Awaitable
from typing import Any

import uvicorn

# vLLM's token-level chat (gateway/continuation.py): the stand-in has none, as vLLM without --enable-scale-out.
SCALE_OUT_PATHS = ("/v1/chat/completions/render", "/inference/v1/generate", "/v1/chat/completions/derender")
COMPLETION = {
    "id": "chatcmpl-stub",
    "object": "chat.completion",
    "created": 0,
    "model": "stub",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "ok"},
            "logprobs": {"content": [{"token": "ok", "logprob": -0.5, "bytes": [111, 107], "top_logprobs": []}]},
            "finish_reason": "stop",
            "token_ids": [7],
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    "prompt_token_ids": [1, 2, 3],
}


def _chunk(**extra: object) -> bytes:
    chunk = {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "stub",
        "choices": [{"index": 0, "delta": {"content": "o"}, "token_ids": [7], "logprobs": None}],
        **extra,
    }
    return f"data: {json.dumps(chunk)}\n\n".encode()


async def _endless_stream(receive, send, stats: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    stats["streams_started"] += 1
    gone = asyncio.Event()

    async def listen() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    listener = asyncio.create_task(listen())
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": _chunk(prompt_token_ids=[1, 2, 3]), "more_body": True})
    while not gone.is_set():
        await asyncio.sleep(0.02)
        await send({"type": "http.response.body", "body": _chunk(), "more_body": True})
    stats["streams_aborted"] += 1
    listener.cancel()


async def _stream(send) -> None:  # type: ignore[no-untyped-def]
    """A whole stream, as vLLM sends one: a role event with the prompt's token ids, three token events with
    their logprobs, a few ms apart, the usage, then [DONE]."""

    def event(delta: dict[str, Any], top: dict[str, Any] | None = None, **choice: Any) -> bytes:
        chunk = {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "stub",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, **choice}],
            **(top or {}),
        }
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    first = event({"role": "assistant", "content": ""}, {"prompt_token_ids": [1, 2, 3]}, token_ids=[])
    await send({"type": "http.response.body", "body": first, "more_body": True})
    logprob = {"content": [{"token": "t", "logprob": -0.25, "bytes": [116], "top_logprobs": []}]}
    for token in (7, 8, 9):
        await asyncio.sleep(0.003)  # the engine generating
        body = event({"content": "t"}, token_ids=[token], logprobs=logprob)
        await send({"type": "http.response.body", "body": body, "more_body": True})
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    last = event({}, {"usage": usage}, finish_reason="stop", token_ids=[]) + b"data: [DONE]\n\n"
    await send({"type": "http.response.body", "body": last, "more_body": False})


async def _body(receive) -> bytes:  # type: ignore[no-untyped-def]
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _error(message: str, status: int, param: str | None = None) -> bytes:
    """vLLM's error body: OpenAI's shape, with the HTTP status as an int `code`."""
    kind = "BadRequestError" if status == 400 else "NotFoundError"
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


def _lora(
    path: str, request: dict[str, object], loaded: dict[str, str], calls: list[str], refuse: bool
) -> tuple[bytes, int]:
    """vLLM's runtime LoRA API (VLLM_ALLOW_RUNTIME_LORA_UPDATING): what is loaded shows in GET /loras. `refuse`:
    every load fails, as vLLM's does for a checkpoint it cannot read."""
    name = str(request.get("lora_name"))
    calls.append(f"{'load' if path.endswith('/load_lora_adapter') else 'unload'} {name}")
    if path.endswith("/load_lora_adapter"):
        if refuse:
            return _error(f"Loading lora {name} failed: told to refuse it (PUT /loads).", 400), 400
        if name in loaded:
            return _error(f"The lora adapter '{name}' has already been loaded.", 400), 400
        loaded[name] = str(request.get("lora_path"))
        return f"Success: LoRA adapter '{name}' added successfully.".encode(), 200
    if name not in loaded:
        return _error(f"The lora adapter '{name}' cannot be found.", 404), 404
    del loaded[name]
    return f"Success: LoRA adapter '{name}' removed successfully.".encode(), 200


async def _garbled(send, kind: str, stream: bool) -> None:  # type: ignore[no-untyped-def]
    """--garbled bad-line: a line that is not JSON; --garbled no-logprob: a logprobs entry without `logprob`;
    --garbled text-ids: token ids that are text, not ints."""
    if not stream:
        if kind == "text-ids":
            choice = {**COMPLETION["choices"][0], "token_ids": ["ok"]}  # type: ignore[dict-item]
        else:
            choice = {**COMPLETION["choices"][0], "logprobs": {"content": [{"token": "ok"}]}}  # type: ignore[dict-item]
        body = b"{not json" if kind == "bad-line" else json.dumps({**COMPLETION, "choices": [choice]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": _chunk(prompt_token_ids=[1, 2, 3]), "more_body": True})
    if kind == "bad-line":
        bad = b"data: {not json\n\n"
    elif kind == "text-ids":
        bad = _chunk().replace(b'"token_ids": [7]', b'"token_ids": ["o"]')
    else:
        bad = _chunk().replace(b'"logprobs": null', b'"logprobs": {"content": [{"token": "o"}]}')
    await send({"type": "http.response.body", "body": bad, "more_body": True})
    await send({"type": "http.response.body", "body": _chunk() + b"data: [DONE]\n\n", "more_body": False})


async def _wait_unless_aborted(receive, work: Awaitable[object]) -> bool:  # type: ignore[no-untyped-def]
    """Wait for `work` (a sleep, or a hold's release), as an engine busy generating; False when the client goes away
    first (vLLM aborts then)."""
    listener = asyncio.ensure_future(receive())
    working = asyncio.ensure_future(work)
    try:
        await asyncio.wait((listener, working), return_when=asyncio.FIRST_COMPLETED)
    finally:
        working.cancel()
    if not listener.done():
        listener.cancel()
        return True
    return listener.result()["type"] != "http.disconnect"


def make_app(  # type: ignore[no-untyped-def]
    delay: float,
    status: int,
    die_mid_stream: bool,
    endless_stream: bool = False,
    end_early: bool = False,
    garbled: str | None = None,
    answers: dict[str, str] | None = None,
):
    stats: dict[str, Any] = {"streams_started": 0, "streams_aborted": 0, "requests_aborted": 0}
    loaded: dict[str, str] = {}  # LoRA adapters by name -> path: GET /loras
    loads: dict[str, Any] = {"refuse": False, "delay": 0.0}  # PUT /loads: every load fails, or takes that long
    released = asyncio.Event()  # PUT /hold {"hold": true} clears it: inference calls wait until {"hold": false}
    released.set()
    calls: list[str] = []  # the LoRA API calls, in order: "load NAME", "unload NAME"

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            body, code = b"", 200
        elif path == "/stats":
            body, code = json.dumps(stats).encode(), 200
        elif path == "/loras":
            body, code = json.dumps({"loaded": sorted(loaded), "calls": calls}).encode(), 200
        elif path == "/loads":
            loads.update(json.loads(await _body(receive) or b"{}"))
            body, code = json.dumps(loads).encode(), 200
        elif path == "/hold":
            hold = bool(json.loads(await _body(receive) or b"{}").get("hold"))
            if hold:
                released.clear()
            else:
                released.set()
            body, code = json.dumps({"hold": hold}).encode(), 200
        elif path.endswith("_lora_adapter"):
            if path.endswith("/load_lora_adapter"):
                await asyncio.sleep(loads["delay"])
            body, code = _lora(path, json.loads(await _body(receive) or b"{}"), loaded, calls, loads["refuse"])
        elif path.endswith("/chat/completions") and endless_stream:
            while (await receive()).get("more_body"):
                pass
            await _endless_stream(receive, send, stats)
            return
        elif path == "/tokenize":  # a count as vLLM's has it: one token per message, one per tool, one to answer
            request = json.loads(await _body(receive) or b"{}")
            count = len(request.get("messages") or ()) + len(request.get("tools") or ()) + 1
            body, code = json.dumps({"count": count, "max_model_len": 2048, "tokens": [1] * count}).encode(), 200
        elif path in SCALE_OUT_PATHS:  # as vLLM started without --enable-scale-out
            body = _error("Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out.", 403)
            code = 403
        elif path == "/v1/models":  # the base model, then each LoRA loaded, with its parent (as vLLM lists them)
            adapters = [{"id": name, "root": root, "parent": "stub"} for name, root in sorted(loaded.items())]
            body = json.dumps(
                {"object": "list", "data": [{"id": "stub", "root": "stub", "parent": None}, *adapters]}
            ).encode()
            code = 200
        else:
            stats["requests"] = stats.get("requests", 0) + 1  # the plain inference requests received
            stats["last_traceparent"] = dict(scope["headers"]).get(b"traceparent", b"").decode() or None
            request = json.loads(await _body(receive) or b"{}")
            model = str(request.get("model"))
            if "@" in model and model not in loaded:  # a LoRA it does not hold: vLLM's 404
                body = _error(f"The model `{model}` does not exist.", 404, "model")
                await send(
                    {"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]}
                )
                await send({"type": "http.response.body", "body": body})
                return
            if delay and not await _wait_unless_aborted(receive, asyncio.sleep(delay)):
                stats["requests_aborted"] += 1  # the client (the gateway) hung up while the "engine" worked
                return
            if not released.is_set() and not await _wait_unless_aborted(receive, released.wait()):
                stats["requests_aborted"] += 1
                return
            if garbled is not None:  # an answer vLLM never sends: the gateway must say so, not crash
                await _garbled(send, garbled, bool(request.get("stream")))
                return
            if die_mid_stream or end_early:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")],
                    }
                )
                first = _chunk(prompt_token_ids=[1, 2, 3])
                await send({"type": "http.response.body", "body": first, "more_body": True})
                if die_mid_stream:
                    os._exit(1)  # the engine dies mid-stream
                await send({"type": "http.response.body", "body": b"", "more_body": False})  # no [DONE]
                return
            if request.get("stream") and status == 200 and not answers:
                await _stream(send)
                return
            temperature = request.get("temperature")
            if isinstance(temperature, int | float) and temperature < 0:  # as vLLM: its own 400, param named
                body, code = _error(f"temperature must be non-negative, got {temperature}.", 400, "temperature"), 400
            elif status != 200:
                body = json.dumps(
                    {"error": {"message": "engine exploded", "type": "InternalServerError", "code": status}}
                ).encode()
                code = status
            elif answers:
                content = answers.get(str(request.get("model")), answers.get("*", "ok"))
                choice = {**COMPLETION["choices"][0], "message": {"role": "assistant", "content": content}}  # type: ignore[dict-item]
                body, code = json.dumps({**COMPLETION, "choices": [choice]}).encode(), 200
            else:
                body, code = json.dumps(COMPLETION).encode(), 200
        await send(
            {
                "type": "http.response.start",
                "status": code,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--status", type=int, default=200)
    parser.add_argument("--die-mid-stream", action="store_true")
    parser.add_argument("--endless-stream", action="store_true")
    parser.add_argument("--end-stream-early", action="store_true", help="one event, then the end: no [DONE]")
    parser.add_argument("--garbled", choices=("bad-line", "no-logprob", "text-ids"), help="an answer vLLM never sends")
    parser.add_argument("--answers", type=json.loads, help='{"MODEL": "content", "*": "content"}: plain answers')
    a = parser.parse_args()
    app = make_app(a.delay, a.status, a.die_mid_stream, a.endless_stream, a.end_stream_early, a.garbled, a.answers)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")
