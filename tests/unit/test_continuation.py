"""Which call continues its rollout (gateway/continuation.py `Continuations`): pure, over call records."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from engine.answers import EngineAnswerError
from gateway.adapters import Route
from gateway.continuation import (
    DERENDER_PATH,
    GENERATE_PATH,
    Continuations,
    Continued,
    DerenderedStream,
    Splice,
    Splicer,
    message_digests,
)
from store.records import CallRecord, ChoiceRecord, RolloutKey
from store.trajectories import tools_key
from tests.conftest import serving

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}
ROUTE = Route("my-agent@2", "my-agent", 2)


def _record(messages: list[dict[str, Any]], replies: list[dict[str, Any]], **fields: Any) -> CallRecord:
    base: dict[str, Any] = dict(
        call_id="c1",
        rollout_id="r1",
        rollout_explicit=True,
        model="my-agent",
        step=2,
        upstream_model="my-agent@2",
        request={"model": "my-agent", "messages": messages, "tools": [TOOL]},
        stream=False,
        status="ok",
        http_status=200,
        error=None,
        prompt_token_ids=[1, 2, 3],
        choices=[ChoiceRecord(i, reply, "stop", [10 + i, 11 + i], [-0.1, -0.2]) for i, reply in enumerate(replies)],
        usage=None,
        started_at=1.0,
        first_token_at=1.5,
        ended_at=2.0,
    )
    return CallRecord(**{**base, **fields})


USER = {"role": "user", "content": "weather?"}
REPLY = {"role": "assistant", "content": "", "tool_calls": [CALL]}
# What a client sends back for it: its own id and whitespace, content null, the reasoning gone.
SENT_BACK = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{**CALL, "id": "other", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def _continuations(*records: CallRecord) -> Continuations:
    remembered = Continuations()
    for record in records:
        remembered.remember(record)
    return remembered


def _request(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": "my-agent", "messages": messages, "tools": [TOOL], **fields}


def test_a_call_sending_back_the_reply_then_new_messages_continues_from_the_sampled_ids() -> None:
    remembered = _continuations(_record([USER], [{**REPLY, "reasoning": "think"}]))
    continued = remembered.find(RolloutKey("", "r1"), _request([USER, SENT_BACK, RESULT]), ROUTE)
    assert continued is not None
    assert continued.prefix_ids == [1, 2, 3, 10, 11]
    assert continued.sampled_ids == [10, 11]
    assert continued.history_len == 2


def test_the_reply_of_another_choice_continues_from_that_choice() -> None:
    other = {"role": "assistant", "content": "no tool"}
    remembered = _continuations(_record([USER], [REPLY, other]))
    continued = remembered.find(
        RolloutKey("", "r1"), _request([USER, other, {"role": "user", "content": "and?"}]), ROUTE
    )
    assert continued is not None and continued.sampled_ids == [11, 12]


def test_a_gateway_made_strict_flag_is_the_same_tools() -> None:
    strict = {**TOOL, "function": {**TOOL["function"], "strict": True}}
    assert tools_key([strict]) == tools_key([TOOL])
    remembered = _continuations(_record([USER], [REPLY], request=_request([USER], tools=[strict])))
    assert remembered.find(RolloutKey("", "r1"), _request([USER, SENT_BACK, RESULT]), ROUTE) is not None


def test_calls_that_do_not_continue() -> None:
    remembered = _continuations(_record([USER], [REPLY]))
    edited_reply = {**SENT_BACK, "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": "{}"}}]}
    other_tools = [{**TOOL, "function": {**TOOL["function"], "name": "get_time"}}]
    cases = {
        "edited history": _request([{"role": "user", "content": "other"}, SENT_BACK, RESULT]),
        "edited reply": _request([USER, edited_reply, RESULT]),
        "no new message": _request([USER, SENT_BACK]),
        "the same history again": _request([USER]),
        "other tools": _request([USER, SENT_BACK, RESULT], tools=other_tools),
        "other template options": _request([USER, SENT_BACK, RESULT], chat_template_kwargs={"enable_thinking": 1}),
        "continue the final message": _request([USER, SENT_BACK, RESULT], continue_final_message=True),
    }
    for name, request in cases.items():
        assert remembered.find(RolloutKey("", "r1"), request, ROUTE) is None, name
    other_step = Route("my-agent@3", "my-agent", 3)
    assert remembered.find(RolloutKey("", "r1"), _request([USER, SENT_BACK, RESULT]), other_step) is None
    assert remembered.find(RolloutKey("", "r2"), _request([USER, SENT_BACK, RESULT]), ROUTE) is None  # another rollout


def test_another_owners_rollout_of_the_same_id_is_not_continued() -> None:
    """Rollout ids are per owner (#40): key_b's call naming `r1` never continues (splices into) key_a's `r1`."""
    remembered = _continuations(_record([USER], [REPLY], key_id="key_a"))
    request = _request([USER, SENT_BACK, RESULT])
    assert remembered.find(RolloutKey("key_a", "r1"), request, ROUTE) is not None
    assert remembered.find(RolloutKey("key_b", "r1"), request, ROUTE) is None
    assert remembered.find(RolloutKey("", "r1"), request, ROUTE) is None


def test_only_answered_calls_are_remembered_and_the_newest_rollouts_kept_within_the_budget() -> None:
    failed = _record([USER], [], status="upstream_error", http_status=502)
    assert len(_continuations(failed)) == 0
    one = _continuations(_record([USER], [REPLY])).bytes
    remembered = Continuations(budget_bytes=2 * one)
    for rid in ("a", "b", "c", "c"):
        remembered.remember(_record([USER], [REPLY], rollout_id=rid))
    assert len(remembered) == 2 and remembered.bytes == 2 * one
    assert remembered.find(RolloutKey("", "a"), _request([USER, SENT_BACK, RESULT]), ROUTE) is None
    assert remembered.find(RolloutKey("", "c"), _request([USER, SENT_BACK, RESULT]), ROUTE) is not None
    # A message is kept as a digest: a 2 MB history costs the budget what a short one does.
    big = {"role": "user", "content": "x" * (2 << 20)}
    assert _continuations(_record([big], [REPLY])).bytes == one


# -- the rollout's last call read from the store (a restart, another replica) ----------------------------------

REPLY_2 = {"role": "assistant", "content": "It is sunny in Rome."}
MORE = {"role": "user", "content": "And Paris?"}


class _Store:
    """The store's `last_chat_call` over the records a replica has written, counting the reads."""

    def __init__(self, *records: CallRecord, fails: bool = False) -> None:
        self.records = {r.rollout_key: r for r in records}
        self.fails = fails
        self.reads = 0

    async def __call__(self, rollout: RolloutKey) -> CallRecord | None:
        self.reads += 1
        if self.fails:
            raise ConnectionError("the store is away")
        return self.records.get(rollout)


def _look_up(
    continuations: Continuations, request: dict[str, Any], route: Route = ROUTE
) -> tuple[Continued | None, bool]:
    return asyncio.run(continuations.look_up(RolloutKey("", "r1"), request, route, message_digests(request)))


def test_a_call_not_held_is_continued_from_the_store_and_a_first_call_reads_nothing() -> None:
    store = _Store(_record([USER], [REPLY]))
    counted: list[str] = []
    continuations = Continuations(read=store, counted=counted.append)
    assert _look_up(continuations, _request([USER])) == (None, False)  # a rollout's first call
    assert store.reads == 0
    continued, known = _look_up(continuations, _request([USER, SENT_BACK, RESULT]))
    assert known and continued is not None and continued.prefix_ids == [1, 2, 3, 10, 11]
    assert (store.reads, counted) == (1, ["found"])
    # Now held: the next call that goes on from it reads nothing.
    assert _look_up(continuations, _request([USER, SENT_BACK, RESULT])) == (continued, True)
    assert store.reads == 1


def test_a_held_call_older_than_the_history_is_read_again() -> None:
    """Calls alternating between two replicas: this one holds the rollout's first call, the other answered the
    second (now in the store); the third goes on from the second's reply, past the first's."""
    first = _record([USER], [REPLY])
    second = _record(
        [USER, SENT_BACK, RESULT], [REPLY_2], call_id="c2", prompt_token_ids=[1, 2, 3, 10, 11, 4], ended_at=3.0
    )
    store = _Store(second)
    continuations = Continuations(read=store)
    continuations.remember(first)
    continued, known = _look_up(continuations, _request([USER, SENT_BACK, RESULT, REPLY_2, MORE]))
    assert known and store.reads == 1
    assert continued is not None and continued.prefix_ids == [1, 2, 3, 10, 11, 4, 10, 11]
    # The history the held call continues, with no later reply in it: no read.
    assert _look_up(continuations, _request([USER, SENT_BACK, RESULT, REPLY_2, MORE]))[1]
    assert store.reads == 1


def test_a_last_call_had_neither_way_is_not_known() -> None:
    """What the split says `state_lost` for: the store does not hold the call the history goes on from yet
    (the replica that answered it has not written it), or cannot be read in time."""
    history = _request([USER, SENT_BACK, RESULT, REPLY_2, MORE])
    counted: list[str] = []
    # The call before the one the history goes on from: spliced onto it, not known to be the rollout's last.
    not_yet = Continuations(read=_Store(_record([USER], [REPLY])), counted=counted.append)
    continued, known = _look_up(not_yet, history)
    assert not known and continued is not None and continued.prefix_ids == [1, 2, 3, 10, 11]
    assert _look_up(Continuations(read=_Store(), counted=counted.append), history) == (None, False)
    away = _Store(_record([USER], [REPLY]), fails=True)
    assert _look_up(Continuations(read=away, counted=counted.append), _request([USER, SENT_BACK, RESULT])) == (
        None,
        False,
    )
    assert counted == ["found", "none", "failed"]
    # Without a store to read (--continuity rerender): memory only, as before.
    assert _look_up(Continuations(), _request([USER, SENT_BACK, RESULT])) == (None, False)


def test_an_assistant_message_the_client_added_is_still_spliced_onto_the_held_call() -> None:
    """The store holds nothing newer than memory: the call goes on from the held call (as it did before the
    store was read), though it is not known to be the rollout's last."""
    first = _record([USER], [REPLY])
    store = _Store(first)
    continuations = Continuations(read=store)
    continuations.remember(first)
    added = {"role": "assistant", "content": "(the client's note)"}
    continued, known = _look_up(continuations, _request([USER, SENT_BACK, RESULT, added, MORE]))
    assert continued is not None and continued.prefix_ids == [1, 2, 3, 10, 11] and not known
    assert store.reads == 1


def test_a_store_slower_than_the_budget_is_not_waited_for() -> None:
    class Slow(_Store):
        async def __call__(self, rollout: RolloutKey) -> CallRecord | None:
            await asyncio.sleep(30)
            return await super().__call__(rollout)

    counted: list[str] = []
    continuations = Continuations(read=Slow(_record([USER], [REPLY])), read_seconds=0.05, counted=counted.append)
    assert _look_up(continuations, _request([USER, SENT_BACK, RESULT])) == (None, False)
    assert counted == ["failed"]


def test_a_derender_request_carries_the_tools_and_options_but_not_the_history() -> None:
    history = [USER, REPLY, RESULT, {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "x"}]
    request = _request(history, tool_choice="auto", logprobs=True, chat_template_kwargs={"enable_thinking": False})
    splice = Splice(list(range(100)), {}, request, "my-agent@2")
    body = msgspec.json.decode(splice.derender_request(stream=True, stream_state=None))
    # the history's tool calls stay: a parser may number its call ids after them
    chat = {**request, "messages": [{"role": "assistant", "content": None, "tool_calls": [CALL]}]}
    assert body == {
        "model": "my-agent@2",
        "prompt_tokens": 100,
        "prompt_token_ids": list(range(92, 100)),
        "chat_request": chat,
        "stream": True,
        "stream_state": None,
    }
    assert msgspec.json.decode(splice.derender_request())["chat_request"] == chat


class _StandInEngine:
    """vLLM's generate stream (one token a chunk) and its derender: the stream's first token, then, once its
    derender is asked for, all the others, which the derender waits for before it answers."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.asked = asyncio.Event()
        self.written = asyncio.Event()
        self.derenders: list[dict[str, Any]] = []

    async def generate(self, request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await answer.prepare(request)
        for i in range(self.tokens):
            finish = "length" if i == self.tokens - 1 else None
            logprobs = {"content": [{"token_id": 300 + i, "logprob": -0.5, "top_logprobs": []}]}
            choice = {"index": 0, "token_ids": [300 + i], "logprobs": logprobs, "finish_reason": finish}
            await answer.write(b"data: " + msgspec.json.encode({"choices": [choice]}) + b"\n\n")
            if i == 0:
                await self.asked.wait()
        await answer.write(b"data: [DONE]\n\n")
        await answer.write_eof()
        self.written.set()
        return answer

    async def derender(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.derenders.append(body)
        self.asked.set()
        await self.written.wait()
        if "generate_response" in body:  # a whole answer's derender: for chat's logprobs
            return web.json_response({"choices": [{"index": 0, "logprobs": {"content": []}}]})
        ids = body["generate_chunk"]["choices"][0]["token_ids"]
        state = (body["stream_state"] or {"output_token_ids": []})["output_token_ids"] + ids
        choice = {"index": 0, "delta": {"content": "".join(f"<{i}>" for i in ids)}}
        return web.json_response({"chunk": {"choices": [choice]}, "stream_state": {"output_token_ids": state}})


async def test_a_stream_derenders_the_tokens_that_arrived_together_in_one_request() -> None:
    engine = _StandInEngine(tokens=50)
    async with serving({GENERATE_PATH: engine.generate, DERENDER_PATH: engine.derender}) as url:
        async with aiohttp.ClientSession() as session:
            splicer = Splicer(session, url, aiohttp.ClientTimeout(total=30))
            splice = Splice([1, 2, 3], {}, _request([USER], logprobs=True), "my-agent@2")
            async with session.post(url + GENERATE_PATH, json={}) as answer:
                stream = DerenderedStream(splicer, answer, splice, logprobs=False)
                body = b"".join([chunk async for chunk in stream.iter_any()])
    events = [msgspec.json.decode(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: {")]
    (role, *choices) = [event["choices"][0] for event in events]
    assert role["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["delta"]["content"] for c in choices) == "".join(f"<{300 + i}>" for i in range(50))
    assert [i for c in choices for i in c["token_ids"]] == list(range(300, 350))
    assert [e["logprob"] for c in choices for e in c["logprobs"]["content"]] == [-0.5] * 50  # the recorder's
    assert choices[-1]["finish_reason"] == "length"
    assert body.endswith(b"data: [DONE]\n\n")
    # the first token alone (nothing else had come), then what came while its derender was out; no request for
    # the chat logprobs the client did not ask for
    assert 2 <= len(engine.derenders) <= 3 and all("generate_chunk" in body for body in engine.derenders)


class _MistralRender:
    """vLLM's render endpoint in `--tokenizer-mode mistral`: mistral_common renders the request (with Mistral NeMo's
    tekken, as the tiny Mistral model has it) and the engine answers 400 for what it refuses: a history that ends
    with an assistant turn, an assistant message with both text and tool calls."""

    def __init__(self) -> None:
        import mistral_common
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        data = Path(mistral_common.__file__).parent / "data"
        self.mistral = MistralTokenizer.from_file(str(data / "tekken_240718.json"))
        self.tekken = self.mistral.instruct_tokenizer.tokenizer

    def ids(self, request: dict[str, Any]) -> list[int]:
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        chat = ChatCompletionRequest.from_openai(request["messages"], tools=request.get("tools"))
        return list(self.mistral.encode_chat_completion(chat).tokens)

    async def render(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            ids = self.ids(body)
        except Exception as exc:  # mistral_common's refusal: vLLM's 400
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        return web.json_response({"token_ids": ids, "sampling_params": {"max_tokens": 16}, "model": body["model"]})


async def _splice_on(engine: _MistralRender, sent: dict[str, Any], previous: list[int], sampled: list[int]) -> object:
    """The splice of `sent` continuing a call whose prompt was `previous` and which sampled `sampled`, against
    `engine`'s render endpoint."""
    async with serving({"/v1/chat/completions/render": engine.render}) as url:
        async with aiohttp.ClientSession() as session:
            splicer = Splicer(session, url, aiohttp.ClientTimeout(total=30))
            splicer.available = True
            return await splicer.splice(sent, Continued(previous + sampled, sampled, 2), stream=False)


