"""The demo task: an agent looks up the ballots cast on a motion and reports, with a tool, whether it passed.

One episode is one rollout of two calls, made with the unmodified OpenAI SDK against the gateway; both
are tool calls that `tool_choice` names, so vLLM samples them under a grammar (structured outputs make
even a random-weight model's calls well-formed):

1. The user asks whether a motion passed. The model calls `get_ballots()` (no arguments).
2. The tool returns the ballots, e.g. `yes,no,yes,yes,...`: 41 to 61 of them, 65-95 % on one side.
3. The model calls `report(passed)`, whose one argument is an enum, `"yes"` (the motion passed) or
   `"no"` (`strict`). Which value the call carries is the model's one choice in the episode.

The reward is objective and the tool call decides it: 1.0 if `report`'s `passed` is the side with more
ballots, else 0.0. A random agent scores 0.5 on average; one that reads the ballots scores 1.0.

Why this task for the tiny model: the random-weight 2-layer model attends almost uniformly over its
context, so where `report`'s value starts it sees the ballots as a bag of tokens; which side is in the
majority is a linear read-out of that bag, which a LoRA learns in a few GRPO steps. There is no warm
start: the base model reports at chance (held-out reward ~0.5 at step 0) and every point above that is
learned by the RL steps. What it does not learn in minutes: copying a value from a given position (a
code, a key); picking a tool argument from a word or two of the question (`get_ballots(chamber)`, the
question naming one of two chambers, was tried: the argument stayed at chance for 32 steps while the
answer to the ballots was learned); and a supervised warm start of a tool-calling format makes the
answer position saturate and the read-out unlearnable.

Token fidelity and what is trained. vLLM reports the logprobs of tokens sampled under a grammar after
the grammar's mask, and before logits processors such as `logit_bias` and temperature; the trainer
rebuilds the grammar from the recorded request and scores the calls' tokens under the same mask
(`artgw train --train-constrained`, the default), so they are trained with the model's own masked
distribution, the value of `passed` included.

The calls' `logit_bias`. The grammar fixes each call's text up to whitespace and up to how that text is
split into tokens, and a random model makes those choices at random: some 60 of them an episode, none
of which has anything to do with the reward, and trained, they drown the one that does (in a simulation
of this setup the reported value stayed at chance for 16 steps). So each call sends a `logit_bias`
(`call_logit_bias`): +100 on the tokens of its text's own tokenization, -100 on whitespace tokens. Of the
tokens the grammar allows at a position that leaves one favoured, except where the value of `passed`
starts: `yes` or `no`, both at +100, so the model's own preference decides. Every attempt then writes the
same calls but for that value, so the gradients of the calls' other tokens (scored, as always, under the
model's own masked distribution) cancel within a GRPO group, whose advantages sum to zero, but for the few
after the value; and greedy decoding (temperature 0) writes a well-formed call, not whitespace forever.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from client import ArtClient
from store.api import GroupCreate, GroupOut, RolloutIn

Split = Literal["train", "heldout"]

ANSWERS = ("yes", "no")  # the enum of `report`'s `passed`
SYSTEM_PROMPT = "You count votes. Call get_ballots, then call report: passed is yes if the motion passed, else no."
BALLOTS_TOOL = "get_ballots"
REPORT_TOOL = "report"
ARGUMENT = "passed"  # report's one argument


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(properties),
                "additionalProperties": False,
            },
        },
    }


TOOLS: list[dict[str, Any]] = [
    _tool(BALLOTS_TOOL, "The ballots cast on the motion.", {}),
    _tool(REPORT_TOOL, "Report whether the motion passed.", {ARGUMENT: {"type": "string", "enum": list(ANSWERS)}}),
]
# The text of each call as the grammar (vLLM's hermes structural tag, compact) lets it be written: its tokens
# are the ones call_logit_bias favours.
CALL_TEXTS: dict[str, tuple[str, ...]] = {
    BALLOTS_TOOL: ('<tool_call>{"name": "get_ballots", "arguments": {}}</tool_call><|im_end|>',),
    REPORT_TOOL: tuple(
        f'<tool_call>{{"name": "report", "arguments": {{"{ARGUMENT}": "{a}"}}}}</tool_call><|im_end|>' for a in ANSWERS
    ),
}
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
TOOL_CALL_MAX_TOKENS = 64  # a call is about 25 tokens as call_logit_bias has it written


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
        """The correct value of `passed`: `yes` if more yes than no ballots."""
        return "yes" if self.ballots.count("yes") * 2 > len(self.ballots) else "no"

    def tool_result(self) -> str:
        return ",".join(self.ballots)

    def ballots_summary(self) -> str:
        return f"{self.ballots.count('yes')} yes, {self.ballots.count('no')} no"


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


def parse_argument(arguments: str | None) -> str | None:
    """The value of `passed` in a `report` call's `arguments` (a JSON object), or None if it has no valid one."""
    try:
        value = json.loads(arguments or "")
    except ValueError:
        return None
    passed = value.get(ARGUMENT) if isinstance(value, dict) else None
    return passed if passed in ANSWERS else None


