"""The demo task: an agent looks up the ballots cast on a motion and says whether it passed.

One episode is one rollout of two calls, made with the unmodified OpenAI SDK against the gateway:

1. The user asks whether a motion passed. The model is given one tool, `get_ballots()`, and calls it
   (`tool_choice` names the tool; vLLM's structured outputs make even a random-weight model's call
   well-formed).
2. The tool returns the ballots, e.g. `yes,no,yes,yes,...`: 41 to 61 of them, 65-95 % on one side.
3. The model answers `yes` (the motion passed) or `no`, in one token: the classic OpenAI
   classification call, `logit_bias` +100 on the two answer tokens and `max_tokens=1`.

The reward is objective: 1.0 if the answer is the side with more ballots, else 0.0. A random
answer scores 0.5 on average; a model that reads the ballots scores 1.0.

Why this task for the tiny model: the random-weight 2-layer model attends almost uniformly over its
context, so at the answer position it sees the ballots as a bag of tokens; which side is in the
majority is a linear read-out of that bag, which a LoRA learns in a few GRPO steps. There is no
warm start: the base model answers at chance (held-out reward ~0.5 at step 0) and every point above
that is learned by the RL steps. (Copying a value from a given position, a code or a key, is not
learnable in minutes at this size, and a supervised warm start of a tool-calling format makes the
answer position saturate and the read-out unlearnable: both were tried.)

Token fidelity and what is trained. vLLM reports logprobs *before* logits processors such as
`logit_bias` and temperature: the answer token's logprob is the model's own, the one the trainer
recomputes, so the answer is trained exactly on-policy. The tool call is sampled under a grammar
(the named `tool_choice`), and vLLM reports those logprobs *after* the grammar's mask (about -0.7 or
exactly 0 where the model's own are about -7): the gateway flags such calls and the trainer scores their
tokens under the same grammar's masks (trainer/grammar.py), so they are trained on-policy too. The call
has no arguments, so what it contains cannot change the reward: the learning is in the answer.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

Split = Literal["train", "heldout"]

ANSWERS = ("yes", "no")
SYSTEM_PROMPT = "You count votes. Call get_ballots, then answer yes if the motion passed, else no."
TOOL_NAME = "get_ballots"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "The ballots cast on the motion.",
            "strict": True,
            "parameters": {"type": "object", "properties": {}, "required": [], "additionalProperties": False},
        },
    }
]
QUESTIONS = (
    'Did the motion "{motion}" pass?',
    'Was the motion "{motion}" adopted?',
    'Motion "{motion}": did it carry?',
    'Tell me if "{motion}" passed.',
)
# Motion names: disjoint pools for training and held-out scenarios.
_TRAIN_MOTIONS = (
    "Paris London Tokyo Berlin Rome weather city today tomorrow time date help world model train reward "
    "value key list item count search error json string object array type budget roads parks schools"
).split()
_HELDOUT_MOTIONS = (
    "harbor library museum bridge tunnel market garden stadium river forest airport station hospital "
    "theater castle tower canal beach valley island"
).split()
MIN_BALLOTS, MAX_BALLOTS = 41, 61  # odd counts only: never a tie
MIN_SHARE, MAX_SHARE = 0.65, 0.95  # share of the majority side
TOOL_CALL_MAX_TOKENS = 128  # a random model pads the grammar's `{}` with whitespace for a while


# -----------------------------------------------------------------------------
# scenarios and reward


@dataclass(frozen=True)
class Scenario:
    id: str
    motion: str
    question: str
    ballots: tuple[str, ...]

    @property
    def verdict(self) -> str:
        """The correct answer: `yes` if more yes than no ballots."""
        return "yes" if self.ballots.count("yes") * 2 > len(self.ballots) else "no"

    def tool_result(self) -> str:
        return ",".join(self.ballots)


def scenarios(split: Split, n: int, seed: int = 0) -> list[Scenario]:
    """`n` scenarios of a split: deterministic in (split, seed); the two splits never share a motion."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"artgw-demo:{split}:{seed}")
    pool = _TRAIN_MOTIONS if split == "train" else _HELDOUT_MOTIONS
    out = []
    for i in range(n):
        motion = rng.choice(pool)
        count = rng.randrange(MIN_BALLOTS, MAX_BALLOTS + 1, 2)
        share = rng.uniform(MIN_SHARE, MAX_SHARE)
        majority_side = rng.choice(ANSWERS)
        minority_side = "no" if majority_side == "yes" else "yes"
        majority = min(max(round(share * count), count // 2 + 1), count)
        ballots = [majority_side] * majority + [minority_side] * (count - majority)
        rng.shuffle(ballots)
        question = rng.choice(QUESTIONS).format(motion=motion)
        out.append(Scenario(f"{split}-{seed}-{i}", motion, question, tuple(ballots)))
    return out


def normalize_answer(text: str | None) -> str:
    return (text or "").strip().strip(".!").strip().lower()


def reward(answer: str | None, scenario: Scenario) -> float:
    """1.0 for the side with more ballots, else 0.0."""
    return 1.0 if normalize_answer(answer) == scenario.verdict else 0.0


# -----------------------------------------------------------------------------
# the agent: the unmodified OpenAI SDK, pointed at the gateway


@dataclass
class Episode:
    scenario_id: str
    rollout_id: str
    called_tool: bool
    answer: str | None
    reward: float
    error: str | None = None


def answer_logit_bias(model_dir: str | Path) -> dict[str, int]:
    """OpenAI `logit_bias` restricting a one-token answer to `yes` / `no` (ids in the model's vocabulary)."""
    vocab = json.loads((Path(model_dir) / "tokenizer.json").read_text())["model"]["vocab"]
    return {str(vocab[a]): 100 for a in ANSWERS}


def first_turn(scenario: Scenario) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": scenario.question}]


async def run_episode(
    client: Any,  # openai.AsyncOpenAI
    scenario: Scenario,
    *,
    model: str,
    logit_bias: dict[str, int],
    rollout_id: str | None = None,
    temperature: float = 1.0,
    answer_temperature: float | None = None,
) -> Episode:
    """One attempt: ask, let the model call the tool, hand it the ballots, read its one-word answer.

    `answer_temperature` (default: `temperature`) applies to the answer only: 0 makes it greedy. The
    tool call is always sampled (greedy decoding of a random model pads the grammar's `{}` forever).
    """
    rollout_id = rollout_id or f"{scenario.id}-{uuid.uuid4().hex[:8]}"
    headers = {"X-ART-Rollout-Id": rollout_id}
    messages = first_turn(scenario)
    first = await client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": TOOL_NAME}},
        max_tokens=TOOL_CALL_MAX_TOKENS,
        temperature=temperature,
        extra_headers=headers,
    )
    calls = [c for c in first.choices[0].message.tool_calls or [] if c.function.name == TOOL_NAME]
    if not calls:  # cut by max_tokens before the call was complete: it never saw the ballots
        return Episode(scenario.id, rollout_id, False, None, 0.0)
    call = calls[0]
    messages.append(
        {
            "role": "assistant",
            "content": first.choices[0].message.content or "",
            "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call.id, "content": scenario.tool_result()})
    second = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=1,
        temperature=temperature if answer_temperature is None else answer_temperature,
        logit_bias=logit_bias,
        extra_headers=headers,
    )
    answer = second.choices[0].message.content
    return Episode(scenario.id, rollout_id, True, answer, reward(answer, scenario))


async def run_episodes(
    client: Any,
    jobs: Sequence[tuple[Scenario, str]],
    *,
    model: str,
    logit_bias: dict[str, int],
    temperature: float = 1.0,
    answer_temperature: float | None = None,
    concurrency: int = 16,
    on_done: Callable[[Episode], None] | None = None,
) -> list[Episode]:
    """Run (scenario, rollout id) jobs concurrently; an episode that fails is kept, reward 0, with its error."""
    slots = asyncio.Semaphore(concurrency)

    async def one(scenario: Scenario, rollout_id: str) -> Episode:
        async with slots:
            try:
                episode = await run_episode(
                    client,
                    scenario,
                    model=model,
                    logit_bias=logit_bias,
                    rollout_id=rollout_id,
                    temperature=temperature,
                    answer_temperature=answer_temperature,
                )
            except Exception as exc:  # an episode's failure is data, not the end of the run
                episode = Episode(scenario.id, rollout_id, False, None, 0.0, error=f"{type(exc).__name__}: {exc}")
        if on_done is not None:
            on_done(episode)
        return episode

    return list(await asyncio.gather(*(one(s, r) for s, r in jobs)))


def group_body(model: str, episodes: Sequence[Episode], *, group_id: str) -> dict[str, Any]:
    """The `POST /v1/art/groups` body for the attempts at one scenario."""
    return {
        "model": model,
        "group_id": group_id,
        "rollouts": [
            {"rollout_id": e.rollout_id, "reward": e.reward, "metrics": {"called_tool": float(e.called_tool)}}
            for e in episodes
        ],
        "metadata": {"scenario": episodes[0].scenario_id, "task": "ballots"},
    }


def post_group(
    gateway: str, model: str, episodes: Sequence[Episode], *, group_id: str, timeout: float = 60.0
) -> dict[str, Any]:
    """POST /v1/art/groups: the attempts at one scenario with their rewards (idempotent by group id)."""
    answer = httpx.post(
        f"{gateway.rstrip('/')}/v1/art/groups", json=group_body(model, episodes, group_id=group_id), timeout=timeout
    )
    if answer.status_code not in (200, 201):
        raise RuntimeError(f"POST /v1/art/groups answered {answer.status_code}: {answer.text[:300]}")
    return dict(answer.json())
