"""RULER: score a group of trajectories relative to each other with an LLM judge (litellm).

A standalone library: it knows nothing about the gateway or the trainer.
"""

from ruler._panel import Judge, Judgement, PanelResult, agreement, judge_group, orders, spearman
from ruler._prompt import (
    DEFAULT_RUBRIC,
    build_judge_messages,
    cache_key,
    check_criteria,
    common_prefix_length,
    parse_judge_answer,
)
from ruler._score import NEUTRAL_SCORE, check_judge_model, score_group
from ruler._types import (
    Criterion,
    JudgeCache,
    JudgeUsage,
    MemoryJudgeCache,
    RulerError,
    Score,
    ScoreResult,
    Trajectory,
)

__all__ = [
    "DEFAULT_RUBRIC",
    "NEUTRAL_SCORE",
    "Criterion",
    "Judge",
    "JudgeCache",
    "JudgeUsage",
    "Judgement",
    "MemoryJudgeCache",
    "PanelResult",
    "RulerError",
    "Score",
    "ScoreResult",
    "Trajectory",
    "agreement",
    "build_judge_messages",
    "cache_key",
    "check_criteria",
    "check_judge_model",
    "common_prefix_length",
    "judge_group",
    "orders",
    "parse_judge_answer",
    "score_group",
    "spearman",
]
