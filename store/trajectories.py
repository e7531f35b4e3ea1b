"""Trajectory assembly: a rollout's recorded calls → token sequences for training.

Pure functions over recorded calls. Calls are taken in order; a call whose
prompt token ids extend the current sequence (its prompt + sampled completion)
token for token is merged into it: the new prompt tokens become context, the
new completion tokens are trainable. A call that does not extend it starts a
new sequence of the same trajectory, and the split says why. Training uses
the sampled token ids and the prompt ids vLLM saw: never re-tokenized text.
"""

from __future__ import annotations

import json
from typing import Any, Literal, get_args

import msgspec

from store.records import CallRecord, ChoiceRecord

# Why a call's prompt does not extend the sequence before it (the previous call's prompt and sampled tokens):
SplitCause = Literal[
    "rerendered",  # the history means what the model produced, but the template rendered it as other tokens
    "state_lost",  # the same, because the gateway that served it had not the rollout's last call (memory, store)
    "template_mismatch",  # the same, served as sent: the template's render did not show where the reply's turn ends
    "render_failed",  # the same, served as sent: the engine refused (or failed) a render the splice needs
    "no_scale_out",  # the same, served as sent: the engine has no scale-out endpoints (vLLM's --enable-scale-out)
    "dropped_reasoning",  # the model's reasoning is gone from the history (the client's or the template's doing)
    "edited",  # the client changed a message of the history (`split_reason` says which)
    "history_cut",  # the client sent fewer messages than the history (`split_reason` says how many)
    "system_changed",  # another system (or developer) prompt
    "tools_changed",  # other tools
    "new_attempt",  # the same history again: another completion of one prompt
    "other_choice",  # the history goes on from another choice of an n > 1 call than this rollout's
    "model_changed",  # another model (a base-model call in a model's rollout, or the other way round)
]
SPLIT_CAUSES: tuple[SplitCause, ...] = get_args(SplitCause)
SPLIT_RERENDERED = "the template rendered the model's earlier turns as other tokens than it sampled"
SPLIT_STATE_LOST = (
    "the gateway that served this call did not have the rollout's last call: not in its memory, and not in the "
    "store when this call came (not yet written by the replica, or the gateway before a restart, that answered "
    "it; or the store failed to answer in time), so it rendered the model's earlier turns anew"
)
SPLIT_DROPPED_REASONING = "the model's reasoning was dropped from the history"
_AS_SENT = "so the template rendered the model's earlier turns as other tokens than it sampled"
# A continuing call the gateway served as sent (CallRecord.continued, artgw_continued_calls_total{how}): the split's
# cause is the one it counted.
SPLIT_SERVED_AS_SENT: dict[str | None, tuple[SplitCause, str]] = {
    "template_mismatch": (
        "template_mismatch",
        f"served as sent: the template's render did not show where the model's reply ends, {_AS_SENT}",
    ),
    "render_failed": ("render_failed", f"served as sent: the engine refused a render the splice needs, {_AS_SENT}"),
    "no_scale_out": (
        "no_scale_out",
        f"served as sent: the engine has no scale-out endpoints (--enable-scale-out), {_AS_SENT}",
    ),
}
SPLIT_NEW_ATTEMPT = "the same history again: another completion of the previous call's prompt"


class Sequence(msgspec.Struct, frozen=True):
    token_ids: list[int]
    sampled_mask: list[int]  # 1: sampled by the model (trainable); 0: context
    logprobs: list[float | None]  # sampling logprob of each sampled token, None for context
    call_ids: list[str]  # the calls merged into this sequence, in order
    steps: list[int | None]  # adapter step that served each of call_ids
    split_reason: str | None  # why this sequence did not continue the previous one, in words (None: the first)
    sampled_spans: list[tuple[int, int]] = []  # [start, end) in token_ids of each call's sampled tokens
    split_cause: SplitCause | None = None  # the same, as a code (metrics count them)

    @property
    def trainable_tokens(self) -> int:
        return sum(self.sampled_mask)


