"""The real model's demo task (`artgw demo --model smollm2`): a question with a few allowed answers, one call.

SmolLM2-135M-Instruct (`artgw.real_model`) is asked a short question and answers in JSON, the answer an enum of
the allowed values (`response_format` json_schema: vLLM samples under the grammar, and the trainer scores the
tokens under the same grammar's masks). Which value it writes is its one choice; the reward is 1.0 if that is the
right answer, else 0.0. There is no `logit_bias` and no warm start: the model is trained, its format choices
(whitespace, token splits) are peaked, and every point above its base accuracy is learned by the RL steps.

Two tasks were measured as candidates (bench/real_model_tasks.py: the base model is below chance on both, and
most groups of samples disagree, so GRPO has a signal); `TASKS` keeps both, the demo runs `DEFAULT_TASK`, the one
whose held-out reward rose most reliably in short GRPO runs (bench/README.md has the runs):

- `larger`: "Which number is larger: 57 or 83?", the answer one of the two numbers (chance 0.5).
- `sum`: "What is 34 + 27?", the answer one of a+b-10, a+b, a+b+1, a+b+10 (chance 0.25; only the schema's enum
  shows the choices, the question none of them).

Held-out questions never share a pair of numbers with the training ones: a pair is held out iff its key is a
multiple of 5 (`_held_out`).
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_args

from artgw.demo_config import DEFAULT_TASK, TaskName  # noqa: F401 (the demo's task: real_task.DEFAULT_TASK)
from artgw.demo_task import Episode, Split, gather_episodes

MAX_TOKENS = 24  # an answer is ~8 tokens ({"answer": "83"}); a cut one is wrong


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    options: tuple[str, ...]  # the answers allowed (the schema's enum)
    correct: str


def _held_out(a: int, b: int) -> bool:
    """The split of a pair of numbers, whichever comes first."""
    return (min(a, b) + 3 * max(a, b)) % 5 == 0


def _larger(rng: random.Random) -> tuple[str, list[str], str, tuple[int, int]]:
    a, b = rng.sample(range(10, 100), 2)
    return f"Which number is larger: {a} or {b}?", [str(a), str(b)], str(max(a, b)), (a, b)


def _sum(rng: random.Random) -> tuple[str, list[str], str, tuple[int, int]]:
    a, b = rng.randint(10, 60), rng.randint(10, 39)
    options = sorted({a + b - 10, a + b, a + b + 1, a + b + 10})
    return f"What is {a} + {b}?", [str(o) for o in options], str(a + b), (a, b)


TASKS: dict[TaskName, Callable[[random.Random], tuple[str, list[str], str, tuple[int, int]]]] = {
    "larger": _larger,
    "sum": _sum,
}
assert set(TASKS) == set(get_args(TaskName))


def questions(task: TaskName, split: Split, n: int, seed: int = 0) -> list[Question]:
    """`n` questions of a task's split: deterministic in (task, split, seed); the splits share no pair."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    make = TASKS[task]
    rng = random.Random(f"artgw-real:{task}:{seed}")
    out: list[Question] = []
    while len(out) < n:
        question, options, correct, pair = make(rng)
        if _held_out(*pair) == (split == "heldout"):
            out.append(Question(f"{task}-{split}-{seed}-{len(out)}", question, tuple(options), correct))
    return out


def request(question: Question) -> dict[str, Any]:
    """The chat request's messages and constraint (what an app would send)."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": list(question.options)}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    return {
        "messages": [{"role": "user", "content": f"{question.question} Answer in JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    }


def parse_answer(content: str | None, question: Question) -> str | None:
    """The answer a reply's JSON carries, or None (cut at max_tokens, or not one of the options)."""
    try:
        value = json.loads(content or "")
    except ValueError:
        return None
    answer = value.get("answer") if isinstance(value, dict) else None
    return answer if answer in question.options else None


async def run_episode(
    client: Any,  # openai.AsyncOpenAI
    question: Question,
    *,
    model: str,
    rollout_id: str | None = None,
    temperature: float = 1.0,
) -> Episode:
    """One attempt: one call, its JSON answer scored against the right one."""
    rollout_id = rollout_id or f"{question.id}-{uuid.uuid4().hex[:8]}"
    reply = await client.chat.completions.create(
        model=model,
        max_tokens=MAX_TOKENS,
        temperature=temperature,
        extra_headers={"X-ART-Rollout-Id": rollout_id},
        **request(question),
    )
    (choice,) = reply.choices
    answer = parse_answer(choice.message.content, question)
    reward = 1.0 if answer == question.correct else 0.0
    return Episode(
        question.id, rollout_id, True, answer, reward, reported=answer is not None, finish_reason=choice.finish_reason
    )


async def run_episodes(
    client: Any,
    jobs: Sequence[tuple[Question, str]],
    *,
    model: str,
    temperature: float = 1.0,
    concurrency: int = 16,
    on_done: Callable[[Episode], None] | None = None,
) -> list[Episode]:
    """Run (question, rollout id) jobs concurrently; an episode that fails is kept, reward 0, with its error."""

    async def one(question: Question, rollout_id: str) -> Episode:
        return await run_episode(client, question, model=model, rollout_id=rollout_id, temperature=temperature)

    return await gather_episodes(jobs, one, concurrency=concurrency, on_done=on_done)
