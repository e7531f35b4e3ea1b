"""Legacy completions (`POST /v1/completions`): text or token-id prompts, sent to vLLM's completions endpoint.

vLLM answers completions with the prompt token ids and the sampled token ids (`return_token_ids`), so unlike
Responses and Messages no translation is needed: the call goes to the engine as the client sent it, plus what
the recorder needs, and the answer comes back minus what the client did not ask for.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from gateway.apis.chat.schema import MAX_N, MAX_TOP_LOGPROBS
from gateway.asgi import EventStream, HangUp, JSONBody
from gateway.errors import OpenAIError, decode_body, decode_json, invalid_request
from gateway.proxy import CallOrigin, EngineCalls, EngineRequest

_encode = msgspec.json.encode

# A string, a list of strings, a list of token ids, or a list of such lists (checked by `_check_prompt`:
# msgspec takes one list type in a union).
Prompt = str | list[Any]


class CompletionRequestHead(msgspec.Struct, frozen=True):
    """The fields of a completions request the gateway relies on or bounds; the rest goes to vLLM as sent."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    prompt: Prompt
    stream: bool | None = False
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = 1
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = False


_head_decoder = msgspec.json.Decoder(CompletionRequestHead)
_request_decoder: msgspec.json.Decoder[dict[str, Any]] = msgspec.json.Decoder(dict)


def prompt_count(prompt: Prompt) -> int:
    """How many prompts: a string or a list of token ids is one; a list of either, one each."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


def _check_prompt(prompt: Prompt) -> None:
    if isinstance(prompt, str):
        return
    if prompt and (all(isinstance(p, str) for p in prompt) or _is_ids(prompt) or all(_is_ids(p) for p in prompt)):
        return
    raise invalid_request(
        "Invalid 'prompt': expected a string, a list of strings, a non-empty list of token ids (non-negative "
        "integers), or a list of such lists.",
        param="prompt",
        code="invalid_type",
    )


def parse_completion_request(body: bytes) -> tuple[CompletionRequestHead, dict[str, Any]]:
    head = decode_body(body, CompletionRequestHead, _head_decoder)
    request = decode_json(body, dict, _request_decoder)
    _check_prompt(head.prompt)
    generations = prompt_count(head.prompt) * (head.n or 1)
    if generations > MAX_N:
        raise invalid_request(
            f"Too many generations in one call: {generations} (prompts × n); at most {MAX_N}.",
            param="n",
            code="invalid_value",
        )
    return head, request


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


class CompletionsService:
    def __init__(self, calls: EngineCalls) -> None:
        self.calls = calls

    async def complete(self, body: bytes, origin: CallOrigin, hang_up: HangUp | None = None) -> JSONBody | EventStream:
        head, request = parse_completion_request(body)
        route = await self.calls.route(head.model, origin)
        upstream = dict(request)
        upstream["model"] = route.upstream_model
        upstream["return_token_ids"] = True
        if head.logprobs is None:
            upstream["logprobs"] = 0  # the sampled tokens' own logprobs, nothing more
        several = prompt_count(head.prompt) > 1
        spec = EngineRequest(
            "completions",
            "/v1/completions",
            _encode(upstream),
            request,
            route,
            bool(head.stream),
            CompletionsWire(request, head.model),
            choices_per_prompt=(head.n or 1) if several else 0,
        )
        return await self.calls.run(spec, origin, hang_up)