class CallSummary(msgspec.Struct, frozen=True):
    id: str
    api: str  # the API the client spoke: chat, completions, responses or messages
    status: str
    step: int | None
    stream: bool
    n: int
    started_at: float
    ended_at: float
    finish_reasons: list[str | None]
    error: str | None = None
    retry_of: str | None = None  # an earlier call of the rollout with the identical request
    superseded: bool = False  # retried later with the identical request: training uses the last attempt
    choice: int | None = None  # which choice the rollout continued with (n > 1)
    constrained: bool = False  # sampled under a grammar: see `sampled_under_grammar`
    # A constrained call's request without its messages: what the trainer rebuilds vLLM's grammar from.
    grammar_request: dict[str, Any] | None = None
    key_id: str | None = None  # the API key that made the call (its id)
    engine: str | None = None  # the engine that served it (its base URL; None: recorded before it was kept)


class Trajectory(msgspec.Struct, frozen=True):
    rollout_id: str
    model: str | None
    messages: list[dict[str, Any]]  # the conversation as the last used call saw it, plus its reply
    tools: list[dict[str, Any]] | None
    sequences: list[Sequence]
    calls: list[CallSummary]
    trainable_tokens: int
    context_tokens: int
    owner: str = ""  # whose namespace `rollout_id` is in: the key that made it ("" for none; the admin's, --auth off's)


def sampled_under_grammar(request: dict[str, Any]) -> bool:
    """Whether vLLM (0.32, hermes tool parser, strict tool calling on) sampled this call under a grammar.

    A named or `required` tool_choice; `auto` with a `strict` tool or `parallel_tool_calls: false` (vLLM then
    constrains what follows `<tool_call>`); a JSON or structural-tag `response_format`; a constraint in
    `structured_outputs`. vLLM reports such tokens' logprobs after the grammar's mask, renormalized over the
    allowed tokens; the trainer rebuilds the grammar (trainer/grammar.py) to score them under the same mask.
    vLLM 0.32 ignores the removed `guided_*` fields: a call with them samples freely.
    """
    tools = request.get("tools") or []
    tool_choice = request.get("tool_choice", "auto" if tools else "none")
    if tools and tool_choice not in (None, "none"):
        if tool_choice != "auto":
            return True
        strict = any((tool.get("function") or {}).get("strict") for tool in tools if isinstance(tool, dict))
        if strict or request.get("parallel_tool_calls") is False:
            return True
    response_format = request.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in (
        "json_object",
        "json_schema",
        "structural_tag",
    ):
        return True
    structured = request.get("structured_outputs")
    constraints = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
    return isinstance(structured, dict) and any(structured.get(key) is not None for key in constraints)


def _without_messages(request: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in request.items() if key not in ("messages", "prompt")}


def _canonical(value: Any) -> bytes:
    return msgspec.json.encode(value, order="sorted")


def _text(content: Any) -> str:
    """A message's text: a string, or the text of its content parts (Anthropic's and Vercel's shape)."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""


def _arguments(arguments: Any) -> Any:
    """Tool-call arguments as a value: clients send back `{"city": "rome"}` for the model's `{"city":"rome"}`."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def message_key(message: dict[str, Any]) -> bytes:
    """What makes two messages the same turn: role, text and tool calls (names and JSON-equal arguments); ids,
    nulls, the content's shape and reasoning are ignored."""
    calls = [
        [(c.get("function") or {}).get("name"), _arguments((c.get("function") or {}).get("arguments"))]
        for c in message.get("tool_calls") or ()
    ]
    return _canonical([message.get("role"), _text(message.get("content")), calls])


def tools_key(tools: Any) -> bytes:
    """What makes two calls' tools the same: all but `strict` (the gateway makes a forced call's tools strict,
    gateway/apis/chat/translate.py; it changes what may be sampled, not the tools)."""
    if not isinstance(tools, list):
        return _canonical(tools)
    same = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and "strict" in function:
            tool = {**tool, "function": {k: v for k, v in function.items() if k != "strict"}}
        same.append(tool)
    return _canonical(same)


def _reasoning(message: dict[str, Any]) -> bool:
    return bool(message.get("reasoning") or message.get("reasoning_content"))


