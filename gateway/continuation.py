"""One rollout, one sequence: a call that continues its rollout reaches the engine as token ids.

A multi-step agent sends its whole history on every call. Rendered again by the chat template, the model's
earlier turns are not the tokens it sampled (vLLM's tool parser re-serializes arguments; BPE has many
tokenizations of one text), so each call would start a new sequence, and the model would be served (and
trained on) a history it never produced. A call *continues* its rollout when its messages are the previous
call's messages, then an assistant message that means what the model produced (store/trajectories.py
`message_key`: the same text, the same tool calls with JSON-equal arguments; dropped reasoning counts as the
same), then new messages, with the same tools and template options. Such a call is served through vLLM's
scale-out endpoints (`--enable-scale-out`):

    prompt = previous prompt ids + the sampled ids + the template's end of turn + the rendered new messages

The template may render the reply and the history before it otherwise than when the reply was sampled (Qwen3's
drops earlier turns' reasoning): the new messages' ids are found in the request's render, after the reply's turn,
with sentinel texts in the reply's place (`Splicer.splice`).
`/v1/chat/completions/render` gives the ids of the new messages and the sampling params (the tool-call grammar
included), `/inference/v1/generate` samples from the ids, `/v1/chat/completions/derender` turns its answer (or
a stream's chunks, as they come: `DerenderedStream`) back into a chat completion with vLLM's own tool-call and
reasoning parsers. The client gets what it would have got; the recorded prompt extends the previous call's prompt
and sampled ids, so the store assembles the rollout as one sequence. Anything else is served as before
(`rerender`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import string
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import msgspec

from engine.answers import Answer, DerenderedChoice, EngineAnswerError, RenderAnswer, StreamDerender, read
from gateway.adapters import Route
from gateway.splicing import CallsReply, CallsReplyAsText, Mismatch, Renders, TextReply, splice_ids, turn_tail
from store.records import CallRecord, RolloutKey
from store.trajectories import message_key, tools_key

log = logging.getLogger("artgw.gateway")

# How a call that continues its rollout was served (artgw_continued_calls_total{how}).
Served = Literal["spliced", "rerendered", "no_scale_out", "template_mismatch", "render_failed"]
# What a read of a rollout's last call from the store found (artgw_continuation_reads_total{found}).
StoreRead = Literal["found", "none", "failed"]

RENDER_PATH = "/v1/chat/completions/render"
GENERATE_PATH = "/inference/v1/generate"
DERENDER_PATH = "/v1/chat/completions/derender"
# Request fields besides the tools that change how the history renders: a call that changes one does not continue.
_RENDER_KEYS = ("chat_template", "chat_template_kwargs", "documents", "mm_processor_kwargs")
_PROMPT_TAIL = 8  # prompt ids derender reads (it seeds detokenization with the last few)
_DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams.max_tokens default, which its render's answer leaves out

_encode = msgspec.json.encode
_decode = msgspec.json.decode


def _canonical(value: Any) -> bytes:
    return msgspec.json.encode(value, order="sorted")


def render_key(request: dict[str, Any]) -> bytes:
    """What a call's history renders with besides its messages (a digest): the same for a call that continues."""
    key = tools_key(request.get("tools")) + _canonical([request.get(key) for key in _RENDER_KEYS])
    return hashlib.blake2b(key, digest_size=16).digest()


def _digest(message: dict[str, Any]) -> bytes:
    """A message's meaning (store/trajectories.py `message_key`) in 16 bytes: a 2 MB message is not kept twice."""
    return hashlib.blake2b(message_key(message), digest_size=16).digest()


def message_digests(request: dict[str, Any]) -> tuple[bytes, ...] | None:
    """Each message's digest, or None for a request without a messages list. A call's digests serve both to find
    what it continues and to remember it: computed once a call (gateway/proxy.py)."""
    messages = request.get("messages")
    return tuple(_digest(m) for m in messages) if isinstance(messages, list) else None


@dataclass(frozen=True, slots=True)
class LastCall:
    """What a rollout's last answered chat call left: enough to tell whether the next call continues it."""

    model: str | None
    step: int | None
    upstream_model: str
    render_key: bytes
    message_keys: tuple[bytes, ...]  # each message's digest
    prompt_ids: array[int]  # int32: 4 bytes a token
    replies: tuple[tuple[bytes, array[int]], ...]  # each choice: its message's digest and its sampled ids
    engine: str | None = None  # the engine that served it (CallRecord.engine): the rollout's next call goes there

    @property
    def size(self) -> int:
        """Bytes it holds, about: what the memory budget counts."""
        tokens = len(self.prompt_ids) + sum(len(ids) for _, ids in self.replies)
        return 4 * tokens + 16 * (len(self.message_keys) + len(self.replies)) + len(self.render_key) + 256


