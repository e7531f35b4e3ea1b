"""Legacy completions' request, as the gateway reads it: the typed head it relies on or bounds (text or
token-id prompts, and how many generations they make), and the whole body as sent.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from gateway.apis.chat.schema import MAX_N, MAX_TOP_LOGPROBS
from gateway.errors import decode_body, decode_json, invalid_request

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