def reward(answer: str | None, scenario: Scenario) -> float:
    """1.0 if the reported `passed` is the side with more ballots, else 0.0."""
    return 1.0 if answer == scenario.verdict else 0.0


def call_logit_bias(model_dir: str | Path) -> dict[str, dict[str, int]]:
    """Each tool's call `logit_bias` (token ids of the model's tokenizer): +100 on the tokens of the call's text
    (CALL_TEXTS), but for those that begin another of them (`{` of `{"`: one token possible at each position),
    and -100 on whitespace tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    whitespace = {i for i in range(vocab_size) if tokenizer.decode([i], skip_special_tokens=False).isspace()}
    biases = {}
    for tool, texts in CALL_TEXTS.items():
        ids = {i for text in texts for i in tokenizer.encode(text, add_special_tokens=False).ids}
        names = {i: tokenizer.id_to_token(i) for i in ids}
        favoured = {i for i in ids if not any(j != i and names[j].startswith(names[i]) for j in ids)}
        biases[tool] = {str(i): 100 for i in sorted(favoured - whitespace)} | {str(i): -100 for i in sorted(whitespace)}
    return biases


# -----------------------------------------------------------------------------
# the agent: the unmodified OpenAI SDK, pointed at the gateway


@dataclass
class Episode:
    scenario_id: str
    rollout_id: str
    called_tool: bool  # the get_ballots call was complete: it saw the ballots
    answer: str | None  # the `passed` its report call carried
    reward: float
    error: str | None = None
    reported: bool = False  # the report call was complete
    finish_reason: str | None = None  # the last call's ("length": cut at max_tokens)


def first_turn(scenario: Scenario) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": scenario.question}]


def _call(completion: Any, name: str) -> Any:
    """The completion's first call of tool `name`, or None (cut by max_tokens before it was complete)."""
    calls = [c for c in completion.choices[0].message.tool_calls or [] if c.function.name == name]
    return calls[0] if calls else None


