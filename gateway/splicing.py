"""The token arithmetic of a splice: a continuing call's prompt ids from the ids the engine's renders answered.

Pure (no I/O): gateway/continuation.py `Splicer.splice` asks the engine for the renders, then calls `splice_ids`.

    prompt = previous prompt ids + the sampled ids + the template's end of turn + the rendered new messages

Where the reply's turn ends in the request's render is found by rendering it twice, the reply's text replaced by
one sentinel text then another (continuation.py `_SENTINELS`): what the two renders share at their end follows the
reply's text. Three shapes of renders, by the reply and the template:

- `TextReply`: what follows the reply's text is its end of turn, then the new messages.
- `CallsReply`: the reply's tool calls come between; the history through the reply, rendered the same two ways,
  says how long the template's rendering of them is, and must end with the template's end of turn (`turn_tail`).
- `CallsReplyAsText`: the template renders no history ending with an assistant turn (mistral_common's): the
  request is rendered with a text reply of each sentinel in the reply's place, and its render as sent must end
  with what follows that text, token for token.

The first id of the end of turn is the model's own stop: not added again where the reply ended on it (a reply
cut at its length gets the whole end of turn).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# Why the renders do not show where the reply's turn ends: each is served as sent (`template_mismatch`).
MismatchCheck = Literal[
    "reply_not_rendered",  # the sentinel renders are the same, or share nothing at their end
    "calls_not_found",  # the history through the reply does not show its tool calls before the new messages
    "as_sent_differs",  # the request as sent does not end with what follows a text reply's text
    "no_room",  # the splice leaves the engine's default max_tokens no token to sample
]


@dataclass(frozen=True, slots=True)
class TextReply:
    """A text reply: the request rendered with each sentinel as the reply's text."""

    request_a: list[int]
    request_z: list[int]


@dataclass(frozen=True, slots=True)
class CallsReply:
    """A reply with tool calls: the request, and the history through the reply (no generation prompt), each
    rendered with each sentinel as the reply's text; `tail` the template's end of an assistant turn."""

    request_a: list[int]
    request_z: list[int]
    through_a: list[int]
    through_z: list[int]
    tail: list[int]


@dataclass(frozen=True, slots=True)
class CallsReplyAsText:
    """A reply with tool calls on a template that renders no history ending with an assistant turn: the request
    as sent, and rendered with a text reply of each sentinel in the reply's place."""

    request: list[int]
    text_a: list[int]
    text_z: list[int]


Renders = TextReply | CallsReply | CallsReplyAsText


@dataclass(frozen=True, slots=True)
class Spliced:
    """The splice's prompt ids, and the max_tokens to sample with where the client asked none (None: keep)."""

    prompt_ids: list[int]
    max_tokens: int | None


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Why the call is not spliced: `reason` is what it is counted as (gateway/continuation.py `Served`)."""

    check: MismatchCheck
    reason: Literal["template_mismatch"] = "template_mismatch"


def shared_end(a: Sequence[int], b: Sequence[int]) -> int:
    """How many ids `a` and `b` end with in common."""
    n = 0
    for x, y in zip(reversed(a), reversed(b), strict=False):
        if x != y:
            break
        n += 1
    return n


def turn_tail(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """The template's end of an assistant turn (`<|im_end|>\\n`), from a one-turn history rendered with each
    sentinel as the reply: what the two end with in common ([] where one is all of the other)."""
    shared = shared_end(a, b)
    return list(a[len(a) - shared :]) if shared < len(a) else []


def splice_ids(
    renders: Renders, prefix_ids: Sequence[int], sampled_ids: Sequence[int], *, unasked_max_tokens: int | None
) -> Spliced | Mismatch:
    """The prompt ids a continuing call is sampled from, or why the renders do not show where the reply ends.

    `prefix_ids`: the previous call's prompt ids then the reply's sampled ids (`sampled_ids`). `unasked_max_tokens`:
    where the client asked no max_tokens, the one the engine's render gave (vLLM's default: what the context leaves
    after the prompt of the first render, whose sampling params the splice samples with); the splice's prompt is
    another length, so it moves by the difference."""
    match renders:
        case TextReply(request_a=whole, request_z=other):
            shared = shared_end(whole, other)
            if shared in (0, len(whole)):  # the template does not render the reply's text (or nothing after it)
                return Mismatch("reply_not_rendered")
            after_reply = whole[len(whole) - shared :]
            reply_end = tail = after_reply[:1]  # the end of turn's first id: the model's own stop
        case CallsReply(request_a=whole, request_z=other, through_a=through, through_z=through_z, tail=tail):
            shared = shared_end(whole, other)
            if shared in (0, len(whole)):
                return Mismatch("reply_not_rendered")
            after_reply = whole[len(whole) - shared :]
            reply_end = through[len(through) - shared_end(through, through_z) :]  # its calls, then its end of turn
            if (
                not tail
                or len(reply_end) == len(through)  # the template does not render the reply's text
                or after_reply[: len(reply_end)] != reply_end
                or reply_end[-len(tail) :] != tail
            ):
                return Mismatch("calls_not_found")
        case CallsReplyAsText(request=whole, text_a=a, text_z=z):
            shared = shared_end(a, z)
            if shared in (0, len(a)):
                return Mismatch("reply_not_rendered")
            if shared >= len(whole) or whole[len(whole) - shared :] != a[len(a) - shared :]:
                return Mismatch("as_sent_differs")
            after_reply = whole[len(whole) - shared :]
            reply_end = tail = after_reply[:1]
    ended_on_stop = bool(sampled_ids) and sampled_ids[-1] == tail[0]
    end_of_turn = tail[1:] if ended_on_stop else tail
    prompt_ids = [*prefix_ids, *end_of_turn, *after_reply[len(reply_end) :]]
    if unasked_max_tokens is None:
        return Spliced(prompt_ids, None)
    max_tokens = unasked_max_tokens + len(whole) - len(prompt_ids)
    return Spliced(prompt_ids, max_tokens) if max_tokens >= 1 else Mismatch("no_room")