@dataclass(frozen=True, slots=True)
class Continued:
    """A call found to continue its rollout: the ids it goes on from and how many of its messages they cover."""

    prefix_ids: list[int]  # the previous prompt ids + the sampled ids of the reply sent back
    sampled_ids: list[int]
    history_len: int  # the previous call's messages + the reply


class Continuations:
    """Each rollout's last answered chat call, the newest rollouts first within `budget_bytes`, and whether a call
    continues it.

    Held in memory, and read from the store (`read`: store/calls.py `last_chat_call`) when memory does not hold
    it: after a restart, on another replica, or once pushed out by newer rollouts. Only a call that may continue
    its rollout is read for (an assistant message in its history with a message after it: never a rollout's
    first call), and only when memory does not hold what it goes on from, or holds an older call than the one
    its history shows (an assistant message after the held call's reply: a call another replica answered since).
    A call whose rollout's last call is had neither way is rendered anew, or spliced onto the newest call had
    (its history goes on past that call's reply: the call after it not written yet, or an assistant message
    the client added), and said not to have had it: where it starts a new sequence, its split says
    `state_lost`."""

    def __init__(
        self,
        budget_bytes: int = 64 << 20,
        read: Callable[[RolloutKey], Awaitable[CallRecord | None]] | None = None,
        read_seconds: float = 1.0,
        counted: Callable[[StoreRead], None] | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.read = read
        self.read_seconds = read_seconds  # a store slower than this: the call is rendered anew
        self.counted = counted  # each store read's outcome (artgw_continuation_reads_total{found})
        self._last: OrderedDict[RolloutKey, LastCall] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._last)

    def remember(self, record: CallRecord, digests: tuple[bytes, ...] | None = None) -> None:
        """A chat call of a rollout was answered: the next call of the rollout may continue it. `digests`: its
        request's `message_digests`, if already known."""
        last = _last_call(record, digests)
        if last is not None:
            self._keep(record.rollout_key, last)

    def _keep(self, rollout: RolloutKey, last: LastCall) -> None:
        replaced = self._last.pop(rollout, None)
        if replaced is not None:
            self._bytes -= replaced.size
        if last.size > self.budget_bytes:
            return  # one call larger than the whole budget: its rollout's next call is rendered anew
        self._last[rollout] = last
        self._bytes += last.size
        while self._bytes > self.budget_bytes:
            _, oldest = self._last.popitem(last=False)
            self._bytes -= oldest.size

    def find(
        self, rollout: RolloutKey, request: dict[str, Any], route: Route, digests: tuple[bytes, ...] | None = None
    ) -> Continued | None:
        """How `request` continues the rollout's last call held in memory, or None when it does not. `digests`:
        the request's `message_digests`, if already known."""
        last = self._last.get(rollout)
        if last is None:
            return None
        if digests is None:
            digests = message_digests(request)
        return _continued(last, request, route, digests)

    def engine_of(self, rollout: RolloutKey) -> str | None:
        """The engine that served the rollout's last call held (after `look_up`: the newest had), if known."""
        last = self._last.get(rollout)
        return None if last is None else last.engine

    async def look_up(
        self, rollout: RolloutKey, request: dict[str, Any], route: Route, digests: tuple[bytes, ...] | None
    ) -> tuple[Continued | None, bool]:
        """How `request` continues the rollout's last call (None: it does not), from memory or else the store,
        and whether that last call was had (CallRecord.rollout_known). `digests`: the request's."""
        last = self._last.get(rollout)
        if last is not None and not _after(last, request, digests):
            return _continued(last, request, route, digests), True
        if self.read is not None and _may_continue(request):
            stored = await self._read(rollout)
            newer = None if stored is None else _last_call(stored, None)
            if newer is not None and (last is None or len(newer.message_keys) > len(last.message_keys)):
                self._keep(rollout, newer)
                if not _after(newer, request, digests):
                    return _continued(newer, request, route, digests), True
                last = newer
        if last is None:
            return None, False
        # Its history goes on past the reply of the newest call had (the call after it not yet in the store, or
        # an assistant message the client added): spliced onto that one, which is not known to be the last.
        return _continued(last, request, route, digests), False

    async def _read(self, rollout: RolloutKey) -> CallRecord | None:
        """The rollout's last answered chat call from the store; None: none there, or the store failed or was
        slower than `read_seconds` (the call is served anyway, rendered anew)."""
        assert self.read is not None
        try:
            async with asyncio.timeout(self.read_seconds):
                stored = await self.read(rollout)
        except Exception as exc:  # the store away or slow: a continuation is never worth a failed call
            log.warning(
                "rollout %s: its last call could not be read from the store (%r); rendered anew", rollout.id, exc
            )
            self._count("failed")
            return None
        self._count("found" if stored is not None else "none")
        return stored

    def _count(self, found: StoreRead) -> None:
        if self.counted is not None:
            self.counted(found)

    @property
    def bytes(self) -> int:  # last in the class: above, it would shadow the builtin in annotations
        return self._bytes