async def run_episode(
    client: Any,  # openai.AsyncOpenAI
    scenario: Scenario,
    *,
    model: str,
    logit_bias: dict[str, dict[str, int]],
    rollout_id: str | None = None,
    temperature: float = 1.0,
) -> Episode:
    """One attempt: ask, let the model call get_ballots, hand it the ballots, read the value it reports.

    `logit_bias`: call_logit_bias's, by tool. `temperature` 0 decodes both calls greedily.
    """
    rollout_id = rollout_id or f"{scenario.id}-{uuid.uuid4().hex[:8]}"
    headers = {"X-ART-Rollout-Id": rollout_id}
    messages = first_turn(scenario)

    async def call(tool: str) -> Any:
        completion = await client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": tool}},
            max_tokens=TOOL_CALL_MAX_TOKENS,
            temperature=temperature,
            logit_bias=logit_bias[tool],
            extra_headers=headers,
        )
        return completion, _call(completion, tool)

    first, ballots_call = await call(BALLOTS_TOOL)
    if ballots_call is None:  # it never saw the ballots
        return Episode(scenario.id, rollout_id, False, None, 0.0)
    messages.append(
        {
            "role": "assistant",
            "content": first.choices[0].message.content or "",
            "tool_calls": [{"id": ballots_call.id, "type": "function", "function": ballots_call.function.model_dump()}],
        }
    )
    messages.append({"role": "tool", "tool_call_id": ballots_call.id, "content": scenario.tool_result()})
    _, report = await call(REPORT_TOOL)
    if report is None:
        return Episode(scenario.id, rollout_id, True, None, 0.0)
    answer = parse_argument(report.function.arguments)
    return Episode(scenario.id, rollout_id, True, answer, reward(answer, scenario), reported=True)


async def run_episodes(
    client: Any,
    jobs: Sequence[tuple[Scenario, str]],
    *,
    model: str,
    logit_bias: dict[str, dict[str, int]],
    temperature: float = 1.0,
    concurrency: int = 16,
    on_done: Callable[[Episode], None] | None = None,
) -> list[Episode]:
    """Run (scenario, rollout id) jobs concurrently; an episode that fails is kept, reward 0, with its error."""

    async def one(scenario: Scenario, rollout_id: str) -> Episode:
        return await run_episode(
            client, scenario, model=model, logit_bias=logit_bias, rollout_id=rollout_id, temperature=temperature
        )

    return await gather_episodes(jobs, one, concurrency=concurrency, on_done=on_done)


async def gather_episodes(
    jobs: Sequence[tuple[Any, str]],
    run_one: Callable[[Any, str], Awaitable[Episode]],
    *,
    concurrency: int = 16,
    on_done: Callable[[Episode], None] | None = None,
) -> list[Episode]:
    """Run (scenario, rollout id) jobs with `run_one`, `concurrency` at a time; an episode that fails is kept,
    reward 0, with its error (any task's: the real model's too)."""
    slots = asyncio.Semaphore(concurrency)

    async def one(scenario: Any, rollout_id: str) -> Episode:
        async with slots:
            try:
                episode = await run_one(scenario, rollout_id)
            except Exception as exc:  # an episode's failure is data, not the end of the run
                scenario_id = str(getattr(scenario, "id", scenario))
                episode = Episode(scenario_id, rollout_id, False, None, 0.0, error=_error_chain(exc))
        if on_done is not None:
            on_done(episode)
        return episode

    return list(await asyncio.gather(*(one(s, r) for s, r in jobs)))


def _error_chain(exc: BaseException) -> str:
    """The error and what caused it ("APIConnectionError: Connection error." says nothing on its own)."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 4:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return " <- ".join(parts)


def group_body(model: str, episodes: Sequence[Episode], *, group_id: str, task: str = "ballots-report") -> GroupCreate:
    """The group posted for the attempts at one scenario: each attempt's reward, and what it did as metrics."""
    return GroupCreate(
        model=model,
        group_id=group_id,
        rollouts=[
            RolloutIn(
                rollout_id=e.rollout_id,
                reward=e.reward,
                metrics={"called_tool": float(e.called_tool), "reported": float(e.reported)},
            )
            for e in episodes
        ],
        metadata={"scenario": episodes[0].scenario_id, "task": task},
    )


def post_group(
    gateway: ArtClient, model: str, episodes: Sequence[Episode], *, group_id: str, task: str = "ballots-report"
) -> GroupOut:
    """Post the attempts at one scenario with their rewards (idempotent by group id), with `gateway`'s key: one
    with the `reward` scope, or the admin key."""
    return gateway.post_group(group_body(model, episodes, group_id=group_id, task=task))