def _system(messages: list[dict[str, Any]]) -> list[bytes]:
    return [message_key(m) for m in messages if m.get("role") in ("system", "developer")]


def _split(previous: CallRecord, previous_choice: ChoiceRecord, call: CallRecord) -> tuple[SplitCause, str]:
    """Why `call` does not extend the sequence its rollout's previous call ended, judged from the requests."""
    if call.model != previous.model:
        return (
            "model_changed",
            f"another model: {call.model or 'the base model'}, after {previous.model or 'the base model'}",
        )
    if tools_key(call.request.get("tools")) != tools_key(previous.request.get("tools")):
        return "tools_changed", "other tools than the previous call's"
    if "messages" not in call.request or "messages" not in previous.request:  # completions: a prompt
        return _prompt_split(previous, previous_choice, call)
    then: list[dict[str, Any]] = previous.request.get("messages") or []
    now: list[dict[str, Any]] = call.request.get("messages") or []
    if _system(now) != _system(then):
        return "system_changed", "another system prompt than the previous call's"
    keys_then, keys_now = [message_key(m) for m in then], [message_key(m) for m in now]
    if keys_now == keys_then:
        return "new_attempt", SPLIT_NEW_ATTEMPT
    for k, (a, b) in enumerate(zip(keys_then, keys_now, strict=False)):
        if a != b:
            return "edited", f"the client edited message {k} ({now[k].get('role')}) of the history"
    if len(now) < len(then):
        return "history_cut", f"the client sent {len(now)} of the history's {len(then)} messages"
    reply = now[len(then)] if len(now) > len(then) else None
    if reply is None or message_key(reply) != message_key(previous_choice.message):
        others = [c.index for c in previous.choices if c is not previous_choice]
        match = next(
            (c.index for c in previous.choices if reply and message_key(c.message) == message_key(reply)), None
        )
        if match is not None and match in others:
            return "other_choice", f"the history goes on from choice {match}, not choice {previous_choice.index}"
        role = reply.get("role") if reply is not None else "none"
        return "edited", f"the client edited message {len(then)} ({role}), the model's reply"
    if call.continued in SPLIT_SERVED_AS_SENT:
        return SPLIT_SERVED_AS_SENT[call.continued]
    if _reasoning(previous_choice.message) and not _reasoning(reply):
        return "dropped_reasoning", SPLIT_DROPPED_REASONING
    if call.rollout_known is False:
        return "state_lost", SPLIT_STATE_LOST
    return "rerendered", SPLIT_RERENDERED


def _prompt_split(previous: CallRecord, previous_choice: ChoiceRecord, call: CallRecord) -> tuple[SplitCause, str]:
    before, now = previous.request.get("prompt"), call.request.get("prompt")
    if _canonical(now) == _canonical(before):
        return "new_attempt", SPLIT_NEW_ATTEMPT
    sampled = _text(previous_choice.message.get("content"))
    if isinstance(before, str) and isinstance(now, str) and now.startswith(before + sampled):
        return "rerendered", "the prompt's text goes on from the previous call's, but tokenizes otherwise"
    return "edited", "a prompt that does not go on from the previous call's prompt and completion"


def _extends(prompt: list[int], tokens: list[int]) -> bool:
    return len(prompt) >= len(tokens) and prompt[: len(tokens)] == tokens


def _mark_retries(calls: list[CallRecord]) -> tuple[dict[str, str], set[str]]:
    """Identical requests within a rollout: later ones are retries of the first; all but the last are superseded."""
    first: dict[bytes, str] = {}
    last: dict[bytes, str] = {}
    retry_of: dict[str, str] = {}
    for call in calls:
        key = _canonical({k: v for k, v in call.request.items() if k not in ("stream", "stream_options")})
        if key in first:
            retry_of[call.call_id] = first[key]
        else:
            first[key] = call.call_id
        last[key] = call.call_id
    retried = set(retry_of.values()) | set(retry_of)
    superseded = retried - set(last.values())
    return retry_of, superseded


