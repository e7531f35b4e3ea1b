"""One rollout, one sequence (issue 25): what the continuation path costs per call, and what it saves training.

Two parts, each comparing `--continuity splice` (a continuing call served from token ids: render → generate →
derender) with `--continuity rerender` (the call sent as is) in one run, side by side:

1. `overhead`: a stand-in engine (this file's `--serve-engine PORT`: vLLM 0.32's chat, render, generate and
   derender endpoints, shaped as vLLM answers them, each answered at once) behind two gateways, one per mode.
   Every measured call *continues* its rollout (the previous call's messages, its reply, a new user message).
   Per mode: the latency of a whole answer (p50/p90, one connection), a streamed answer's time to its first
   content token (p50, one connection), and req/s at `--connections` (each connection goes on with its own
   conversation of up to 10 calls, then starts a new rollout). The calls interleave by mode so both see the
   same machine.
2. `sequences`: the real vLLM (the tests' tiny model) behind a gateway per mode; a synthetic `--turns`-call tool
   loop (forced tool calls, each result sent back, an answer) and the demo's episodes (artgw/demo_task.py: a
   get_ballots call, then report). Per mode: sequences per rollout, tokens the trainer processes per trajectory
   token (the tokens of all of a rollout's sequences / the tokens of its longest), and the trainer's step time
   on those sequences (trainer.step.train_step on the tiny model, median of `--reps`).

3. `families` (not in `both`): for each model family's tiny model (`artgw tiny-model --family`: toy, qwen3,
   llama3_1, mistral) served by `artgw serve --base-model` (the family's parsers), `--rollouts` rollouts of a
   text loop (three user turns) and, where the template renders tools, a tool loop (two forced calls, an answer,
   a follow-up), splice only: sequences per rollout and tokens processed per trajectory token (goal 1 and
   <= 1.1), with the split reasons seen.

    nice -n 5 .venv/bin/python bench/continuation.py                    # both parts (~4 min)
    .venv/bin/python bench/continuation.py --part overhead --calls 400
    .venv/bin/python bench/continuation.py --part families --families qwen3 --rollouts 4   # ~2-4 min a family
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ARTGW = str(Path(sys.executable).parent / "artgw")
END, NL = 2, 98  # the stand-in's end of turn: `<|im_end|>`, `\n`


# -- the stand-in engine -------------------------------------------------------------------------------------


def _render(request: dict[str, Any]) -> list[int]:
    """Token ids of a chat request as a template would render them: 8 per message + 1 per character of text,
    each turn closed by the end-of-turn tokens; the generation prompt unless asked not to."""
    ids: list[int] = []
    for message in request.get("messages") or ():
        text = message.get("content") if isinstance(message.get("content"), str) else ""
        ids += [1, 7, *(range(10, 18)), *[200 + (ord(c) % 50) for c in text], END, NL]
    if request.get("add_generation_prompt", True):
        ids += [1, 7, NL]
    return ids


SAMPLED = [300, 301, 302, 303, END]  # what the stand-in samples: "abcd" and the end of turn
REPLY = "abcd"


def _choice_logprobs() -> dict[str, Any]:
    return {"content": [{"token_id": t, "logprob": -0.5, "rank": 1, "top_logprobs": []} for t in SAMPLED]}


def _chat_answer(prompt: list[int]) -> dict[str, Any]:
    return {
        "id": "chatcmpl-stand-in",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "stand-in",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": REPLY},
                "logprobs": {
                    "content": [{"token": c, "logprob": -0.5, "bytes": [ord(c)], "top_logprobs": []} for c in REPLY]
                },
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": SAMPLED,
            }
        ],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(SAMPLED), "total_tokens": len(prompt) + 5},
        "prompt_token_ids": prompt,
        "system_fingerprint": "stand-in",
    }


def _chunks(prompt: list[int], chat: bool) -> list[dict[str, Any]]:
    """A streamed answer: chat's events (role, one per token, usage), or generate's (one per token, usage)."""
    head = {"id": "chatcmpl-stand-in", "object": "chat.completion.chunk", "created": int(time.time()), "model": "m"}
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(SAMPLED), "total_tokens": len(prompt) + 5}
    events: list[dict[str, Any]] = []
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        events.append({**head, "choices": [role], "prompt_token_ids": prompt})
    for i, token in enumerate(SAMPLED):
        last = i == len(SAMPLED) - 1
        text = "" if last else REPLY[i]
        if chat:
            choice = {
                "index": 0,
                "delta": {"content": text},
                "finish_reason": "stop" if last else None,
                "logprobs": {"content": [{"token": text, "logprob": -0.5, "bytes": [], "top_logprobs": []}]},
                "token_ids": [token],
            }
            events.append({**head, "choices": [choice]})
        else:
            choice = {
                "index": 0,
                "finish_reason": "stop" if last else None,
                "token_ids": [token],
                "logprobs": {"content": [{"token_id": token, "logprob": -0.5, "rank": 1, "top_logprobs": []}]},
            }
            events.append({"request_id": "generate-x", "output_mode": "tokens", "choices": [choice]})
    events.append(
        {**head, "choices": [], "usage": usage} if chat else {"request_id": "g", "choices": [], "usage": usage}
    )
    return events


def serve_engine(port: int) -> None:
    import uvicorn

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        request = json.loads(body or b"{}")
        stream = bool(request.get("stream"))
        if path == "/health":
            answer: Any = ""
        elif path == "/v1/models":
            answer = {"object": "list", "data": [{"id": "stand-in", "root": "stand-in", "parent": None}]}
        elif path == "/v1/chat/completions/render":
            if "messages" not in request:
                await _send(send, 400, {"error": {"message": "messages: Field required", "code": 400}})
                return
            ids = _render(request)
            params = {"max_tokens": request.get("max_tokens") or 4096 - len(ids), "logprobs": 0}
            answer = {"request_id": "r", "token_ids": ids, "sampling_params": params, "model": request["model"]}
        elif path == "/inference/v1/generate":
            if stream:
                await _send_stream(send, _chunks(request["token_ids"], chat=False))
                return
            choice = {"index": 0, "finish_reason": "stop", "token_ids": SAMPLED, "logprobs": _choice_logprobs()}
            answer = {"request_id": "generate-tokens-x", "choices": [choice], "usage": None}
        elif path == "/v1/chat/completions/derender":
            if stream:
                chunk = request["generate_chunk"]
                choices = []
                for c in chunk.get("choices") or ():
                    text = "".join(REPLY[SAMPLED.index(t)] for t in c["token_ids"] if t != END)
                    choices.append(
                        {
                            "index": 0,
                            "delta": {"role": None, "content": text, "reasoning": None},
                            "logprobs": None,
                            "finish_reason": c.get("finish_reason"),
                            "stop_reason": None,
                        }
                    )
                out = {
                    "id": "generate-tokens-x",
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": "m",
                    "choices": choices,
                    "usage": chunk.get("usage"),
                }
                answer = {"chunk": out, "stream_state": {"prev_tokens": [], "output_token_ids": []}}
            else:
                answer = _chat_answer([])
                answer["prompt_token_ids"] = None
        elif path == "/v1/chat/completions":
            prompt = _render(request)
            if stream:
                await _send_stream(send, _chunks(prompt, chat=True))
                return
            answer = _chat_answer(prompt)
        else:
            await _send(send, 404, {"error": {"message": "not found", "code": 404}})
            return
        await _send(send, 200, answer)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def _send(send, status: int, payload: Any) -> None:  # type: ignore[no-untyped-def]
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


async def _send_stream(send, events: list[dict[str, Any]]) -> None:  # type: ignore[no-untyped-def]
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for event in events:
        await send(
            {"type": "http.response.body", "body": b"data: " + json.dumps(event).encode() + b"\n\n", "more_body": True}
        )
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


# -- processes -----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[Any], timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited ({proc.returncode})")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"{url} not ready in {timeout:.0f} s")


class Processes:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []

    def start(self, cmd: list[str], log: Path) -> subprocess.Popen[Any]:
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def start_gateway(procs: Processes, workdir: Path, upstream: str, continuity: str) -> str:
    port = free_port()
    data = workdir / f"gw-{continuity}-{port}"
    cmd = [ARTGW, "serve", "--upstream", upstream, "--port", str(port), "--data-dir", str(data)]
    cmd += ["--continuity", continuity, "--auth", "off", "--log-level", "warning"]
    data.mkdir(parents=True, exist_ok=True)
    proc = procs.start(cmd, workdir / f"gw-{continuity}.log")
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/readyz", proc, 120)
    return url


# -- part 1: the continuation path's cost --------------------------------------------------------------------


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Conversation:
    """One client's rollout: each call sends back the reply and a new user message (a continuing call)."""

    def __init__(self, name: str, turns: int = 10) -> None:
        self.name, self.turns, self.started = name, turns, 0
        self._new()

    def _new(self) -> None:
        self.started += 1
        self.rollout = f"{self.name}-{self.started}"
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Rome?"}]

    def body(self, stream: bool) -> bytes:
        return json.dumps({"model": "my-agent", "messages": self.messages, "max_tokens": 16, "stream": stream}).encode()

    def answered(self, reply: str) -> None:
        if len(self.messages) >= 2 * self.turns:
            self._new()
            return
        self.messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And tomorrow?"}]