async def test_a_tool_call_reply_is_spliced_where_the_template_renders_no_history_ending_with_it() -> None:
    """mistral_common renders no history through a reply, nor the reply's tool calls beside a sentinel text:
    before, the call after a tool call was served as sent (`render_failed`). The request is rendered with a text
    reply in its place, and its own render must end with what follows that text: the end of turn, the new
    messages. The prompt is the previous prompt, the sampled ids (the model's own `</s>`), then the tool result."""
    engine = _MistralRender()
    reply = {"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": "abcdefghi"}]}  # 9 characters
    first = {"model": "my-agent", "messages": [USER], "tools": [TOOL]}
    previous = engine.ids(first)
    sampled = [*engine.tekken.encode('[{"name": "get_weather", "arguments": {"city": "Rome"}}]', False, False), 2]
    sent = {**first, "messages": [USER, reply, {**RESULT, "tool_call_id": "abcdefghi"}]}
    as_sent = engine.ids(sent)
    splice = await _splice_on(engine, sent, previous, sampled)
    assert isinstance(splice, Splice), splice
    after_turn = len(as_sent) - as_sent[::-1].index(2)  # the request's render after its last `</s>`
    assert engine.tekken.decode(as_sent[after_turn:]).startswith('{"content": "sunny"')  # [TOOL_RESULTS] is special
    assert splice.prompt_ids == previous + sampled + as_sent[after_turn:]