def _last_call(record: CallRecord, digests: tuple[bytes, ...] | None) -> LastCall | None:
    """What an answered chat call leaves for its rollout's next call; None for any other call."""
    if record.status != "ok" or not record.choices:
        return None
    if digests is None:
        digests = message_digests(record.request)
    if digests is None:
        return None
    return LastCall(
        model=record.model,
        step=record.step,
        upstream_model=record.upstream_model,
        render_key=render_key(record.request),
        message_keys=digests,
        prompt_ids=array("i", record.prompt_token_ids),
        replies=tuple((_digest(c.message), array("i", c.token_ids)) for c in record.choices),
        engine=record.engine,
    )


def _goes_on(last: LastCall, digests: tuple[bytes, ...] | None) -> int | None:
    """The index of the reply in the request's messages when they are `last`'s then one of its replies, then at
    least one more; else None."""
    then = len(last.message_keys)
    if digests is None or len(digests) < then + 2 or digests[:then] != last.message_keys:
        return None
    return then if any(key == digests[then] for key, _ in last.replies) else None


def _after(last: LastCall, request: dict[str, Any], digests: tuple[bytes, ...] | None) -> bool:
    """Whether the request's history goes on from `last` past a later reply of the model: `last` is not the
    rollout's last call (another replica answered one since), and the request continues that one, if any."""
    reply = _goes_on(last, digests)
    return reply is not None and any(m.get("role") == "assistant" for m in request["messages"][reply + 1 :])