async def _call(session: Any, url: str, conversation: Conversation, stream: bool) -> tuple[float, float]:
    """(seconds to the first content token, seconds to the whole answer) of one call."""
    started = time.perf_counter()
    first = None
    headers = {"content-type": "application/json", "X-ART-Rollout-Id": conversation.rollout}
    async with session.post(url + "/v1/chat/completions", data=conversation.body(stream), headers=headers) as answer:
        if answer.status != 200:
            raise SystemExit(f"{url}: HTTP {answer.status}: {(await answer.read())[:300]!r}")
        if not stream:
            reply = (await answer.json())["choices"][0]["message"]["content"]
        else:
            parts = []
            async for line in answer.content:
                if line.startswith(b"data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        text = choice["delta"].get("content")
                        if text and first is None:
                            first = time.perf_counter() - started
                        parts.append(text or "")
            reply = "".join(parts)
    conversation.answered(reply)
    whole = time.perf_counter() - started
    return (first if first is not None else whole), whole


async def overhead(urls: dict[str, str], calls: int, connections: int, seconds: float) -> dict[str, dict[str, float]]:
    import aiohttp

    results: dict[str, dict[str, float]] = {mode: {} for mode in urls}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        conversations = {mode: Conversation(f"one-{mode}") for mode in urls}
        for mode, url in urls.items():  # each conversation's first call, and a warm-up
            for _ in range(20):
                await _call(session, url, conversations[mode], False)
        for stream in (False, True):
            timings: dict[str, list[tuple[float, float]]] = {mode: [] for mode in urls}
            for _ in range(calls):  # interleaved, call by call
                for mode, url in urls.items():
                    timings[mode].append(await _call(session, url, conversations[mode], stream))
            for mode in urls:
                if stream:
                    results[mode]["ttft_p50_ms"] = 1000 * statistics.median(t[0] for t in timings[mode])
                else:
                    results[mode]["p50_ms"] = 1000 * statistics.median(t[1] for t in timings[mode])
                    results[mode]["p90_ms"] = 1000 * _quantile([t[1] for t in timings[mode]], 0.9)
        for mode, url in urls.items():
            done = 0

            async def client(i: int, deadline: float, url: str = url, mode: str = mode) -> None:
                nonlocal done
                conversation = Conversation(f"load-{mode}-{i}")
                while time.monotonic() < deadline:
                    await _call(session, url, conversation, False)
                    done += 1

            deadline = time.monotonic() + seconds
            await asyncio.gather(*(client(i, deadline) for i in range(connections)))
            results[mode]["req_s"] = done / seconds
    return results


def print_overhead(results: dict[str, dict[str, float]], connections: int) -> None:
    plain, splice = results["rerender"], results["splice"]
    print("\n| continuing call, stand-in engine | rerender (plain) | splice | added | ratio |")
    print("|---|---|---|---|---|")
    for key, label in (
        ("p50_ms", "whole answer p50 (ms)"),
        ("p90_ms", "whole answer p90 (ms)"),
        ("ttft_p50_ms", "streamed, first token p50 (ms)"),
    ):
        added = splice[key] - plain[key]
        print(f"| {label} | {plain[key]:.2f} | {splice[key]:.2f} | {added:+.2f} | {splice[key] / plain[key]:.2f} |")
    print(
        f"| req/s at {connections} connections | {plain['req_s']:.0f} | {splice['req_s']:.0f} | "
        f"{splice['req_s'] - plain['req_s']:+.0f} | {splice['req_s'] / plain['req_s']:.2f} |"
    )


# -- part 2: sequences, and what they cost the trainer -------------------------------------------------------


WEATHER_TOOLS = [  # the one tool of the tool loops (`tool_loop`, `family_loop`)
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    }
]


