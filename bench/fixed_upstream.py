"""A fixed-response stand-in for vLLM's OpenAI server, for benchmarks.

It answers the routes the gateway uses with canned bodies shaped exactly like
vLLM 0.32's (a chat completion asked for `logprobs` and `return_token_ids`
carries `prompt_token_ids`, per-choice `token_ids` and sampled logprobs).

The bodies are used by `gateway_overhead.py` to configure nginx (preferred: it
costs ~0.03 ms a call). This module is also the fallback upstream when nginx is
not available: a raw-ASGI app under uvicorn, far slower than nginx, so "direct"
figures measured against it are much lower.

    python bench/fixed_upstream.py --port 8123
"""

from __future__ import annotations

import argparse
import json
from typing import Any

MODELS: dict[str, Any] = {
    "object": "list",
    "data": [{"id": "tiny", "object": "model", "root": "tiny", "parent": None}],
}

_TOKENS = [(" properties", 373, -6.7468), ("ct", 176, -7.1481), ("to", 452, -7.0600), ("49", 500, -7.1230)]
_TOKENS.append(("687", 922, -6.6366))

CHAT_COMPLETION: dict[str, Any] = {
    "id": "chatcmpl-b653a7b994d9be60",
    "object": "chat.completion",
    "created": 1795313917,
    "model": "tiny",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "".join(t for t, _, _ in _TOKENS),
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            },
            "logprobs": {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, _, lp in _TOKENS
                ]
            },
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [i for _, i, _ in _TOKENS],
        }
    ],
    "service_tier": None,
    "system_fingerprint": "vllm-0.32.0-e8c2e92e",
    "usage": {
        "prompt_tokens": 24,
        "total_tokens": 29,
        "completion_tokens": 5,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    },
    "prompt_logprobs": None,
    "prompt_token_ids": [
        *(1, 521, 98, 662, 410, 414, 419, 72, 87, 78, 420, 16),
        *(2, 98, 1, 151, 98, 74, 75, 2, 98, 1, 148, 98),
    ],
    "prompt_text": None,
    "kv_transfer_params": None,
}


def body(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


MODELS_BODY = body(MODELS)
CHAT_BODY = body(CHAT_COMPLETION)
NOT_FOUND_BODY = body({"error": {"message": "Not Found", "type": "NotFoundError", "code": 404}})


def make_app():  # type: ignore[no-untyped-def]
    """A raw ASGI app (no framework: as cheap as Python gets). `GET /_stats` counts chat calls."""
    stats = {"chat_calls": 0}
    json_headers = [(b"content-type", b"application/json")]

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        more = True
        while more:  # drain the request body
            message = await receive()
            more = message.get("more_body", False)
        path, method = scope["path"], scope["method"]
        status, payload = 404, NOT_FOUND_BODY
        if path == "/v1/chat/completions" and method == "POST":
            stats["chat_calls"] += 1
            status, payload = 200, CHAT_BODY
        elif path == "/v1/models" and method == "GET":
            status, payload = 200, MODELS_BODY
        elif path == "/health" and method == "GET":
            status, payload = 200, b""
        elif path == "/_stats" and method == "GET":
            status, payload = 200, body(stats)
        await send({"type": "http.response.start", "status": status, "headers": json_headers})
        await send({"type": "http.response.body", "body": payload})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="Fixed-response vLLM stand-in (raw ASGI under uvicorn).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    import uvicorn

    uvicorn.run(make_app(), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