async def test_a_follow_up_user_message_on_mistral_gets_the_tools_block_mistral_common_puts_before_it() -> None:
    """mistral_common renders the tools (`[AVAILABLE_TOOLS]`) before the last user message only. The previous
    prompt had them before its last user message, as the model saw them; the follow-up's splice keeps that prompt
    and appends the new messages as mistral_common renders them, the tools block before the new last user message:
    twice in the spliced prompt, once in the request's own render, and no splice error."""
    engine = _MistralRender()
    first = {"model": "my-agent", "messages": [USER], "tools": [TOOL]}
    previous = engine.ids(first)
    sampled = [*engine.tekken.encode("It is sunny.", False, False), 2]
    reply = {"role": "assistant", "content": "It is sunny."}
    sent = {**first, "messages": [USER, reply, {"role": "user", "content": "And tomorrow?"}], "max_tokens": 16}
    as_sent = engine.ids(sent)
    splice = await _splice_on(engine, sent, previous, sampled)
    assert isinstance(splice, Splice), splice
    tools = engine.tekken.get_special_token("[AVAILABLE_TOOLS]")
    after_turn = len(as_sent) - as_sent[::-1].index(2)  # the request's render after the reply's `</s>`
    assert as_sent[after_turn] == tools and as_sent.count(tools) == 1
    assert splice.prompt_ids == previous + sampled + as_sent[after_turn:]
    assert previous.count(tools) == 1 and splice.prompt_ids.count(tools) == 2


