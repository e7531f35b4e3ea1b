"""Legacy completions to and from the engine: no translation, only what the recorder needs.

vLLM answers completions with the prompt token ids and the sampled token ids (`return_token_ids`), so unlike
Responses and Messages the call goes to the engine as the client sent it, plus what the recorder needs, and the
answer comes back minus what the client did not ask for.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.adapters import Route
from gateway.apis.completions.schema import CompletionRequestHead
from gateway.errors import OpenAIError

_encode = msgspec.json.encode


def upstream_request(head: CompletionRequestHead, request: dict[str, Any], route: Route) -> bytes:
    """The engine's request: the client's, for the routed model, asking for the token ids (and, unless asked
    for more, the sampled tokens' own logprobs)."""
    upstream = dict(request)
    upstream["model"] = route.upstream_model
    upstream["return_token_ids"] = True
    if head.logprobs is None:
        upstream["logprobs"] = 0  # the sampled tokens' own logprobs, nothing more
    return _encode(upstream)


class CompletionsWire:
    """Completions' own format, minus what the client did not ask for (set back to null, as vLLM does)."""

    __slots__ = ("logprobs", "model", "token_ids")

    def __init__(self, request: dict[str, Any], model: str) -> None:
        self.logprobs = request.get("logprobs") is not None  # 0 asks for the sampled tokens' own
        self.token_ids = bool(request.get("return_token_ids"))
        self.model = model

    def _hide(self, payload: dict[str, Any]) -> None:
        payload["model"] = self.model
        for choice in payload.get("choices") or ():
            if not self.token_ids:
                if "token_ids" in choice:
                    choice["token_ids"] = None
                if "prompt_token_ids" in choice:
                    choice["prompt_token_ids"] = None
            if not self.logprobs:
                choice["logprobs"] = None

    async def answer(self, payload: dict[str, Any]) -> bytes:
        self._hide(payload)
        return _encode(payload)

    def event(self, event: dict[str, Any]) -> bytes:
        self._hide(event)
        return b"data: " + _encode(event) + b"\n\n"

    async def done(self) -> bytes:
        return b"data: [DONE]\n\n"

    def broken(self, error: OpenAIError) -> bytes:
        return b"data: " + _encode(error.body()) + b"\n\n"
