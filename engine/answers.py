"""What the gateway reads of the engine's answers, as typed structs (vLLM's OpenAI server).

Only the fields the gateway reads are declared; vLLM's others are skipped (`forbid_unknown_fields` is off), and a
field vLLM may leave out is optional. These types are for reading: what the gateway forwards to its clients is the
engine's answer itself (gateway/apis/*/translate.py), unknown fields and all. A value of the wrong type (token ids
that are not ints, a logprob that is not a number) is an `EngineAnswerError` naming where it is, which the
gateway answers as a 502: never recorded as if the engine had sent it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

__all__ = [
    "Answer",
    "AnswerChoice",
    "Delta",
    "DerenderedChoice",
    "DerenderedChunk",
    "EngineAnswerError",
    "ErrorBody",
    "ErrorDetail",
    "FunctionDelta",
    "Logprobs",
    "ModelCard",
    "ModelList",
    "RenderAnswer",
    "StreamDerender",
    "TokenLogprob",
    "TokenizeAnswer",
    "ToolCallDelta",
    "read",
]


class TokenLogprob(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One sampled token's entry in chat's `logprobs.content`."""

    logprob: float


class Logprobs(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A choice's logprobs: chat's (`content`) or completions' (`token_logprobs`; with `echo` the prompt's come
    first, the very first null)."""

    content: list[TokenLogprob] | None = None
    token_logprobs: list[float | None] | None = None


class FunctionDelta(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A piece of a streamed tool call: its name and arguments come in parts."""

    index: int = 0
    id: str | None = None
    function: FunctionDelta | None = None


class Delta(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """What one event of chat's stream adds to a choice."""

    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None  # vLLM's older name of `reasoning`
    tool_calls: list[ToolCallDelta] | None = None


class AnswerChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A choice of a whole answer (chat's `message`, completions' `text`) or of one event of a stream (chat's
    `delta`, completions' `text`), with the ids and logprobs the gateway asked for."""

    index: int = 0
    message: dict[str, Any] | None = None  # recorded as sent
    delta: Delta | None = None
    text: str | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None  # completions: each choice its prompt's
    logprobs: Logprobs | None = None


class Answer(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A chat or completions answer, whole or one event of its stream."""

    choices: list[AnswerChoice] = []
    prompt_token_ids: list[int] | None = None  # chat: the prompt's
    usage: dict[str, Any] | None = None  # recorded as sent
    system_fingerprint: str | None = None


class ErrorDetail(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    message: str | None = None
    param: str | None = None
    code: int | str | None = None  # vLLM puts the HTTP status here


class ErrorBody(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """vLLM's error answer, or the error event of its stream."""

    error: ErrorDetail


class RenderAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """`/v1/chat/completions/render`'s answer (--enable-scale-out): the prompt's ids, and the sampling params
    that go on to `/inference/v1/generate` as rendered."""

    token_ids: list[int]


class DerenderedChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    delta: dict[str, Any] | None = None  # shaped into the client's delta (gateway/continuation.py `_delta`)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class DerenderedChunk(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    choices: list[DerenderedChoice] = []  # none: the parser holds the text back (a tool call)


class StreamDerender(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """`/v1/chat/completions/derender`'s answer to one chunk of a generate stream: chat's chunk, and the state
    the next chunk's derender goes on from (the engine's own, sent back as it came)."""

    chunk: DerenderedChunk
    stream_state: Any = None


class TokenizeAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """`/tokenize`'s answer: how many tokens the prompt is."""

    count: int


class ModelCard(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """An entry of `/v1/models`: the base model (no parent) or a LoRA adapter loaded on it."""

    id: str
    root: str | None = None
    parent: str | None = None


class ModelList(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    data: list[ModelCard]


class EngineAnswerError(ValueError):
    """An engine answer that is not what vLLM sends: `reason` says what and where (`$.choices[0].token_ids[0]`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


T = TypeVar("T")
_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def read(answer: bytes | object, kind: type[T]) -> T:
    """An engine answer (its body, or the body already decoded for forwarding) read as `kind`."""
    try:
        if not isinstance(answer, bytes):
            return msgspec.convert(answer, kind)
        decoder = _decoders.get(kind)
        if decoder is None:
            decoder = _decoders[kind] = msgspec.json.Decoder(kind)
        result: T = decoder.decode(answer)
        return result
    except msgspec.DecodeError as exc:  # not JSON, or (ValidationError) not what vLLM sends
        raise EngineAnswerError(str(exc)) from None