def assemble(rollout_id: str, calls: list[CallRecord], choice: int | None = None) -> Trajectory:
    """Assemble a rollout from its calls (any order; sorted by start time here).

    `choice` picks that choice of every n > 1 call: the rollout `"<id>/<choice>"` of a group made
    from one call's several choices.
    """
    calls = sorted(calls, key=lambda c: (c.started_at, c.call_id))
    retry_of, superseded = _mark_retries(calls)
    usable = [c for c in calls if c.status == "ok" and c.choices and c.call_id not in superseded]

    sequences: list[dict[str, Any]] = []
    chosen: dict[str, int] = {}
    previous: tuple[CallRecord, ChoiceRecord] | None = None
    for i, call in enumerate(usable):
        picked = _choose(call, usable[i + 1] if i + 1 < len(usable) else None, choice)
        chosen[call.call_id] = picked.index
        prompt = call.prompt_token_ids
        current = sequences[-1] if sequences else None
        if current is not None and _extends(prompt, current["token_ids"]):
            context = prompt[len(current["token_ids"]) :]
            split = None
        else:
            current = None
            context = prompt
            split = _split(*previous, call) if previous is not None else None
        if current is None:
            current = {"token_ids": [], "sampled_mask": [], "logprobs": [], "call_ids": [], "steps": []}
            current["split_cause"], current["split_reason"] = split or (None, None)
            current["sampled_spans"] = []
            sequences.append(current)
        start = len(current["token_ids"]) + len(context)
        current["sampled_spans"].append((start, start + len(picked.token_ids)))
        current["token_ids"] += context + picked.token_ids
        current["sampled_mask"] += [0] * len(context) + [1] * len(picked.token_ids)
        current["logprobs"] += [None] * len(context) + list(picked.logprobs)
        current["call_ids"].append(call.call_id)
        current["steps"].append(call.step)
        previous = (call, picked)

    built = [Sequence(**s) for s in sequences]
    summaries = [
        CallSummary(
            id=c.call_id,
            api=c.api,
            key_id=c.key_id,
            engine=c.engine,
            status=c.status,
            step=c.step,
            stream=c.stream,
            n=len(c.choices),
            started_at=c.started_at,
            ended_at=c.ended_at,
            finish_reasons=[ch.finish_reason for ch in c.choices],
            error=c.error,
            retry_of=retry_of.get(c.call_id),
            superseded=c.call_id in superseded,
            choice=chosen.get(c.call_id),
            constrained=sampled_under_grammar(c.request),
            grammar_request=_without_messages(c.request) if sampled_under_grammar(c.request) else None,
        )
        for c in calls
    ]
    messages: list[dict[str, Any]] = []
    tools = None
    if previous is not None:
        last_call, last_choice = previous
        messages = [*last_call.request.get("messages", []), last_choice.message]
        tools = last_call.request.get("tools")
    trainable = sum(s.trainable_tokens for s in built)
    return Trajectory(
        rollout_id=rollout_id,
        model=next((c.model for c in calls if c.model), None),
        messages=messages,
        tools=tools,
        sequences=built,
        calls=summaries,
        trainable_tokens=trainable,
        context_tokens=sum(len(s.token_ids) for s in built) - trainable,
    )


def _choose(call: CallRecord, following: CallRecord | None, wanted: int | None) -> ChoiceRecord:
    """With n > 1: the `wanted` choice, else the one the next call continued (by tokens), else the first."""
    if wanted is not None and len(call.choices) > 1:
        return next((c for c in call.choices if c.index == wanted), call.choices[0])
    if len(call.choices) > 1 and following is not None:
        for choice in call.choices:
            if _extends(following.prompt_token_ids, call.prompt_token_ids + choice.token_ids):
                return choice
        # Not by tokens (the template rendered the reply anew): the choice the next call sent back as the reply.
        history = call.request.get("messages") or []
        sent = following.request.get("messages") or []
        if len(sent) > len(history):
            reply = message_key(sent[len(history)])
            return next((c for c in call.choices if message_key(c.message) == reply), call.choices[0])
    return call.choices[0]
