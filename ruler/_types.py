"""RULER's value types: what goes in (trajectories), what comes out (scores and judge usage)."""

from __future__ import annotations

from typing import Any, Protocol

import msgspec


class Trajectory(msgspec.Struct, frozen=True):
    """One rollout as the judge sees it.

    ``messages`` are OpenAI chat message dicts exactly as sent and received, including
    assistant ``tool_calls`` and ``tool`` messages; ``tools`` is the request's tool list.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


class Criterion(msgspec.Struct, frozen=True):
    """One part of the task the judge scores separately; a trajectory's score is the weighted mean of its
    criteria's scores (weights need not add up to 1)."""

    name: str
    description: str
    weight: float = 1.0


class Score(msgspec.Struct, frozen=True):
    """The judge's score for one trajectory: ``score`` in [0, 1], higher is better; with criteria, each
    criterion's score too (``score`` is then their weighted mean)."""

    score: float
    explanation: str
    criteria: dict[str, float] | None = None


class JudgeUsage(msgspec.Struct, frozen=True):
    """What scoring one group cost.

    Tokens and cost add up over every judge response received, including rejected
    (invalid) answers that were retried. ``cost_usd`` is ``None`` when litellm does not
    know the judge model's price; it is ``0.0`` when no judge call was made.
    ``judge_calls`` counts every attempt, failed ones included.
    """

    prompt_tokens: int
    completion_tokens: int
    cost_usd: float | None
    judge_calls: int
    cache_hits: int
    judgements: int = 1  # a panel's judges x samples (judge_group); one for score_group


class ScoreResult(msgspec.Struct, frozen=True):
    """``scores[i]`` belongs to the i-th trajectory passed to ``score_group``."""

    scores: list[Score]
    usage: JudgeUsage


class RulerError(Exception):
    """The judge could not produce valid scores: a non-retryable judge error, retries
    exhausted, or an answer that is not one valid score per trajectory. The message
    says which."""


class JudgeCache(Protocol):
    """Where validated judge answers are kept, keyed by ``cache_key``."""

    async def get(self, key: str) -> str | None: ...

    async def put(self, key: str, value: str) -> None: ...


class MemoryJudgeCache:
    """A ``JudgeCache`` in a dict: per process, unbounded."""

    def __init__(self) -> None:
        self._entries: dict[str, str] = {}

    async def get(self, key: str) -> str | None:
        return self._entries.get(key)

    async def put(self, key: str, value: str) -> None:
        self._entries[key] = value

    def __len__(self) -> int:
        return len(self._entries)