def tool_loop(base_url: str, rid: str, turns: int, seed: int) -> None:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", default_headers={"X-ART-Rollout-Id": rid})
    tools = WEATHER_TOOLS
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Rome and Paris?"}]
    for turn in range(turns):
        forced = turn < turns - 1
        choice = client.chat.completions.create(
            model="my-agent",
            messages=messages,
            tools=tools,
            max_tokens=40,
            seed=seed,
            **({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}} if forced else {}),
        ).choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
        if forced and not choice.message.tool_calls:
            messages.append({"role": "user", "content": "Call the tool."})


def rollout_sequences(url: str, rid: str) -> list[dict[str, Any]]:
    import httpx

    answer = httpx.get(f"{url}/v1/art/rollouts/{rid}", headers={"Authorization": "Bearer " + admin_key(url)})
    answer.raise_for_status()
    return answer.json()["sequences"]


_ADMIN: dict[str, str] = {}


def admin_key(url: str) -> str:
    return _ADMIN[url]


def train_seconds(model_dir: Path, sequences: list[list[dict[str, Any]]], reps: int) -> float:
    """Median time of one trainer step over these rollouts' sequences (one trajectory each, advantage ±1)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.batch import StepData, TrainSequence
    from trainer.config import TrainConfig
    from trainer.model import Policy, make_optimizer
    from trainer.step import train_step

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=8, target_modules="all-linear")
    )
    config = TrainConfig(models=("bench",), base_model=str(model_dir), db="sqlite://")
    optimizer = make_optimizer(model, config)
    train = [
        TrainSequence(
            token_ids=s["token_ids"],
            sampled_mask=s["sampled_mask"],
            logprobs=[lp if lp is not None else None for lp in s["logprobs"]],
            trajectory=i,
        )
        for i, rollout in enumerate(sequences)
        for s in rollout
    ]
    advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(sequences))])
    data = StepData([f"g{i}" for i in range(len(sequences))], train, advantages, [0.0] * len(sequences), 0, 0, 0)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        train_step(Policy.of(model, config, torch.device("cpu")), optimizer, data, config, torch.device("cpu"), 0)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def sequences_part(args: argparse.Namespace, procs: Processes, workdir: Path) -> None:
    from artgw.demo_task import call_logit_bias, run_episodes, scenarios
    from artgw.tiny_model import build_tiny_model
    from engine.supervisor import EngineConfig

    model_dir = build_tiny_model(workdir / "tiny")
    port = free_port()
    engine = EngineConfig(
        base_model=str(model_dir), served_name="tiny", port=port, max_model_len=4096, log_path=workdir / "engine.log"
    )
    with engine.log_path.open("wb") as log:
        proc = subprocess.Popen(
            engine.command(), env=engine.environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    procs.procs.append(proc)
    print("starting vLLM (~45 s) ...", flush=True)
    wait_ready(engine.url + "/health", proc, 600)
    urls = {mode: start_gateway(procs, workdir, engine.url, mode) for mode in ("rerender", "splice")}
    for mode, url in urls.items():
        _ADMIN[url] = (workdir / f"gw-{mode}-{url.rsplit(':', 1)[1]}" / "admin_key").read_text().strip()
    rows = []
    bias = call_logit_bias(model_dir)
    for task in ("tool loop", "demo episodes"):
        per_mode: dict[str, list[list[dict[str, Any]]]] = {}
        for mode, url in urls.items():
            rids = []
            if task == "tool loop":
                for i in range(args.rollouts):
                    rid = f"loop-{mode}-{i}"
                    tool_loop(url + "/v1", rid, args.turns, seed=i)
                    rids.append(rid)
            else:
                import openai

                client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused")
                jobs = [(s, f"demo-{mode}-{i}") for i, s in enumerate(scenarios("train", args.rollouts))]
                episodes = asyncio.run(run_episodes(client, jobs, model="my-agent", logit_bias=bias))
                rids = [e.rollout_id for e in episodes]
            time.sleep(2)  # the recorder's batch
            per_mode[mode] = [rollout_sequences(url, rid) for rid in rids]
        step = {mode: train_seconds(model_dir, seqs, args.reps) for mode, seqs in per_mode.items()}
        for mode, seqs in per_mode.items():
            per_rollout = statistics.mean(len(s) for s in seqs)
            processed = sum(len(x["token_ids"]) for s in seqs for x in s)
            trajectory = sum(max(len(x["token_ids"]) for x in s) for s in seqs)
            calls = statistics.mean(sum(len(x["call_ids"]) for x in s) for s in seqs)
            rows.append(
                (task, mode, calls, per_rollout, processed / trajectory, step[mode], step[mode] / step["rerender"])
            )
    print(
        "\n| rollouts | continuity | calls/rollout | sequences/rollout | tokens processed per trajectory token |"
        " trainer step (s) | step vs rerender |"
    )
    print("|---|---|---|---|---|---|---|")
    for task, mode, calls, per_rollout, ratio, seconds, versus in rows:
        print(f"| {task} | {mode} | {calls:.1f} | {per_rollout:.2f} | {ratio:.2f} | {seconds:.2f} | {versus:.2f} |")


# -- part 3: the model families' templates (issue 41) -----------------------------------------------------------

FAMILIES = ("toy", "qwen3", "llama3_1", "mistral")
FORCED = {"type": "function", "function": {"name": "get_weather"}}


def _forced_bias(model_dir: Path, family: str) -> dict[str, int]:
    """A forced call's logit bias on a random model: `"` and `}` favoured end its JSON; `</think>` closes Qwen3's
    reasoning at once (tests/integration/test_families.py)."""
    texts = ['"', "}", *(["</think>"] if family == "qwen3" else [])]
    if family == "mistral":
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        tekken = MistralTokenizer.from_file(str(model_dir / "tekken.json")).instruct_tokenizer.tokenizer
        ids = [tekken.encode(text, bos=False, eos=False)[0] for text in texts]
    else:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        ids = [tokenizer.encode(text, add_special_tokens=False).ids[0] for text in texts]
    return {str(i): 100 if text == "</think>" else 20 for i, text in zip(ids, texts, strict=True)}


def family_loop(base_url: str, rid: str, seed: int, bias: dict[str, int] | None) -> int:
    """A rollout as an agent makes it: with `bias`, two forced tool calls (each result sent back), an answer, a
    follow-up and its answer; without (a template with no tools section), three user turns, each answered.
    Returns how many tool calls the model made (a forced call cut at its limit makes none)."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", default_headers={"X-ART-Rollout-Id": rid})
    tools = WEATHER_TOOLS
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Rome and Paris?"}]

    def ask(**fields: Any) -> Any:
        fields = {"model": "my-agent", "messages": messages, "max_tokens": 48, "seed": seed, **fields}
        message = client.chat.completions.create(**fields).choices[0].message
        sent = message.model_dump(exclude_none=True)
        sent.pop("reasoning", None)  # what most agent code sends back: content and tool calls
        messages.append(sent)
        return message

    if bias is None:
        for follow_up in ("And tomorrow?", "And the day after?", None):
            ask(max_tokens=12)
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        return 0
    called = 0
    for _ in range(2):
        # 120 tokens: Mistral's forced call is a JSON array of {name, arguments}, longer than a hermes call
        message = ask(tools=tools, tool_choice=FORCED, max_tokens=120, extra_body={"logit_bias": bias})
        called += len(message.tool_calls or ())
        for call in message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Call the tool."})
    ask(tools=tools, max_tokens=16)
    messages.append({"role": "user", "content": "And tomorrow?"})
    ask(tools=tools, max_tokens=16)
    return called


