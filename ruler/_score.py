"""score_group: one litellm judge call per group of trajectories, with de-duplication,
caching and retries."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, cast

from opentelemetry.trace import SpanKind, Tracer

from ruler._prompt import (
    DEFAULT_RUBRIC,
    build_judge_messages,
    cache_key,
    canonical_json,
    check_criteria,
    parse_judge_answer,
    response_format,
)
from ruler._types import Criterion, JudgeCache, JudgeUsage, RulerError, Score, ScoreResult, Trajectory

logger = logging.getLogger("ruler")

NEUTRAL_SCORE = 0.5
"""Given to every trajectory of a group whose trajectories are all identical (or that has
only one). RULER scores are relative, so such a group carries no signal; any equal value
gives every member a zero GRPO advantage, and 0.5 is the middle of the scale."""

# score_group sets these itself; passing them in litellm_params is an error, not an override.
_RESERVED_PARAMS = frozenset({"model", "messages", "response_format", "stream"})


def _litellm() -> ModuleType:
    # Imported on first use: litellm is the optional ``ruler`` extra and slow to import,
    # and without this it fetches its price map from the internet at import time.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return cast(ModuleType, litellm)  # the type checker skips litellm (pyproject.toml): it is Any there


def _is_transient(exc: Exception, litellm: ModuleType) -> bool:
    transient = (
        litellm.APIConnectionError,
        litellm.Timeout,
        litellm.RateLimitError,
        litellm.ServiceUnavailableError,
        litellm.InternalServerError,
        litellm.BadGatewayError,
    )
    if isinstance(exc, transient):
        return True
    # litellm's catch-all APIError: retry server-side failures only.
    return isinstance(exc, litellm.APIError) and (getattr(exc, "status_code", 0) or 0) >= 500


def _content(response: Any) -> str:
    choices = getattr(response, "choices", None) or []
    if not choices:
        raise RulerError("judge response has no choices")
    content = getattr(choices[0].message, "content", None)
    if not content:
        raise RulerError(f"judge response has no content (finish_reason={choices[0].finish_reason!r})")
    return str(content)


def _no_call_usage(*, cache_hits: int) -> JudgeUsage:
    return JudgeUsage(prompt_tokens=0, completion_tokens=0, cost_usd=0.0, judge_calls=0, cache_hits=cache_hits)


async def score_group(
    trajectories: Sequence[Trajectory],
    *,
    judge_model: str,
    rubric: str = DEFAULT_RUBRIC,
    criteria: Sequence[Criterion] = (),
    litellm_params: Mapping[str, Any] | None = None,
    cache: JudgeCache | None = None,
    max_retries: int = 3,
    backoff_seconds: float = 0.5,
    tracer: Tracer | None = None,
) -> ScoreResult:
    """Score a group of trajectories relative to each other with an LLM judge.

    Identical trajectories are judged once and share the score; a group with fewer than
    two distinct trajectories gets ``NEUTRAL_SCORE`` for all without a judge call. With a
    ``cache``, a validated answer for the same judge model, rubric and distinct
    trajectories is reused. ``litellm_params`` (api_base, api_key, temperature, ...) go to
    ``litellm.acompletion`` as given and are never logged. With ``criteria`` the judge scores each criterion
    (one schema-enforced answer) and a trajectory's score is their weighted mean.

    Transient judge errors (connection, timeout, rate limit, 5xx) and invalid answers are
    retried up to ``max_retries`` times after the first attempt, waiting
    ``backoff_seconds * 2**k`` before retry k+1; other errors (auth, bad request, unknown
    model) raise ``RulerError`` at once.

    With an OpenTelemetry ``tracer``, each judge call is a span (GenAI conventions: ``chat <judge_model>``), a
    child of the caller's current span.
    """
    if max_retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    if backoff_seconds < 0:
        raise ValueError(f"backoff_seconds must be >= 0, got {backoff_seconds}")
    check_criteria(criteria)
    params = dict(litellm_params or {})
    reserved = sorted(_RESERVED_PARAMS & params.keys())
    if reserved:
        raise ValueError(f"litellm_params must not set {', '.join(reserved)}: score_group sets them")

    # De-duplicate by canonical JSON; slot[i] is the distinct index of trajectories[i].
    index_of: dict[bytes, int] = {}
    distinct: list[Trajectory] = []
    slot: list[int] = []
    for trajectory in trajectories:
        index = index_of.setdefault(canonical_json(trajectory), len(distinct))
        if index == len(distinct):
            distinct.append(trajectory)
        slot.append(index)

    if len(distinct) < 2:
        reason = "the group has one trajectory" if len(trajectories) == 1 else "all trajectories are identical"
        neutral = Score(
            score=NEUTRAL_SCORE,
            explanation=f"Not judged: {reason}, so relative scoring has nothing to compare.",
            criteria={c.name: NEUTRAL_SCORE for c in criteria} if criteria else None,
        )
        return ScoreResult(scores=[neutral] * len(trajectories), usage=_no_call_usage(cache_hits=0))

    key = cache_key(judge_model, rubric, distinct, criteria)
    if cache is not None:
        cached = await cache.get(key)
        if cached is not None:
            try:
                scores = parse_judge_answer(cached, len(distinct), criteria)
            except RulerError as exc:
                logger.warning("ruler: ignoring unusable cached judge answer %s: %s", key[:12], exc)
            else:
                return ScoreResult(scores=[scores[i] for i in slot], usage=_no_call_usage(cache_hits=1))

    answer, scores, usage = await _judge(
        distinct,
        judge_model=judge_model,
        rubric=rubric,
        criteria=criteria,
        params=params,
        max_retries=max_retries,
        backoff_seconds=backoff_seconds,
        tracer=tracer,
    )
    if cache is not None:
        await cache.put(key, answer)
    return ScoreResult(scores=[scores[i] for i in slot], usage=usage)


async def _judge(
    trajectories: Sequence[Trajectory],
    *,
    judge_model: str,
    rubric: str,
    criteria: Sequence[Criterion],
    params: dict[str, Any],
    max_retries: int,
    backoff_seconds: float,
    tracer: Tracer | None,
) -> tuple[str, list[Score], JudgeUsage]:
    """(raw validated answer, scores in id order, usage) from the judge, with retries."""
    litellm = _litellm()
    n = len(trajectories)
    messages = build_judge_messages(trajectories, rubric, criteria=criteria)
    fmt = response_format(n, criteria)
    attempts = max_retries + 1
    prompt_tokens = completion_tokens = calls = 0
    cost: float | None = 0.0
    problem = ""
    for attempt in range(attempts):
        if attempt and backoff_seconds:
            await asyncio.sleep(backoff_seconds * 2 ** (attempt - 1))
        calls += 1
        try:
            request = {"model": judge_model, "messages": messages, "response_format": fmt, **params}
            response = await (litellm.acompletion(**request) if tracer is None else _traced(litellm, tracer, request))
        except Exception as exc:
            if not _is_transient(exc, litellm):
                raise RulerError(f"judge {judge_model!r} failed: {type(exc).__name__}: {exc}") from exc
            problem = f"{type(exc).__name__}: {exc}"
            logger.warning("ruler: judge %r attempt %d/%d: %s", judge_model, calls, attempts, problem)
            continue

        usage = getattr(response, "usage", None)
        prompt_tokens += int(getattr(usage, "prompt_tokens", 0) or 0)
        completion_tokens += int(getattr(usage, "completion_tokens", 0) or 0)
        try:
            call_cost: float | None = float(litellm.completion_cost(completion_response=response))
        except Exception:  # litellm raises for models it has no price for (e.g. a local vLLM)
            call_cost = None
        cost = None if cost is None or call_cost is None else cost + call_cost

        try:
            answer = _content(response)
            scores = parse_judge_answer(answer, n, criteria)
        except RulerError as exc:
            problem = str(exc)
            logger.warning("ruler: judge %r attempt %d/%d: invalid answer: %s", judge_model, calls, attempts, problem)
            continue
        return (
            answer,
            scores,
            JudgeUsage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                cost_usd=cost,
                judge_calls=calls,
                cache_hits=0,
            ),
        )
    raise RulerError(f"judge {judge_model!r} gave no valid scores in {attempts} attempts; last problem: {problem}")


async def _traced(litellm: ModuleType, tracer: Tracer, request: dict[str, Any]) -> Any:
    """One judge call in its GenAI span: `chat <judge model>`, a child of the current span."""
    model = request["model"]
    try:
        provider = str(litellm.get_llm_provider(model=model, api_base=request.get("api_base"))[1])
    except Exception:
        provider = "litellm"
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": provider,  # litellm's name for it: openai, anthropic, hosted_vllm, ...
        "gen_ai.request.model": model,
    }
    for field in ("max_tokens", "temperature", "top_p", "seed"):
        if isinstance(request.get(field), int | float):
            attributes[f"gen_ai.request.{field}"] = request[field]
    with tracer.start_as_current_span(f"chat {model}", kind=SpanKind.CLIENT, attributes=attributes) as span:
        try:
            response = await litellm.acompletion(**request)
        except Exception as exc:
            span.set_attribute("error.type", type(exc).__name__)
            raise
        usage = getattr(response, "usage", None)
        for attribute, field in (("input_tokens", "prompt_tokens"), ("output_tokens", "completion_tokens")):
            if isinstance(value := getattr(usage, field, None), int):
                span.set_attribute(f"gen_ai.usage.{attribute}", value)
        if getattr(response, "model", None):
            span.set_attribute("gen_ai.response.model", str(response.model))
        reasons = [str(c.finish_reason) for c in getattr(response, "choices", None) or () if c.finish_reason]
        if reasons:
            span.set_attribute("gen_ai.response.finish_reasons", reasons)
        return response


def check_judge_model(judge_model: str, litellm_params: Mapping[str, Any] | None = None) -> None:
    """Raise RulerError if litellm cannot tell which provider serves `judge_model` (no call is made)."""
    litellm = _litellm()
    try:
        litellm.get_llm_provider(model=judge_model, api_base=(litellm_params or {}).get("api_base"))
    except Exception as exc:
        raise RulerError(f"unknown judge model {judge_model!r}: {exc}") from None