def _may_continue(request: dict[str, Any]) -> bool:
    """Whether the request may continue an earlier call: an assistant message after its first, then another."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        return False
    return any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages[1:-1])


def _continued(
    last: LastCall, request: dict[str, Any], route: Route, digests: tuple[bytes, ...] | None
) -> Continued | None:
    """How `request` continues `last`, or None when it does not."""
    if not last.prompt_ids:
        return None
    if (last.model, last.step, last.upstream_model) != (route.model, route.step, route.upstream_model):
        return None
    if request.get("continue_final_message") or request.get("add_generation_prompt") is False:
        return None
    then = _goes_on(last, digests)
    if then is None or render_key(request) != last.render_key:
        return None  # no new message after the reply, or other tools or template options
    assert digests is not None
    reply = digests[then]
    for key, sampled in last.replies:
        if key == reply and sampled:
            return Continued(last.prompt_ids.tolist() + sampled.tolist(), sampled.tolist(), then + 1)
    return None


class ScaleOutUnavailable(Exception):
    """The engine has no scale-out endpoints (vLLM started without --enable-scale-out)."""


@dataclass(frozen=True, slots=True)
class Splice:
    """A continuing call ready for `/inference/v1/generate`: its prompt ids and the engine requests."""

    prompt_ids: list[int]
    generate: dict[str, Any]  # /inference/v1/generate's request
    chat_request: dict[str, Any]  # the engine's chat request, which derender parses the answer for
    upstream_model: str
    _derender_head: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Encoded once a call, not once a chunk: what every derender request of the call starts with.
        head = {
            "model": self.upstream_model,
            "prompt_tokens": len(self.prompt_ids),
            "prompt_token_ids": self.prompt_ids[-_PROMPT_TAIL:],
            "chat_request": derender_chat_request(self.chat_request),
        }
        object.__setattr__(self, "_derender_head", _encode(head)[:-1])  # without its closing `}`

    def derender_request(self, **fields: Any) -> bytes:
        rest = _encode(fields)  # `{...}`: its fields go on after the head's
        return self._derender_head + (b"," + rest[1:] if len(rest) > 2 else b"}")


def derender_chat_request(request: dict[str, Any]) -> dict[str, Any]:
    """The engine's chat request as derender reads it: its parsers read the tools and the options, not the
    history, which would travel with every chunk of a stream. Of the history it keeps the assistant turns'
    tool calls (a parser numbering its call ids after the history's calls, as Kimi K2's does, counts them)."""
    calls = [
        {"role": "assistant", "content": None, "tool_calls": message["tool_calls"]}
        for message in request.get("messages") or ()
        if isinstance(message, dict) and message.get("role") == "assistant" and message.get("tool_calls")
    ]
    return {**request, "messages": calls}


class Splicer:
    """Builds the token ids a continuing call is served from, with the engine's render endpoint."""

    def __init__(self, session: aiohttp.ClientSession, upstream_url: str, timeout: aiohttp.ClientTimeout) -> None:
        self.session = session
        self.upstream_url = upstream_url
        self.timeout = timeout
        self.available: bool | None = None  # None: not known yet (probed at start, and on the first continuation)
        # by served model: the template's end of an assistant turn (None: it renders no history ending with one)
        self._tails: dict[str, list[int] | None] = {}
        self.fingerprint: str | None = None  # the engine's system_fingerprint (derender's answers have none)

    async def probe(self) -> bool:
        """Whether the engine serves the scale-out endpoints: vLLM answers 403 to them without the flag."""
        try:
            async with self.session.post(
                self.upstream_url + RENDER_PATH, data=b"{}", headers=_JSON, timeout=self.timeout
            ) as answer:
                status = answer.status
        except (aiohttp.ClientError, OSError, TimeoutError):
            return bool(self.available)  # unreachable now: not an answer
        self.available = status not in (403, 404, 405)
        if not self.available:
            log.warning(
                "the engine at %s has no scale-out endpoints (HTTP %d; vLLM needs --enable-scale-out): calls that "
                "continue their rollout are rendered anew, and each starts a new sequence",
                self.upstream_url,
                status,
            )
        return self.available

    async def splice(self, upstream: dict[str, Any], continued: Continued, stream: bool) -> Splice | Served:
        """The splice of a continuing call (`upstream`: the engine's chat request), or why it is not spliced.

        The renders are asked for here, and read by gateway/splicing.py `splice_ids` (pure): where the reply's turn
        ends in the request's render is found without assuming the template renders the reply, or the history
        before it, as it did when the reply was sampled (Qwen3's drops an earlier turn's reasoning; a template may
        wrap tool calls in its own markers)."""
        if self.available is None:
            await self.probe()
        if not self.available:
            return "no_scale_out"
        model = str(upstream["model"])
        options = {key: upstream[key] for key in ("tools", *_RENDER_KEYS) if key in upstream}
        messages, reply_at = upstream["messages"], continued.history_len - 1
        # A reply of text only: the request with each sentinel as its text (`TextReply`). A reply with tool calls:
        # the history through it too (`CallsReply`); where the template renders no history ending with an assistant
        # turn (mistral_common's, which also refuses text beside tool calls), the request as sent and with a text
        # reply of each sentinel in the reply's place (`CallsReplyAsText`).
        calls = bool(messages[reply_at].get("tool_calls"))
        try:
            tail = await self._tail(model, options) if calls else None
            if not calls:
                requests = [{**upstream, "messages": _with_reply(messages, reply_at, s)} for s in _SENTINELS]
            elif tail is not None:
                history = {**options, "model": model, "add_generation_prompt": False}
                requests = [
                    {**request, "messages": _with_reply(messages[:end], reply_at, sentinel)}
                    for request, end in ((upstream, None), (history, reply_at + 1))
                    for sentinel in _SENTINELS
                ]
            else:
                requests = [upstream] + [
                    {**upstream, "messages": [*messages[:reply_at], _assistant(s), *messages[reply_at + 1 :]]}
                    for s in _SENTINELS
                ]
            rendered = await asyncio.gather(*map(self._render, requests))
        except ScaleOutUnavailable:
            self.available = False
            return "no_scale_out"
        except _RenderFailed:
            return "render_failed"
        ids = [answer.token_ids for answer, _ in rendered]
        renders: Renders
        if not calls:
            renders = TextReply(request_a=ids[0], request_z=ids[1])
        elif tail is not None:
            renders = CallsReply(request_a=ids[0], request_z=ids[1], through_a=ids[2], through_z=ids[3], tail=tail)
        else:
            renders = CallsReplyAsText(request=ids[0], text_a=ids[1], text_z=ids[2])
        # The first render serves for the sampling params: they do not depend on the history's text.
        generate = {k: v for k, v in rendered[0][1].items() if k not in ("token_offsets", "request_id")}
        params = generate.setdefault("sampling_params", {})
        # The render leaves out a param at its default (max_tokens 16), and generate takes one left out as unasked:
        # it would sample to the end of the context.
        params.setdefault("max_tokens", _DEFAULT_MAX_TOKENS)
        asked = upstream.get("max_completion_tokens") or upstream.get("max_tokens")
        # vLLM's default is what the context leaves after the prompt it rendered; the splice is another length
        unasked = params["max_tokens"] if asked is None and isinstance(params.get("max_tokens"), int) else None
        spliced = splice_ids(renders, continued.prefix_ids, continued.sampled_ids, unasked_max_tokens=unasked)
        if isinstance(spliced, Mismatch):
            return spliced.reason
        if spliced.max_tokens is not None:
            params["max_tokens"] = spliced.max_tokens
        prompt_ids = spliced.prompt_ids
        generate["token_ids"] = prompt_ids
        generate["stream"] = stream
        generate["stream_options"] = upstream.get("stream_options") if stream else None  # usage only when asked
        return Splice(prompt_ids, generate, upstream, model)

    async def derender(self, generated: dict[str, Any], splice: Splice) -> dict[str, Any]:
        """`/inference/v1/generate`'s whole answer -> the chat completion the engine would have answered, with
        the prompt ids it was sampled from and each choice's sampled ids (what the recorder keeps)."""
        request = splice.chat_request
        read(generated, Answer)  # what vLLM's generate sends: the reads below hold
        sampled = {c.get("index", 0): c for c in generated.get("choices") or ()}
        shown = {index: _shown_ids(c, request) for index, c in sampled.items()}
        # an answer of its stop token only is sent whole (derender refuses no ids) and its text dropped below
        to_derender = [{**c, "token_ids": shown[index] or c.get("token_ids")} for index, c in sampled.items()]
        asked = splice.derender_request(generate_response={**generated, "choices": to_derender})
        reply = await self.post_derender(asked)
        completion: dict[str, Any] = _decode(reply)  # the client's answer, fields the gateway does not know included
        read(completion, Answer)  # what vLLM's derender sends: the reads below (and the recorder's) hold
        completion["id"] = chat_id()
        completion["system_fingerprint"] = self.fingerprint
        completion["prompt_token_ids"] = splice.prompt_ids
        usage = completion.get("usage")
        if isinstance(usage, dict):  # derender counts the ids it was given: the stop token counts as sampled
            usage["completion_tokens"] = sum(len(c.get("token_ids") or ()) for c in sampled.values())
            usage["total_tokens"] = (usage.get("prompt_tokens") or 0) + usage["completion_tokens"]
        choices = completion.get("choices") or ()
        calls = [call for choice in choices for call in (choice.get("message") or {}).get("tool_calls") or ()]
        if calls:  # derender names them 16 hex digits, whatever the model: named as vLLM's chat names them
            mistral = await self._renders_mistral(splice)
            for call in calls:
                call["id"] = tool_call_id(mistral=mistral)
        for choice in choices:
            index = choice.get("index", 0)
            engine = sampled.get(index) or {}
            choice["token_ids"] = engine.get("token_ids") or []
            choice["logprobs"] = _without_unasked_tops(choice.get("logprobs"), request)
            message = choice.get("message") or {}
            if not shown.get(index) and isinstance(message.get("content"), str):
                message["content"] = ""  # it sampled only its stop token
            called = bool(message.get("tool_calls"))
            choice["finish_reason"] = _finish_reason(engine.get("finish_reason"), called, request, streamed=False)
        return completion

    async def _renders_mistral(self, splice: Splice) -> bool:
        """Whether the engine renders the model's prompts with mistral_common, as its refusal to render a history
        that ends with an assistant turn says (`_tail`, learned once per model); not known: False."""
        options = {key: splice.chat_request[key] for key in _RENDER_KEYS if key in splice.chat_request}
        try:
            return await self._tail(splice.upstream_model, options) is None
        except (ScaleOutUnavailable, _RenderFailed):
            return False

    async def post_derender(self, body: bytes) -> bytes:
        """`/v1/chat/completions/derender`'s answer (its body); DerenderFailed with the engine's error."""
        async with self.session.post(
            self.upstream_url + DERENDER_PATH, data=body, headers=_JSON, timeout=self.timeout
        ) as answer:
            reply = await answer.read()
            if answer.status != 200:
                raise DerenderFailed(answer.status, reply)
        return reply

    def learn(self, fingerprint: str | None) -> None:
        """The engine's `system_fingerprint`, from one of its own chat answers (derender has none)."""
        if self.fingerprint is None and fingerprint:
            self.fingerprint = fingerprint

    async def _tail(self, model: str, options: dict[str, Any]) -> list[int] | None:
        """The ids the template puts after an assistant turn's text (`<|im_end|>\\n`), learned once per model and
        template options: what a one-turn history with each sentinel as the reply renders the same at its end.
        None: the engine refuses to render a history that ends with an assistant turn (mistral_common's)."""
        base = {key: options[key] for key in ("chat_template", "chat_template_kwargs") if key in options}
        key = model + _canonical(base).decode()
        if key not in self._tails:
            turns = [
                {**base, "model": model, "add_generation_prompt": False, "messages": [_ASKED, _assistant(sentinel)]}
                for sentinel in _SENTINELS
            ]
            try:
                a, b = (answer.token_ids for answer, _ in await asyncio.gather(*map(self._render, turns)))
            except _RenderRefused:
                self._tails[key] = None
            else:
                self._tails[key] = turn_tail(a, b)
        return self._tails[key]

    async def _render(self, request: dict[str, Any]) -> tuple[RenderAnswer, dict[str, Any]]:
        """The render of `request`: read, and as the engine sent it (what goes on to generate)."""
        try:
            async with self.session.post(
                self.upstream_url + RENDER_PATH, data=_encode(request), headers=_JSON, timeout=self.timeout
            ) as answer:
                body = await answer.read()
                status = answer.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _RenderFailed(type(exc).__name__) from None
        if status in (403, 404):
            raise ScaleOutUnavailable(status)
        if status == 400:
            raise _RenderRefused(f"HTTP {status}: {body[:500]!r}")
        if status != 200:
            raise _RenderFailed(f"HTTP {status}")
        try:
            rendered = _decode(body)
            if not isinstance(rendered, dict):
                raise EngineAnswerError(f"Expected `object`, got `{type(rendered).__name__}`")
            return read(rendered, RenderAnswer), rendered
        except (msgspec.DecodeError, EngineAnswerError) as exc:
            raise _RenderFailed(f"unreadable render answer: {exc}") from None