def families_part(args: argparse.Namespace, procs: Processes, workdir: Path) -> None:
    """Per family: `artgw serve --base-model` its tiny model (the gateway picks the family's parsers), the
    rollouts of `family_loop` (tool loops where the template renders tools, text loops everywhere), splice only."""
    from artgw.tiny_model import TinyModelSpec, build_tiny_model

    rows = []
    for family in args.families:
        model_dir = build_tiny_model(workdir / family, TinyModelSpec(family=family))  # type: ignore[arg-type]
        port = free_port()
        data = workdir / f"gw-{family}"
        data.mkdir()
        cmd = [ARTGW, "serve", "--base-model", str(model_dir), "--port", str(port), "--data-dir", str(data)]
        proc = procs.start([*cmd, "--auth", "off", "--log-level", "warning"], workdir / f"gw-{family}.log")
        url = f"http://127.0.0.1:{port}"
        print(f"{family}: starting the gateway and its vLLM ...", flush=True)
        wait_ready(url + "/readyz", proc, 900)
        _ADMIN[url] = (data / "admin_key").read_text().strip()
        loops = {"text loop": None}
        if family != "llama3_1":  # npm's Llama 3.1 template renders no tools nor tool calls
            loops["tool loop"] = _forced_bias(model_dir, family)
        for loop, bias in loops.items():
            rids = [f"{family}-{loop}-{i}".replace(" ", "-") for i in range(args.rollouts)]
            called = [family_loop(url + "/v1", rid, i, bias) for i, rid in enumerate(rids)]
            time.sleep(2)  # the recorder's batch
            seqs = [rollout_sequences(url, rid) for rid in rids]
            per_rollout = statistics.mean(len(s) for s in seqs)
            processed = sum(len(x["token_ids"]) for s in seqs for x in s)
            trajectory = sum(max(len(x["token_ids"]) for x in s) for s in seqs)
            calls = statistics.mean(sum(len(x["call_ids"]) for x in s) for s in seqs)
            splits = sorted({x["split_reason"] for s in seqs for x in s if x["split_reason"]})
            split = "; ".join(splits) or "-"
            rows.append((family, loop, calls, statistics.mean(called), per_rollout, processed / trajectory, split))
        procs.stop_all()
        procs.procs.clear()
    print(
        "\n| family | rollouts | calls/rollout | tool calls/rollout | sequences/rollout |"
        " tokens processed per trajectory token | splits |"
    )
    print("|---|---|---|---|---|---|---|")
    for family, loop, calls, tool_calls, per_rollout, ratio, splits in rows:
        print(f"| {family} | {loop} | {calls:.1f} | {tool_calls:.1f} | {per_rollout:.2f} | {ratio:.2f} | {splits} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("overhead", "sequences", "both", "families"), default="both")
    parser.add_argument(
        "--families", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="the families part's (one vLLM each)"
    )
    parser.add_argument("--calls", type=int, default=300, help="continuing calls timed per mode and stream kind")
    parser.add_argument("--connections", type=int, default=32, help="concurrent conversations for req/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of load per mode for req/s")
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts per task and mode (part 2)")
    parser.add_argument("--turns", type=int, default=10, help="calls of the synthetic tool loop (part 2)")
    parser.add_argument("--reps", type=int, default=3, help="trainer steps timed per mode (part 2)")
    parser.add_argument("--serve-engine", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_engine:
        serve_engine(args.serve_engine)
        return 0
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    procs = Processes()
    with tempfile.TemporaryDirectory(prefix="artgw-continuation-") as tmp:
        workdir = Path(tmp)
        try:
            if args.part in ("overhead", "both"):
                port = free_port()
                engine = procs.start([sys.executable, __file__, "--serve-engine", str(port)], workdir / "engine.log")
                wait_ready(f"http://127.0.0.1:{port}/health", engine, 30)
                urls = {
                    mode: start_gateway(procs, workdir, f"http://127.0.0.1:{port}", mode)
                    for mode in ("rerender", "splice")
                }
                print(
                    f"part 1: {args.calls} continuing calls per mode and kind, then {args.seconds:.0f} s at "
                    f"{args.connections} connections per mode ...",
                    flush=True,
                )
                print_overhead(
                    asyncio.run(overhead(urls, args.calls, args.connections, args.seconds)), args.connections
                )
                procs.stop_all()
                procs.procs.clear()
            if args.part in ("sequences", "both"):
                sequences_part(args, procs, workdir)
            if args.part == "families":
                families_part(args, procs, workdir)
        finally:
            procs.stop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