async def test_a_spliced_whole_tool_call_is_named_as_vllms_chat_names_it() -> None:
    """Derender names every tool call with 16 hex digits. vLLM's chat names a Mistral model's calls with 9
    alphanumeric characters (mistral_common takes no other), any other's `chatcmpl-tool-` and 16 hex digits: the
    engine that renders with mistral_common says which by refusing a history that ends with an assistant turn."""

    async def derender(request: web.Request) -> web.Response:
        call = {"id": "0123456789abcdef", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        message = {"role": "assistant", "content": "", "tool_calls": [call]}
        return web.json_response({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

    async def render(request: web.Request) -> web.Response:  # a Jinja template's: any history renders
        return web.json_response({"token_ids": [1, 2, 3]})

    ids = {}
    generated = {"choices": [{"index": 0, "token_ids": [7, 8], "finish_reason": "stop"}]}
    for name, renders in (("mistral", _MistralRender().render), ("other", render)):
        async with serving({DERENDER_PATH: derender, "/v1/chat/completions/render": renders}) as url:
            async with aiohttp.ClientSession() as session:
                splicer = Splicer(session, url, aiohttp.ClientTimeout(total=30))
                splice = Splice([1, 2, 3], {}, _request([USER], tool_choice="required"), "my-agent@2")
                answer = await splicer.derender(generated, splice)
        ids[name] = answer["choices"][0]["message"]["tool_calls"][0]["id"]
    assert len(ids["mistral"]) == 9 and ids["mistral"].isalnum(), ids
    assert re.fullmatch("chatcmpl-tool-[0-9a-f]{16}", ids["other"]), ids


class _GarbledDerender(_StandInEngine):
    """The stand-in's generate stream, derendered by an engine that answers without chat's chunk."""

    async def derender(self, request: web.Request) -> web.Response:
        self.asked.set()
        return web.json_response({"stream_state": None})


async def test_a_derender_answer_vllm_never_sends_ends_the_stream_with_an_error_naming_it() -> None:
    """Read typed (engine/answers.py): the relay (gateway/proxy.py) ends the client's stream with a 502 event
    saying what was wrong, where a KeyError used to cut it."""
    engine = _GarbledDerender(tokens=2)
    async with serving({GENERATE_PATH: engine.generate, DERENDER_PATH: engine.derender}) as url:
        async with aiohttp.ClientSession() as session:
            splicer = Splicer(session, url, aiohttp.ClientTimeout(total=30))
            splice = Splice([1, 2, 3], {}, _request([USER]), "my-agent@2")
            async with session.post(url + GENERATE_PATH, json={}) as answer:
                stream = DerenderedStream(splicer, answer, splice, logprobs=False)
                with pytest.raises(EngineAnswerError, match=r"missing required field `chunk`"):
                    [chunk async for chunk in stream.iter_any()]