# Two texts for the reply's place in a render, ending differently: what their renders share at the end is what
# the template puts after the reply's text.
_SENTINELS = ("artgw reply sentinel A", "artgw reply sentinel Z")
_ASKED = {"role": "user", "content": "x"}


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def _with_reply(messages: list[dict[str, Any]], at: int, text: str) -> list[dict[str, Any]]:
    """`messages` with the one `at`'s text replaced by `text`: its role, tool calls and reasoning kept, so the
    template renders its turn as it renders the reply's."""
    return [*messages[:at], {**messages[at], "content": text}, *messages[at + 1 :]]


class _RenderFailed(Exception):
    pass


class _RenderRefused(_RenderFailed):
    """The engine refused the render as a bad request: what it is asked to render, not the engine, is at fault."""


class DerenderFailed(Exception):
    """The engine's derender answered an error (its status and body, for the client's error)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


_JSON = {"content-type": "application/json"}


class DerenderedStream:
    """`/inference/v1/generate`'s SSE stream, its chunks derendered into chat's as vLLM's chat stream has them:
    read by the relay (gateway/proxy.py) as it reads the engine's own chat stream. One derender state a choice.

    The engine's stream is read on while a derender is out, and what arrived meanwhile is derendered in one
    request a choice (its tokens in one delta, as vLLM's chat stream sends the tokens a slow reader let pile up):
    vLLM's parser derender replays a choice's whole output on every request, so one request a token would cost
    the engine O(n²) at length, and the stream would wait on each round trip. `logprobs`: the client asked for
    them (the recorder takes the sampled ones from the engine's chunk either way)."""

    def __init__(self, splicer: Splicer, upstream: aiohttp.ClientResponse, splice: Splice, *, logprobs: bool) -> None:
        self.splicer = splicer
        self.upstream = upstream
        self.splice = splice
        self.content = self
        self.id = chat_id()
        self.created = int(time.time())  # one for the whole stream, as vLLM's chat has it
        self.states: dict[int, Any] = {}  # each choice's derender state (the engine's own), once it has one
        self.called: set[int] = set()  # choices that streamed a tool call
        self.opened: set[tuple[int, int]] = set()  # (choice, call) whose arguments have begun
        self.logprobs_asked = logprobs
        self._arrived: list[_Arrived] = []  # read from the engine, not derendered yet
        self._wake = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    def release(self) -> None:
        self._stop_reading()
        self.upstream.release()

    def close(self) -> None:
        self._stop_reading()
        self.upstream.close()

    def _stop_reading(self) -> None:
        if self._reader is not None:
            self._reader.cancel()

    async def iter_any(self) -> AsyncIterator[bytes]:
        self._reader = asyncio.create_task(self._read())
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                arrived, self._arrived = self._arrived, []
                out, end = await self._derendered(arrived)
                if out:
                    yield b"".join(out)
                if isinstance(end, BaseException):
                    raise end
                if end is not None:
                    return
        finally:
            self._stop_reading()

    async def _read(self) -> None:
        """The engine's stream, line by line into `_arrived`, until it ends (`_ENDED`) or fails (its exception)."""
        pending = b""
        try:
            async for data in self.upstream.content.iter_any():
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].rstrip()
                    if payload == b"[DONE]":
                        self._arrived.append(_DONE)
                        continue
                    chunk = _decode(payload)
                    # the engine's error event goes on as it came, read by the relay as from chat
                    if "error" in chunk and "choices" not in chunk:
                        self._arrived.append(line)
                    else:
                        read(chunk, Answer)  # what vLLM's generate sends (EngineAnswerError: the relay's to say)
                        self._arrived.append(chunk)
                self._wake.set()
            self._arrived.append(_ENDED)
        except Exception as exc:  # the relay's to handle, after what came before it
            self._arrived.append(exc)
        self._wake.set()

    async def _derendered(self, arrived: list[_Arrived]) -> tuple[list[bytes], _Mark | Exception | None]:
        """The client's bytes for what arrived, and how the stream ended if it did. The choices' chunks between
        two other events are derendered together."""
        out: list[bytes] = []
        run: list[dict[str, Any]] = []
        for item in arrived:
            if isinstance(item, dict) and item.get("choices"):
                run.append(item)
                continue
            if run:
                out += map(_event_bytes, await self._choices_events(run))
                run = []
            if item is _DONE:
                out.append(b"data: [DONE]\n\n")
            elif isinstance(item, bytes):
                out.append(item + b"\n\n")
            elif isinstance(item, dict):
                out.append(_event_bytes(self._usage_event(item)))
            else:
                return out, item
        if run:
            out += map(_event_bytes, await self._choices_events(run))
        return out, None

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.splice.upstream_model,
        }

    def _usage_event(self, chunk: dict[str, Any]) -> dict[str, Any]:
        event = {**self._head(), "choices": [], "usage": chunk.get("usage")}
        if self.splicer.fingerprint is not None:
            event["system_fingerprint"] = self.splicer.fingerprint
        return event

    async def _choices_events(self, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat events of consecutive generate chunks: each choice's tokens in one event (its derender state
        is its own, so the choices are derendered side by side). A choice's first event is, as in vLLM's chat
        stream, its role alone."""
        merged: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}  # by index: a chunk and its one choice
        for chunk in chunks:
            for choice in chunk["choices"]:
                index = choice.get("index", 0)
                if index in merged:
                    _extend(merged[index][1], choice)
                else:
                    mine = {**choice, "token_ids": list(choice.get("token_ids") or ())}
                    merged[index] = (chunk, mine)
        head = self._head()
        first: list[dict[str, Any]] = []
        for index in merged:
            if index not in self.states:  # this choice's first event: its role alone, before it
                delta = {"role": "assistant", "content": ""}
                first.append({**head, "choices": [{"index": index, "delta": delta, "logprobs": None}]})
                first[-1]["choices"][0]["finish_reason"] = None
                if not self.states:  # the stream's first event carries the prompt ids, as vLLM's chat has it
                    first[-1]["prompt_token_ids"] = self.splice.prompt_ids
                self.states[index] = None
        shaped = await asyncio.gather(*(self._choice(head, chunk, choice) for chunk, choice in merged.values()))
        return [*first, *shaped]

    async def _choice(self, head: dict[str, Any], chunk: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
        index = choice.get("index", 0)
        one = {**chunk, "choices": [{**choice, "token_ids": _shown_ids(choice, self.splice.chat_request)}]}
        if self.logprobs_asked and choice.get("logprobs"):
            derendered, logprobs = await asyncio.gather(
                self._derender(one, self.states.get(index)), self._chat_logprobs(choice)
            )
        else:
            derendered, logprobs = await self._derender(one, self.states.get(index)), _bare(choice)
        self.states[index] = derendered.stream_state
        # none: the parser holds the text back (a tool call)
        out = derendered.chunk.choices[0] if derendered.chunk.choices else DerenderedChoice()
        shaped: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": out.finish_reason}
        shaped["delta"] = _delta(out.delta or {})
        _open_arguments(shaped["delta"], index, self.opened)
        if shaped["delta"].get("tool_calls"):
            self.called.add(index)
        if choice.get("finish_reason") is not None:  # the engine's, not derender's (it says tool_calls at length)
            shaped["finish_reason"] = _finish_reason(
                choice["finish_reason"], index in self.called, self.splice.chat_request, streamed=True
            )
            shaped["stop_reason"] = out.stop_reason
        shaped["token_ids"] = choice.get("token_ids") or []
        return {**head, "choices": [shaped]}

    async def _derender(self, chunk: dict[str, Any], state: Any) -> StreamDerender:
        body = self.splice.derender_request(stream=True, generate_chunk=chunk, stream_state=state)
        return read(await self.splicer.post_derender(body), StreamDerender)

    async def _chat_logprobs(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        """Chat's logprobs of a chunk's tokens (the streaming derender leaves them out when a tool parser is on):
        the whole-answer derender of just these tokens resolves them."""
        part = {"choices": [{**choice, "index": 0, "finish_reason": None}], "request_id": "logprobs"}
        derendered = _decode(await self.splicer.post_derender(self.splice.derender_request(generate_response=part)))
        read(derendered, Answer)  # the chat logprobs go on as the engine sent them
        choices = derendered.get("choices") or [{}]
        return _without_unasked_tops(choices[0].get("logprobs"), self.splice.chat_request)


class _Mark:
    """A mark among what the engine sent: its [DONE], or the end of its stream."""


_DONE, _ENDED = _Mark(), _Mark()
_Arrived = dict[str, Any] | bytes | _Mark | Exception


def _event_bytes(event: dict[str, Any]) -> bytes:
    return b"data: " + _encode(event) + b"\n\n"


def _extend(choice: dict[str, Any], later: dict[str, Any]) -> None:
    """A generate choice's delta, in place, followed by its `later` one: their tokens (and logprobs) as one."""
    choice["token_ids"] += later.get("token_ids") or ()
    more = (later.get("logprobs") or {}).get("content")
    if more:
        logprobs = choice.get("logprobs") or {"content": []}
        choice["logprobs"] = {**logprobs, "content": [*(logprobs.get("content") or ()), *more]}
    for key, value in later.items():
        if key not in ("index", "token_ids", "logprobs") and value is not None:
            choice[key] = value


