"""RULER: score a group of trajectories relative to each other with an LLM judge (litellm).

A standalone library: it knows nothing about the gateway or the trainer.
"""

from ruler._prompt import (
    DEFAULT_RUBRIC,
    build_judge_messages,
    cache_key,
    common_prefix_length,
    parse_judge_answer,
)
from ruler._score import NEUTRAL_SCORE, check_judge_model, score_group
from ruler._types import JudgeCache, JudgeUsage, MemoryJudgeCache, RulerError, Score, ScoreResult, Trajectory

__all__ = [
    "DEFAULT_RUBRIC",
    "NEUTRAL_SCORE",
    "JudgeCache",
    "JudgeUsage",
    "MemoryJudgeCache",
    "RulerError",
    "Score",
    "ScoreResult",
    "Trajectory",
    "build_judge_messages",
    "cache_key",
    "check_judge_model",
    "common_prefix_length",
    "parse_judge_answer",
    "score_group",
]
