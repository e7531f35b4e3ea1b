"""The judge's prompt and answer: pure functions, no I/O.

The prompt shows the tools once (when every trajectory had the same ones) and the
longest common message prefix once, inside ``<context>``; each trajectory block then
holds only what follows that prefix. Messages are one compact JSON object per line.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from ruler._types import Criterion, RulerError, Score, Trajectory

DEFAULT_RUBRIC = """\
- A trajectory that achieves its goal always scores much higher than one that does not.
- Among trajectories that achieve the goal, the one that gets there more directly (fewer \
wasted steps, failed tool calls or detours) scores higher.
- A trajectory that makes real progress without finishing gets partial credit.
- Keep score gaps proportional: slightly better means slightly higher, much better means \
much higher."""
"""A generic rubric: the judge infers the task from the trajectories' own system and user
messages, so it serves most tasks without change."""

# Bump when the prompt or the answer format changes, so cached answers are not reused.
_PROMPT_VERSION = 2

_SYSTEM_TEMPLATE = """\
You are the judge in a reinforcement-learning loop. Every trajectory below was produced \
by an AI agent given the same goal. Compare the trajectories with each other and give \
each one a score between 0 and 1 for how well it did; the scores are used relative to \
each other, so rank carefully. If the goal is not stated, infer it from the context.

Grading standards:
{rubric}

Answer with JSON only: {{"scores": {{"1": {{"explanation": "...", "score": 0.0}}, \
"2": {{"explanation": "...", "score": 0.0}}, ...}}}}, an object with exactly one entry per \
trajectory id as its key; write the explanation (one or two sentences) before deciding \
the score."""

_CRITERIA_TEMPLATE = """

Score every trajectory on each of these criteria separately, each from 0 to 1:
{criteria}

Answer with JSON only: {{"scores": {{"1": {{"explanation": "...", "criteria": {example}}}, ...}}}}, an object \
with exactly one entry per trajectory id as its key, each with a score for every criterion; write the \
explanation (one or two sentences) before deciding the scores."""

_EMPTY_REMAINDER = "(no messages after the shared context)"


class _AnswerScore(msgspec.Struct):
    explanation: str
    score: float | None = None  # without criteria
    criteria: dict[str, float] | None = None  # with criteria: one score per criterion


class _LegacyAnswerScore(msgspec.Struct):
    trajectory_id: str | int  # a string in the old schema; a bare number is accepted too
    explanation: str
    score: float


class _Answer(msgspec.Struct):
    # The schema asks for {"1": {...}, "2": {...}}; the list of {"trajectory_id": ...}
    # entries (RULER's format before _PROMPT_VERSION 2) is accepted from judges that
    # ignore the schema.
    scores: dict[str, _AnswerScore] | list[_LegacyAnswerScore]


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON (sorted keys) used for equality, de-duplication and cache keys."""
    return msgspec.json.encode(value, order="sorted")


def common_prefix_length(trajectories: Sequence[Trajectory]) -> int:
    """Number of leading messages that are identical in every trajectory.

    Messages compare by canonical JSON, so a differing tool-call argument, id or any
    other field ends the prefix.
    """
    if not trajectories:
        return 0
    first = trajectories[0].messages
    limit = min(len(t.messages) for t in trajectories)
    for i in range(limit):
        reference = canonical_json(first[i])
        if any(canonical_json(t.messages[i]) != reference for t in trajectories[1:]):
            return i
    return limit


def _message_line(message: dict[str, Any]) -> str:
    # Role first, then the message's other fields as given; null and empty-container
    # fields (``"tool_calls": []``, ``"refusal": null``) carry nothing for the judge.
    shown: dict[str, Any] = {"role": message.get("role")}
    for key, value in message.items():
        if key == "role" or value is None or (isinstance(value, list | dict) and not value):
            continue
        shown[key] = value
    return msgspec.json.encode(shown).decode()


def _message_lines(messages: Sequence[dict[str, Any]]) -> str:
    return "\n".join(_message_line(m) for m in messages)


def _tool_lines(tools: Sequence[dict[str, Any]]) -> str:
    return "\n".join(msgspec.json.encode(t).decode() for t in tools)


def _system_text(rubric: str, criteria: Sequence[Criterion]) -> str:
    text = _SYSTEM_TEMPLATE.format(rubric=rubric.strip())
    if not criteria:
        return text
    # The criteria replace the single score: the answer format asked for at the end changes with them.
    listed = "\n".join(f"- {c.name}: {c.description.strip()}" for c in criteria)
    example = "{" + ", ".join(f'"{c.name}": 0.0' for c in criteria) + "}"
    return text.rsplit("\n\nAnswer with JSON only:", 1)[0] + _CRITERIA_TEMPLATE.format(criteria=listed, example=example)


