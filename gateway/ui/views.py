"""What the pages show, computed from the services' types: pure functions, no I/O."""

from __future__ import annotations

import datetime as dt
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from markupsafe import Markup

from store.adapters import AdapterRow
from store.trajectories import CallSummary, Trajectory

# ---------------------------------------------------------------- the token view


@dataclass(frozen=True, slots=True)
class Token:
    id: int
    text: str
    trained: bool  # sampled by the model: what the trainer trains on
    logprob: float | None  # the sampling logprob (sampled tokens only)
    diverges: bool = False  # a split sequence's first token that differs from the sequence before it


@dataclass(frozen=True, slots=True)
class CallPart:
    """One call's share of a sequence: the context it added, then what it sampled."""

    call: CallSummary | None
    tokens: list[Token]


@dataclass(frozen=True, slots=True)
class SequenceView:
    index: int
    split_reason: str | None
    parts: list[CallPart]
    trainable: int
    total: int


def token_view(trajectory: Trajectory, pieces: Callable[[list[int]], list[str]]) -> list[SequenceView]:
    """Every token of every sequence, cut at call boundaries (each call's new context + its sampled span)."""
    calls = {call.id: call for call in trajectory.calls}
    views = []
    previous: list[int] | None = None
    for index, sequence in enumerate(trajectory.sequences):
        texts = pieces(sequence.token_ids)
        first = _first_difference(previous, sequence.token_ids) if previous is not None else None
        tokens = [
            Token(token_id, text, bool(mask), logprob, position == first)
            for position, (token_id, text, mask, logprob) in enumerate(
                zip(sequence.token_ids, texts, sequence.sampled_mask, sequence.logprobs, strict=True)
            )
        ]
        previous = sequence.token_ids
        # Each call's part runs from the end of the previous call's sampled span to the end of its own.
        called = list(zip(sequence.call_ids, sequence.sampled_spans, strict=True)) if sequence.sampled_spans else []
        ends = [end for _, (_, end) in called]
        starts = [0, *ends[:-1]]
        parts = [CallPart(calls.get(cid), tokens[a:b]) for (cid, _), a, b in zip(called, starts, ends, strict=True)]
        tail = ends[-1] if ends else 0
        if tail < len(tokens):  # never with assembled sequences; shown rather than dropped if it happens
            parts.append(CallPart(None, tokens[tail:]))
        views.append(SequenceView(index, sequence.split_reason, parts, sequence.trainable_tokens, len(tokens)))
    return views


def _first_difference(before: list[int], now: list[int]) -> int:
    """Where `now` stops following `before`: the first position whose token differs (or the end of the shorter)."""
    return next((i for i, (a, b) in enumerate(zip(before, now, strict=False)) if a != b), min(len(before), len(now)))


# ---------------------------------------------------------------- groups


def advantages(rewards: Sequence[float | None], eps: float = 1e-6) -> list[float | None]:
    """GRPO's group-relative advantage, as the trainer computes it by default (trainer/loss.py, scale "group"):
    (reward - group mean) / (group population std + eps); exactly 0 when every reward is equal. None while any
    reward is missing."""
    if any(r is None for r in rewards) or not rewards:
        return [None] * len(rewards)
    values = [float(r) for r in rewards if r is not None]
    if max(values) == min(values):
        return [0.0] * len(values)
    mean, std = statistics.fmean(values), statistics.pstdev(values)
    return [(r - mean) / (std + eps) for r in values]


# ---------------------------------------------------------------- charts (inline SVG, drawn here)

WIDTH, HEIGHT, PAD = 520, 180, 36


def line_chart(title: str, points: Sequence[tuple[float, float]], *, css_class: str = "") -> Markup:
    """An SVG line chart of (step, value) points, with a <title> per point for the hover."""
    label = escape(title)
    if not points:
        return Markup(f'<p class="muted">{label}: no steps yet.</p>')
    xs, ys = [x for x, _ in points], [y for _, y in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y0 == y1:
        y0, y1 = y0 - 0.5, y1 + 0.5
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1

    def at(x: float, y: float) -> tuple[float, float]:
        return (
            PAD + (x - x0) / (x1 - x0) * (WIDTH - 2 * PAD),
            HEIGHT - PAD + (y - y0) / (y1 - y0) * (2 * PAD - HEIGHT),
        )

    coords = [at(x, y) for x, y in points]
    line = " ".join(f"{cx:.1f},{cy:.1f}" for cx, cy in coords)
    dots = "".join(
        f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3"><title>step {x:g}: {y:.4g}</title></circle>'
        for (cx, cy), (x, y) in zip(coords, points, strict=True)
    )
    axes = (
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" class="axis"/>'
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" class="axis"/>'
        f'<text x="{PAD - 4}" y="{PAD + 4}" text-anchor="end">{y1:.3g}</text>'
        f'<text x="{PAD - 4}" y="{HEIGHT - PAD}" text-anchor="end">{y0:.3g}</text>'
        f'<text x="{PAD}" y="{HEIGHT - PAD + 16}" text-anchor="middle">{x0:g}</text>'
        f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 16}" text-anchor="middle">{x1:g}</text>'
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 6}" text-anchor="middle">step</text>'
        f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" class="chart-title">{label}</text>'
    )
    return Markup(
        f'<svg class="chart {escape(css_class)}" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
        f'role="img" aria-label="{label}">{axes}<polyline points="{line}"/>{dots}</svg>'
    )


def step_charts(steps: Sequence[AdapterRow]) -> tuple[Markup, Markup]:
    """The reward-over-steps and loss charts of a model's committed steps."""
    measured = sorted((row for row in steps if row.metrics is not None), key=lambda row: row.step)
    reward = [(row.step, row.metrics.reward_mean) for row in measured if row.metrics]
    loss = [(row.step, row.metrics.loss) for row in measured if row.metrics]
    return line_chart("reward (mean over the step's rollouts)", reward, css_class="reward"), line_chart(
        "loss", loss, css_class="loss"
    )


# ---------------------------------------------------------------- formatting (Jinja filters)


def when(at: float | None) -> str:
    if at is None:
        return "–"
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def parse_since(since: str | None) -> float | None:
    """The list's `since` filter: an ISO date-time (UTC unless it says otherwise, as a datetime-local input
    sends it) or seconds since the epoch; ValueError otherwise."""
    if not since:
        return None
    try:
        return float(since)
    except ValueError:
        parsed = dt.datetime.fromisoformat(since)
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)).timestamp()


def pretty_json(value: Any) -> str:
    """Tool-call arguments and structured content, indented when they are JSON."""
    if isinstance(value, str):
        try:
            value = json.loads(text := value)
        except ValueError:
            return text
    return json.dumps(value, indent=2, ensure_ascii=False)


def message_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts (others as JSON)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part.get("text", "") if isinstance(part, dict) and "text" in part else pretty_json(part) for part in content
        )
    return pretty_json(content)


FILTERS: dict[str, Callable[..., Any]] = {"when": when, "pretty_json": pretty_json, "message_text": message_text}