def _finish_reason(reason: str | None, called: bool, request: dict[str, Any], *, streamed: bool) -> str | None:
    """The finish reason vLLM's chat gives for the engine's `reason` (derender 0.32 does not: it says `stop` for a
    `required` call, and in a stream `tool_calls` for any streamed call, even one `length` cut off). A stream says
    `tool_calls` only for calls that ended (`stop`) unforced by name; a whole answer for an `auto` choice's parsed
    calls, and for a `required` choice that ended."""
    choice = request.get("tool_choice")
    if streamed:
        ended_calls = called and reason == "stop" and not isinstance(choice, dict)
    else:
        ended_calls = (called and choice in (None, "auto")) or (choice == "required" and reason == "stop")
    return "tool_calls" if ended_calls else reason


def _shown_ids(choice: dict[str, Any], request: dict[str, Any]) -> list[int]:
    """The sampled ids of a generate choice that vLLM's chat turns into text: all but the stop token it ended on
    (its detokenizer skips that one unless `include_stop_str_in_output`). Derender keeps special tokens for the
    tool parser, so given the stop token it would show `<|im_end|>` in the answer."""
    ids: list[int] = choice.get("token_ids") or []
    stopped_on_token = choice.get("finish_reason") == "stop" and not isinstance(choice.get("stop_reason"), str)
    if ids and stopped_on_token and not request.get("include_stop_str_in_output"):
        return ids[:-1]
    return ids