def check_criteria(criteria: Sequence[Criterion]) -> None:
    """ValueError unless the criteria have distinct, non-empty names and finite weights >= 0 (one > 0)."""
    names = [c.name for c in criteria]
    if any(not name.strip() for name in names):
        raise ValueError("every criterion needs a name")
    if len(set(names)) != len(names):
        raise ValueError(f"criterion names must differ: {', '.join(names)}")
    if any(not (math.isfinite(c.weight) and c.weight >= 0) for c in criteria):
        raise ValueError("criterion weights must be finite numbers >= 0")
    if criteria and not any(c.weight > 0 for c in criteria):
        raise ValueError("at least one criterion needs a weight > 0")


def weighted_score(values: dict[str, float], criteria: Sequence[Criterion]) -> float:
    """The weighted mean of a trajectory's criterion scores: its score."""
    total = math.fsum(c.weight for c in criteria)
    return math.fsum(c.weight * values[c.name] for c in criteria) / total


def build_judge_messages(
    trajectories: Sequence[Trajectory],
    rubric: str,
    *,
    share_prefix: bool = True,
    criteria: Sequence[Criterion] = (),
) -> list[dict[str, str]]:
    """The judge's chat messages (system + user) for scoring ``trajectories`` with ids 1..n (with
    ``criteria``: a score per criterion each).

    ``share_prefix=False`` sends every trajectory whole (tools included): the baseline the
    prefix dedup is measured against (bench/ruler_dedup.py).
    """
    if not trajectories:
        raise ValueError("build_judge_messages needs at least one trajectory")
    n = len(trajectories)
    tools_shared = share_prefix and all(
        canonical_json(t.tools) == canonical_json(trajectories[0].tools) for t in trajectories
    )
    prefix = common_prefix_length(trajectories) if share_prefix else 0

    intro = "Each message is one JSON object per line."
    if prefix:
        intro += (
            " The context messages open every trajectory; each trajectory block holds only"
            " the messages that follow them."
        )
    parts = [intro]
    if tools_shared and trajectories[0].tools:
        parts.append(f"<tools>\n{_tool_lines(trajectories[0].tools)}\n</tools>")
    if prefix:
        parts.append(f"<context>\n{_message_lines(trajectories[0].messages[:prefix])}\n</context>")
    for i, trajectory in enumerate(trajectories, start=1):
        body = []
        if not tools_shared:
            body.append(f"<tools>\n{_tool_lines(trajectory.tools) if trajectory.tools else '(none)'}\n</tools>")
        remainder = trajectory.messages[prefix:]
        body.append(_message_lines(remainder) if remainder else _EMPTY_REMAINDER)
        parts.append(f'<trajectory id="{i}">\n' + "\n".join(body) + "\n</trajectory>")
    ids = ", ".join(f'"{i}"' for i in range(1, n + 1))
    if criteria:
        each = ", ".join(f'"{c.name}": <number from 0 to 1>' for c in criteria)
        shape = '{"scores": {"1": {"explanation": "...", "criteria": {' + each + "}}, ...}}"
    else:
        shape = '{"scores": {"1": {"explanation": "...", "score": <number from 0 to 1>}, ...}}'
    parts.append(
        f'Score each of the {n} trajectories (ids {ids}). Answer with JSON whose "scores" object has '
        f"exactly the keys {ids}: " + shape
    )
    return [
        {"role": "system", "content": _system_text(rubric, criteria)},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


def response_format(n: int, criteria: Sequence[Criterion] = ()) -> dict[str, Any]:
    """litellm/OpenAI ``response_format`` asking for one score per trajectory id 1..n.

    ``scores`` is an object whose keys are exactly "1".."n", all required, so a
    grammar-constrained judge (OpenAI strict mode, vLLM) can neither skip nor repeat an
    id; each value holds the explanation, then the score in [0, 1]. ``parse_judge_answer``
    checks all of it again for judges that ignore the schema.
    """
    ids = [str(i) for i in range(1, n + 1)]

    def number() -> dict[str, Any]:
        return {"type": "number", "minimum": 0, "maximum": 1}

    def score() -> dict[str, Any]:  # a fresh dict per id: nothing downstream sees shared objects
        if criteria:
            names = [c.name for c in criteria]
            by_criterion = {
                "type": "object",
                "properties": {name: number() for name in names},
                "required": names,
                "additionalProperties": False,
            }
            return {
                "type": "object",
                "properties": {"explanation": {"type": "string"}, "criteria": by_criterion},
                "required": ["explanation", "criteria"],
                "additionalProperties": False,
            }
        return {
            "type": "object",
            "properties": {
                "explanation": {"type": "string"},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["explanation", "score"],
            "additionalProperties": False,
        }

    scores = {
        "type": "object",
        "properties": {i: score() for i in ids},
        "required": ids,
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {"scores": scores},
        "required": ["scores"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "ruler_scores", "schema": schema, "strict": True}}


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


class _Pairs(list[tuple[str, Any]]):
    """A JSON object as the stdlib parser saw it: (key, value) pairs, repeats kept."""


def _score_keys(text: str, decoded: dict[str, Any]) -> list[str]:
    """The keys of the answer's ``scores`` object in document order, repeated keys included.

    msgspec keeps only the last of repeated object keys, which would hide a judge that
    scored one trajectory twice; the stdlib parser can report every key. Falls back to
    ``decoded``'s keys if the two parsers somehow disagree.
    """
    try:
        top = json.loads(text, object_pairs_hook=_Pairs)
    except (ValueError, RecursionError):
        return list(decoded)
    scores = [value for key, value in top if key == "scores"] if isinstance(top, _Pairs) else []
    if not scores or not isinstance(scores[-1], _Pairs):
        return list(decoded)
    keys = [key for key, _ in scores[-1]]
    return keys if set(keys) == decoded.keys() else list(decoded)


def _value(entry: _AnswerScore, tid: str, criteria: Sequence[Criterion]) -> tuple[float, dict[str, float] | None]:
    """(score, criterion scores) of one entry, each checked to be in [0, 1]."""
    if not criteria:
        if entry.score is None:
            raise RulerError(f'judge answer is not the expected JSON (trajectory {tid!r} has no "score")')
        return entry.score, None
    given = entry.criteria or {}
    missing = [c.name for c in criteria if c.name not in given]
    if missing:
        raise RulerError(f"judge answer is not the expected JSON (trajectory {tid!r} lacks {', '.join(missing)})")
    values = {c.name: given[c.name] for c in criteria}
    for name, value in values.items():
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise RulerError(f"judge score for trajectory {tid!r} on {name!r} is {value!r}, not in [0, 1]")
    return weighted_score(values, criteria), values


def parse_judge_answer(text: str, n: int, criteria: Sequence[Criterion] = ()) -> list[Score]:
    """The judge's scores for trajectory ids 1..n, in id order.

    Raises ``RulerError`` naming the problem unless the answer is JSON with exactly one
    entry per id and every score a finite number in [0, 1]. The expected shape is
    ``{"scores": {"1": {"explanation": ..., "score": ...}, ...}}``; the older list of
    ``{"trajectory_id": ..., "explanation": ..., "score": ...}`` entries is accepted too.
    A surrounding Markdown code fence is tolerated.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    if fenced:
        stripped = fenced.group(1)
    try:
        answer = msgspec.json.decode(stripped, type=_Answer)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise RulerError(f"judge answer is not the expected JSON ({exc}): {text[:200]!r}") from None

    if isinstance(answer.scores, dict):
        found = answer.scores
        entries = [(key, found[key]) for key in _score_keys(stripped, found)]
    else:
        entries = [(str(e.trajectory_id), _AnswerScore(e.explanation, e.score)) for e in answer.scores]

    by_id: dict[str, Score] = {}
    for key, entry in entries:
        raw = key.strip()
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= n:
            raise RulerError(f"judge answer has unknown trajectory id {raw!r}; expected ids 1..{n}")
        tid = str(int(raw))
        if tid in by_id:
            raise RulerError(f"judge answer scores trajectory {tid!r} more than once")
        value, by_criterion = _value(entry, tid, criteria)
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise RulerError(f"judge score for trajectory {tid!r} is {value!r}, not in [0, 1]")
        by_id[tid] = Score(score=value, explanation=entry.explanation, criteria=by_criterion)
    missing = [str(i) for i in range(1, n + 1) if str(i) not in by_id]
    if missing:
        raise RulerError(f"judge answer has {len(by_id)} scores for {n} trajectories; missing ids {', '.join(missing)}")
    return [by_id[str(i)] for i in range(1, n + 1)]


def cache_key(
    judge_model: str, rubric: str, trajectories: Sequence[Trajectory], criteria: Sequence[Criterion] = ()
) -> str:
    """sha256 (hex) of the canonical JSON of everything that decides the judge's answer (the trajectories in
    the order shown).

    ``litellm_params`` (api_base, temperature, ...) are deliberately not part of the key; nor is a sample's
    index: two samples showing the same order are the same prompt, and share one answer.
    """
    payload: dict[str, Any] = {
        "version": _PROMPT_VERSION,
        "judge_model": judge_model,
        "rubric": rubric,
        "trajectories": list(trajectories),
    }
    if criteria:  # without criteria the key is what it always was: older cached answers still count
        payload["criteria"] = list(criteria)
    return hashlib.sha256(canonical_json(payload)).hexdigest()
