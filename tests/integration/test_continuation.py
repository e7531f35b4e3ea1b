"""One rollout, one sequence (gateway/continuation.py), with the real vLLM and the real clients, unmodified.

A multi-call rollout whose every call sends back what the model produced is served from the model's own tokens
and recorded as one sequence; the clients get what the plain path gives them (the first tests compare the two
paths on the same prompt); a client that edits its history gets a new sequence that says which message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from typing import Any, Literal

import aiohttp
import anthropic
import openai
import pytest
from anthropic.lib.tools import beta_tool

from gateway.continuation import DERENDER_PATH, GENERATE_PATH, DerenderedStream, Splice, Splicer
from tests.conftest import BASE_NAME, END_TOKEN, metric, poll, run_client, start_gateway, start_stub, stop_group
from tests.recorded import (
    FORCED,
    ROME_PARIS_QUESTION,
    ROME_PARIS_TOOLS,
    anthropic_tool_loop,
    decode,
    first_run,
    forced_tool_call,
    new_id,
    one_sequence,
    recorded_calls,
    sampled_by_call,
)

pytestmark = pytest.mark.engine


# -- the token path answers as the plain path does -----------------------------------------------------------


def _request(**fields: Any) -> dict[str, Any]:
    base = {"model": BASE_NAME, "messages": ROME_PARIS_QUESTION, "max_tokens": 40, "seed": 3}
    return {**base, "logprobs": True, "return_token_ids": True, **fields}


CASES = {
    "text": _request(),
    "forced tool": _request(tools=ROME_PARIS_TOOLS, tool_choice=FORCED),
    "required tool, strict": _request(
        tools=[{**ROME_PARIS_TOOLS[0], "function": {**ROME_PARIS_TOOLS[0]["function"], "strict": True}}],
        tool_choice="required",
        max_tokens=60,
    ),
    "auto tools": _request(tools=ROME_PARIS_TOOLS, seed=5),
    # The edges: a `required` call cut by the token limit mid-arguments (its head is 13 tokens; not 16, vLLM's
    # default, which render leaves out and _both_paths' generate then takes as no limit), and an answer that is
    # only the end of sequence (the stop token is not text).
    "required tool, cut": _request(tools=ROME_PARIS_TOOLS, tool_choice="required", max_tokens=17, seed=1),
    "end of sequence": _request(logit_bias={str(END_TOKEN): 100}),
    "two choices": _request(n=2, seed=7),
    "top logprobs": _request(top_logprobs=2, seed=9),
}


async def _both_paths(url: str, request: dict[str, Any], logprobs: bool | None = None) -> tuple[Any, Any]:
    """The engine's own chat answer to `request`, and the gateway's token path's (render → generate → derender)
    from the same prompt ids: the plain prompt, no splice, so the sampled tokens are the same. `logprobs`: whether
    the client asked for them (the gateway's engine request always does); the request's own, by default."""
    async with aiohttp.ClientSession() as session:
        splicer = Splicer(session, url, aiohttp.ClientTimeout(total=120))
        async with session.post(url + "/v1/chat/completions", json=request) as answer:
            assert answer.status == 200, await answer.text()
            plain = await answer.read()
        _, rendered = await splicer._render(request)
        generate = {k: v for k, v in rendered.items() if k not in ("token_offsets", "request_id")}
        stream = bool(request.get("stream"))
        generate.update(stream=stream, stream_options=request.get("stream_options") if stream else None)
        splice = Splice(rendered["token_ids"], generate, request, BASE_NAME)
        if not stream:
            splicer.learn(json.loads(plain)["system_fingerprint"])
        async with session.post(url + GENERATE_PATH, json=generate) as answer:
            assert answer.status == 200, await answer.text()
            if not stream:
                return json.loads(plain), await splicer.derender(await answer.json(), splice)
            asked = bool(request.get("logprobs")) if logprobs is None else logprobs
            events = DerenderedStream(splicer, answer, splice, logprobs=asked)
            chunks = [chunk async for chunk in events.iter_any()]
        return _events(plain), _events(b"".join(chunks))


def _events(body: bytes) -> list[Any]:
    return [
        line[6:] if line == b"data: [DONE]" else json.loads(line[6:])
        for line in body.split(b"\n")
        if line.startswith(b"data: ")
    ]


def _same_answer(plain: dict[str, Any]) -> dict[str, Any]:
    """What two answers sampled from the same prompt share: all but their fresh ids and time."""
    out = {k: v for k, v in plain.items() if k not in ("id", "created")}
    out["choices"] = [
        {
            **c,
            "message": {
                **c["message"],
                # an id's shape, its random hex digits aside (`chatcmpl-tool-` and 16, as vLLM's chat makes it)
                "tool_calls": [
                    {**t, "id": re.sub("[0-9a-f]", "h", t["id"])} for t in c["message"].get("tool_calls") or ()
                ],
            },
        }
        for c in plain["choices"]
    ]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_token_path_answers_as_the_engine_does(vllm_url: str, case: str) -> None:
    plain, derendered = asyncio.run(_both_paths(vllm_url, CASES[case]))
    assert _same_answer(derendered) == _same_answer(plain)
    assert derendered["id"].startswith("chatcmpl-")


def _stream_summary(events: list[Any]) -> dict[str, Any]:
    """A chat stream as a client reads it: per choice its text, tool calls, finish reason and sampled ids, the
    kinds of its events in order (runs of one kind merged, empty deltas skipped: the engine batches tokens by
    timing, and so does the token path's derender), and the usage."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    assert events[-1] == b"[DONE]"
    for event in events[:-1]:
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            mine = choices.setdefault(
                choice["index"], {"text": "", "calls": {}, "kinds": [], "finish": None, "ids": [], "logprobs": []}
            )
            delta = choice["delta"]
            kind = (
                "role"
                if "role" in delta
                else "tool"
                if delta.get("tool_calls")
                else "text"
                if delta.get("content")
                else None
            )
            if kind is not None and (not mine["kinds"] or mine["kinds"][-1] != kind):
                mine["kinds"].append(kind)  # an empty delta (tokens the parser holds back) is of no kind
            mine["text"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                slot = mine["calls"].setdefault(call["index"], {"name": "", "arguments": "", "type": None})
                slot["type"] = call.get("type") or slot["type"]
                slot["name"] += (call.get("function") or {}).get("name") or ""
                slot["arguments"] += (call.get("function") or {}).get("arguments") or ""
            mine["finish"] = choice.get("finish_reason") or mine["finish"]
            mine["ids"] += choice.get("token_ids") or []
            mine["logprobs"] += [e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or ()]
    return {"choices": choices, "usage": usage, "first": events[0]["choices"][0]["delta"]}


STREAMED = ["text", "forced tool", "required tool, strict", "top logprobs", "no usage"]


@pytest.mark.parametrize("case", [*STREAMED, "required tool, cut", "end of sequence"])
def test_the_token_path_streams_as_the_engine_does(vllm_url: str, case: str) -> None:
    usage = {"stream_options": {"include_usage": True}} if case != "no usage" else {}
    request = {**CASES["text" if case == "no usage" else case], "stream": True, **usage}
    plain, derendered = asyncio.run(_both_paths(vllm_url, request))
    ours, theirs = _stream_summary(derendered), _stream_summary(plain)
    assert ours == theirs
    edge = {"required tool, cut": ("length", True), "end of sequence": ("stop", False)}.get(case)
    if edge is not None:  # the edge is reached: a call streamed before the cut; no text at the end of sequence
        (choice,) = theirs["choices"].values()
        assert (choice["finish"], bool(choice["calls"])) == edge
        assert choice["text"] == ""
    assert (ours["usage"] is None) == (case == "no usage")
    assert ours["first"] == {"role": "assistant", "content": ""}
    if case != "text":  # the client did not ask for logprobs' text: the recorder gets the sampled ones anyway
        assert all(c["logprobs"] for c in ours["choices"].values())


def _long_history(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: what will the weather be in Rome on day {i}?"})
        messages.append({"role": "assistant", "content": f"On day {i} Rome has light rain, {10 + i} degrees."})
    return [*messages, *ROME_PARIS_QUESTION]


LONG_HISTORY = _long_history(20)
LONG = {  # a long answer after a long history, the tool parser on
    "long text": _request(messages=LONG_HISTORY, tools=ROME_PARIS_TOOLS, max_tokens=200, ignore_eos=True, seed=11),
    "long forced tool": _request(messages=LONG_HISTORY, tools=ROME_PARIS_TOOLS, tool_choice=FORCED, max_tokens=200),
}


# each kind once, each with one of the client's logprobs choices (the suite's time: a call pair is ~2.5 s of CPU)
@pytest.mark.parametrize(
    ("case", "asked"),
    [("long text", False), ("long forced tool", True)],
    ids=["long text, no logprobs", "long forced tool, logprobs"],
)
def test_a_long_streamed_continuation_derenders_only_what_it_needs(vllm_url: str, case: str, asked: bool) -> None:
    """The engine's chunks that arrive while a derender is out go in one request, which carries the tools and
    options but not the history; a second request (the chunk's chat logprobs) only for a client that asked."""
    request = {**LONG[case], "stream": True, "stream_options": {"include_usage": True}}
    before = metric(vllm_url, "http_requests_total", handler=DERENDER_PATH)
    plain, derendered = asyncio.run(_both_paths(vllm_url, request, logprobs=asked))
    derenders = metric(vllm_url, "http_requests_total", handler=DERENDER_PATH) - before
    ours, theirs = _stream_summary(derendered), _stream_summary(plain)
    assert ours == theirs
    (choice,) = ours["choices"].values()
    assert len(choice["ids"]) > 100 and (case == "long text") == (not choice["calls"])
    # one derender a batch of tokens (each batch is one event after the role's), and one more for its logprobs
    batches = sum(1 for event in derendered[1:-1] if event["choices"])
    assert derenders == batches * (2 if asked else 1)
    # That no request carries the history is tests/unit/test_continuation.py's: the bytes sent here depend on how
    # many tokens each batch holds, which is the machine's speed (a fresh clone's run sent 6 requests of ~8.8 KB,
    # the token ids and logprobs of ~35 tokens each, against a 3.4 KB history).


# -- clients through the gateway ------------------------------------------------------------------------------


def _openai_tool_loop(gateway: Any, rid: str, seed: int, stream: bool) -> list[Any]:
    """Two forced tool calls, an answer, a user follow-up: the OpenAI SDK as an agent loop writes it."""
    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", default_headers={"X-ART-Rollout-Id": rid})
    messages: list[dict[str, Any]] = [*ROME_PARIS_QUESTION]
    replies = []

    def call(**fields: Any) -> Any:
        if not stream:
            return client.chat.completions.create(
                model="my-agent", messages=messages, tools=ROME_PARIS_TOOLS, max_tokens=48, seed=seed, **fields
            ).choices[0]
        with client.chat.completions.stream(
            model="my-agent", messages=messages, tools=ROME_PARIS_TOOLS, max_tokens=48, seed=seed, **fields
        ) as events:
            for _ in events:
                pass
            return events.current_completion_snapshot.choices[0]

    for _ in range(2):
        choice = call(tool_choice=FORCED)
        # A failed parse raises, and so does a reply cut at the limit after its call (the plugin returns the
        # complete call with finish_reason `length`, engine/tool_parser.py): the test tries another seed.
        if choice.finish_reason == "length":
            raise ValueError(f"cut at max_tokens after {len(choice.message.tool_calls or [])} call(s)")
        (tool_call,) = choice.message.tool_calls
        json.loads(tool_call.function.arguments)
        replies.append(choice)
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "sunny"})
    replies.append(call())
    messages.append({"role": "assistant", "content": replies[-1].message.content or ""})
    messages.append({"role": "user", "content": "And tomorrow?"})
    replies.append(call())
    return replies


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_sdk_tool_loop_is_one_sequence(engine_gateway, tokenizer, stream: bool) -> None:
    rid = new_id("loop")
    spliced_before = metric(engine_gateway.url, "artgw_continued_calls_total", how="spliced")
    seed, replies = first_run(lambda seed: _openai_tool_loop(engine_gateway, f"{rid}-{seed}", seed, stream))
    recorded = one_sequence(engine_gateway, f"{rid}-{seed}", 4)
    sampled = sampled_by_call(recorded)
    for call, reply in zip(recorded["calls"], replies, strict=True):
        text = decode(tokenizer, sampled[call["id"]])
        if reply.message.tool_calls:  # the sampled ids are the tool call the client parsed
            (tool_call,) = reply.message.tool_calls
            assert json.loads(text.split("<tool_call>", 1)[1].split("</tool_call>")[0]) == {
                "name": "get_weather",
                "arguments": json.loads(tool_call.function.arguments),
            }
            assert reply.finish_reason in ("stop", "tool_calls")
        else:
            assert text == reply.message.content
    assert [c["finish_reasons"][0] for c in recorded["calls"]] == [r.finish_reason for r in replies]
    assert metric(engine_gateway.url, "artgw_continued_calls_total", how="spliced") - spliced_before >= 3


def test_an_edited_history_starts_a_sequence_that_names_the_edit(engine_gateway) -> None:
    rid = new_id("edit")
    client = openai.OpenAI(
        base_url=engine_gateway.base_url, api_key="unused", default_headers={"X-ART-Rollout-Id": rid}
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say something."}]
    first = client.chat.completions.create(model="my-agent", messages=messages, max_tokens=8, seed=1)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "More."},
    ]
    client.chat.completions.create(model="my-agent", messages=messages, max_tokens=8, seed=1)
    messages[0] = {"role": "user", "content": "Say something else."}  # the client rewrites its first message
    client.chat.completions.create(model="my-agent", messages=messages, max_tokens=8, seed=1)
    recorded = poll(lambda: recorded_calls(engine_gateway, rid, 3), 60, "the rollout")
    first_seq, second_seq = recorded["sequences"]
    assert len(first_seq["call_ids"]) == 2
    assert second_seq["split_cause"] == "edited"
    assert "message 0 (user)" in second_seq["split_reason"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_messages_tool_loop_is_one_sequence(engine_gateway, stream: bool) -> None:
    rid = new_id("anthropic")
    seed, replies = first_run(lambda seed: anthropic_tool_loop(engine_gateway.url, f"{rid}-{seed}", seed, stream))
    recorded = one_sequence(engine_gateway, f"{rid}-{seed}", 3)
    assert [r.stop_reason for r in replies[:2]] == ["tool_use", "tool_use"]
    assert {c["api"] for c in recorded["calls"]} == {"messages"}


@beta_tool
def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """Current weather of a city."""
    return "sunny"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_tool_runner_runs_on_a_thread_and_is_one_sequence(engine_gateway, stream: bool) -> None:
    """Anthropic's Python tool runner at its defaults keeps its conversation in a message thread: a `create`,
    then `continue`s that send only the new messages, without `system` and `tools`. Before, the gateway ignored
    `thread` and the second call got a 400 (`tool_choice of type 'any' needs tools`). Now the gateway continues
    the thread from its store and the rollout is one sequence."""
    rid = new_id("runner")
    threads: list[Any] = []

    def sent(request: Any) -> None:
        body = json.loads(request.content)
        threads.append((body.get("thread"), "tools" in body))

    def run(seed: int) -> list[Any]:
        threads.clear()
        client = anthropic.Anthropic(
            base_url=engine_gateway.url,
            api_key="unused",
            default_headers={"X-ART-Rollout-Id": f"{rid}-{seed}"},
            http_client=anthropic.DefaultHttpxClient(event_hooks={"request": [sent]}),
        )
        runner = client.beta.messages.tool_runner(
            model="my-agent",
            max_tokens=48,
            system="You check the weather.",
            messages=[{"role": "user", "content": ROME_PARIS_QUESTION[0]["content"]}],
            tools=[get_weather],
            tool_choice={"type": "any"},
            max_iterations=3,
            extra_body={"seed": seed},
            stream=stream,
        )
        replies = [item.get_final_message() if stream else item for item in runner]
        if any(reply.stop_reason != "tool_use" for reply in replies):  # the JSON ran past max_tokens
            raise ValueError(f"not every reply a whole tool call: {[r.stop_reason for r in replies]}")
        return replies

    seed, replies = first_run(run)
    assert len(replies) == 3
    first, *rest = threads[-3:]
    assert first == ({"type": "create"}, True)
    assert rest == [({"type": "continue", "previous_message_id": reply.id}, False) for reply in replies[:2]], (
        "the runner fell back to sending its whole history"
    )
    recorded = one_sequence(engine_gateway, f"{rid}-{seed}", 3)
    assert {c["api"] for c in recorded["calls"]} == {"messages"}


def test_anthropic_node_tool_runner_runs_on_a_thread_and_is_one_sequence(engine_gateway) -> None:
    """The same with Anthropic's TypeScript SDK (`client.beta.messages.toolRunner`, tests/clients-js)."""
    rid = new_id("node-runner")
    env = {"ANTHROPIC_BASE_URL": engine_gateway.url, "ANTHROPIC_API_KEY": "unused", "ROLLOUT_ID": rid}
    run = run_client("anthropic_tool_runner", env)
    assert run["sent"] == [
        {"thread": {"type": "create"}, "tools": True},
        *({"thread": {"type": "continue", "previous_message_id": id}, "tools": False} for id in run["ids"][:2]),
    ], "the runner fell back to sending its whole history"
    recorded = one_sequence(engine_gateway, f"{rid}-{run['seed']}", 3)
    assert {c["api"] for c in recorded["calls"]} == {"messages"}


def test_langgraph_react_agent_is_one_sequence(engine_gateway) -> None:
    rid = new_id("langgraph")
    env = {"OPENAI_BASE_URL": engine_gateway.base_url, "OPENAI_API_KEY": "unused", "ROLLOUT_ID": rid}
    run = run_client("langgraph_react_agent", env)
    assert run["messages"] == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage", "ToolMessage", "AIMessage"]
    one_sequence(engine_gateway, f"{rid}-{run['seed']}", 3)


# -- the other path ------------------------------------------------------------------------------------------


def test_rerender_records_a_sequence_a_call_and_counts_them(vllm_url, tmp_path, tokenizer) -> None:
    gateway = start_gateway(tmp_path, "--upstream", vllm_url, "--continuity", "rerender")
    try:
        rid = new_id("rerender")
        seed, _ = first_run(lambda seed: _openai_tool_loop(gateway, f"{rid}-{seed}", seed, False))
        recorded = poll(lambda: recorded_calls(gateway, f"{rid}-{seed}", 4), 60, "the rollout")
        assert len(recorded["sequences"]) > 1  # the template renders the tool calls anew
        assert metric(gateway.url, "artgw_continued_calls_total", how="rerendered") >= 3
        assert metric(gateway.url, "artgw_continued_calls_total", how="spliced") == 0
    finally:
        gateway.stop()


def test_a_restart_keeps_the_rollout_one_sequence(vllm_url, tmp_path) -> None:
    """The restarted gateway does not hold the rollout's last call: it reads it from the store, and the next call
    is spliced onto it. Before, it was rendered anew and the rollout split (`state_lost`)."""
    first = start_gateway(tmp_path, "--upstream", vllm_url)
    rid = new_id("restart")
    try:
        seed, messages = first_run(lambda seed: forced_tool_call(first, f"{rid}-{seed}", seed))
        poll(lambda: recorded_calls(first, f"{rid}-{seed}", 1), 60, "the first call")
    finally:
        first.stop()
    # The same data dir (store, admin key), on a new port: the restarted gateway.
    again = dataclasses.replace(
        start_gateway(tmp_path, "--upstream", vllm_url, "--data-dir", str(first.data_dir)), data_dir=first.data_dir
    )
    try:
        client = openai.OpenAI(
            base_url=again.base_url, api_key="unused", default_headers={"X-ART-Rollout-Id": f"{rid}-{seed}"}
        )
        client.chat.completions.create(
            model="my-agent", messages=messages, tools=ROME_PARIS_TOOLS, max_tokens=8, seed=seed
        )
        one_sequence(again, f"{rid}-{seed}", 2)
        assert metric(again.url, "artgw_continued_calls_total", how="spliced") == 1
        assert metric(again.url, "artgw_continuation_reads_total", found="found") == 1
    finally:
        again.stop()


def test_an_engine_without_scale_out_is_said_at_start_and_served_anew(tmp_path) -> None:
    """vLLM started without --enable-scale-out answers 403 on its render endpoint: a stand-in engine that does
    so (the real one would cost a second engine), with the real gateway in front."""
    url, stub = start_stub()
    gateway = start_gateway(tmp_path, "--upstream", url)
    rid = new_id("stub")
    try:
        assert poll(lambda: "no scale-out endpoints" in gateway.log(), 60, "the warning")
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", default_headers={"X-ART-Rollout-Id": rid})
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(model="my-agent", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        second = client.chat.completions.create(model="my-agent", messages=messages)
        assert second.choices[0].message.content == reply.choices[0].message.content  # answered as before
        assert metric(gateway.url, "artgw_continued_calls_total", how="no_scale_out") == 1
        # the split the stored rollout shows names the cause the metric counted (before, `rerendered`)
        recorded = poll(lambda: recorded_calls(gateway, rid, 2), 60, "2 calls")
        assert [s["split_cause"] for s in recorded["sequences"]] == [None, "no_scale_out"]
    finally:
        gateway.stop()
        stop_group(stub)


def test_responses_with_previous_response_id_is_one_sequence(engine_gateway) -> None:
    """The history the gateway keeps itself (`previous_response_id`, store/responses.py) continues too."""
    rid = new_id("responses")
    tools = [{"type": "function", **{k: v for k, v in ROME_PARIS_TOOLS[0]["function"].items()}}]

    def run(seed: int) -> None:
        client = openai.OpenAI(
            base_url=engine_gateway.base_url, api_key="unused", default_headers={"X-ART-Rollout-Id": f"{rid}-{seed}"}
        )
        fields: dict[str, Any] = dict(model="my-agent", tools=tools, max_output_tokens=48, extra_body={"seed": seed})
        first = client.responses.create(
            input=ROME_PARIS_QUESTION[0]["content"], tool_choice={"type": "function", "name": "get_weather"}, **fields
        )
        calls = [item for item in first.output if item.type == "function_call"]
        if not calls or first.status != "completed":
            raise ValueError(f"no whole function call ({first.status})")
        json.loads(calls[0].arguments)
        outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]
        client.responses.create(previous_response_id=first.id, input=outputs, **fields)

    seed, _ = first_run(run)
    recorded = one_sequence(engine_gateway, f"{rid}-{seed}", 2)
    assert {c["api"] for c in recorded["calls"]} == {"responses"}