def _delta(derendered: dict[str, Any]) -> dict[str, Any]:
    """A derendered delta as vLLM's chat stream has it: no role after the first event, no null fields (its tool
    call deltas name the id, type and name once; the OpenAI SDK refuses a `type: null`)."""
    delta = {k: v for k, v in derendered.items() if v is not None and k != "role"}
    if "tool_calls" in delta:
        calls = []
        for call in delta["tool_calls"]:
            call = {k: v for k, v in call.items() if v is not None}
            if isinstance(call.get("function"), dict):
                call["function"] = {k: v for k, v in call["function"].items() if v is not None}
            calls.append(call)
        delta["tool_calls"] = calls
    return delta


def _open_arguments(delta: dict[str, Any], index: int, opened: set[tuple[int, int]]) -> None:
    """A call's first arguments text, in place, from its JSON value on. vLLM 0.32's Mistral parser (tekken) streams
    a call's arguments once its object opens, from where its delta began: a derendered run that began between
    `"arguments"` and its `:` (`"arguments"\t:\n{"city"…`) came out as `:\n{"city"…`, which no JSON value starts
    with. vLLM's own chat stream, a token a delta, begins it at the `{`."""
    for call in delta.get("tool_calls") or ():
        arguments = (call.get("function") or {}).get("arguments")
        if not arguments or (index, call.get("index", 0)) in opened:
            continue
        opened.add((index, call.get("index", 0)))
        stripped = arguments.lstrip()
        if stripped.startswith(":"):
            call["function"]["arguments"] = stripped[1:].lstrip()


def tool_call_id(*, mistral: bool) -> str:
    """A tool call's id as vLLM's chat makes it: the Mistral parser's 9 alphanumeric characters (mistral_common
    takes no other in a later request), else `chatcmpl-tool-` and 16 hex digits."""
    if mistral:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"


def chat_id() -> str:
    """A chat completion's id as vLLM makes it (derender names its answers `generate-tokens-…`)."""
    return f"chatcmpl-{uuid.uuid4().hex[:16]}"


def _bare(choice: dict[str, Any]) -> dict[str, Any] | None:
    """The sampled tokens' logprobs for the recorder (the client did not ask for them: hidden on the way out)."""
    content = (choice.get("logprobs") or {}).get("content")
    if not content:
        return None
    return {"content": [{"token": "", "logprob": entry["logprob"], "top_logprobs": []} for entry in content]}


def _without_unasked_tops(logprobs: dict[str, Any] | None, request: dict[str, Any]) -> dict[str, Any] | None:
    """Derender lists the sampled token among its top logprobs when none were asked for; vLLM's chat lists none."""
    if logprobs and not request.get("top_logprobs"):
        for entry in logprobs.get("content") or ():
            entry["top_logprobs"] = []
    return logprobs
