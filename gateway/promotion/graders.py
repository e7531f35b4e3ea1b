"""Graders of offline eval sets: what an eval scenario's answer is worth.

An eval set (`EvalSetCreate`) is a list of scenarios (`EvalScenario`), each a chat request (messages,
tools) with a grader. The wire format is a tagged union on `type`:

- `exact`, `regex`, `json_schema`, `tool_call`: checked here, 1.0 (pass) or 0.0 (fail);
- `webhook`: the gateway posts the transcript to the user's URL and reads back `{"reward": <number>}`;
- `ruler`: comparative, the judge ranks the candidate's and the promoted step's answers to the same
  scenario (`ruler_compare`, not `grade`).

Specs are checked when decoded: an unknown field, a value out of range, a regex that does not compile, a
schema that is not a JSON Schema or a URL that is not http(s) is a `msgspec.ValidationError` naming the
field. Grading never raises for a bad answer (no content, invalid JSON, ...): that answer fails. It raises
`GraderFailed` only when no reward could be had (a webhook that keeps failing, a judge that gives no
valid scores, a schema `$ref` that cannot be resolved, a regex search past its time limit).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeAlias
from urllib.parse import urlsplit

import httpx
import msgspec
import regex
import tenacity
from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for
from referencing.exceptions import Unresolvable

import ruler

__all__ = [
    "WEBHOOK_BACKOFF_SECONDS",
    "Answer",
    "EvalScenario",
    "EvalSetCreate",
    "ExactGrader",
    "Grader",
    "GraderFailed",
    "JsonSchemaGrader",
    "RegexGrader",
    "RulerGrader",
    "RulerJudge",
    "ToolCall",
    "ToolCallGrader",
    "WebhookGrader",
    "grade",
    "ruler_compare",
]

WEBHOOK_BACKOFF_SECONDS = 0.2
"""A webhook's retry k (1-based) waits WEBHOOK_BACKOFF_SECONDS * 2**(k-1): 0.2 s, 0.4 s, 0.8 s, ..."""

_MAX_TEXT = 65_536  # characters of an `exact` value or a rubric
_MAX_PATTERN = 4_096  # characters of a regex
REGEX_SECONDS = 1.0  # one regex grader's search of one answer
_MAX_NAME = 256  # characters of a tool or judge model name
_MAX_URL = 2_048
_MAX_HEADERS = 32
_MAX_REPLY_BYTES = 1 << 20  # a webhook's reply body; more is an error, not read on
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token
log = logging.getLogger("artgw.promotion")

_GATEWAY_HEADERS = frozenset({"content-type", "content-length", "host", "transfer-encoding"})


class GraderFailed(Exception):
    """No reward could be had for an answer: a webhook that kept failing (or answered a 4xx, or no finite
    `reward`), a judge that gave no valid scores, a schema `$ref` that cannot be resolved. The message is
    one line and says which (for a webhook: its URL without query, the attempts and the last error)."""


# ---------------------------------------------------------------------------------------------- answers


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    arguments: str  # the raw JSON string, as OpenAI returns it (it may not be JSON at all)


class Answer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the model answered to one sample of a scenario."""

    content: str | None
    tool_calls: list[ToolCall] = []
    finish_reason: str | None = None

    @classmethod
    def from_choice(cls, choice: Mapping[str, Any]) -> Answer:
        """From one `choices[i]` of an OpenAI chat completion (function tool calls only)."""
        message = choice.get("message") or {}
        calls = [
            ToolCall(name=str(call["function"].get("name", "")), arguments=str(call["function"].get("arguments", "")))
            for call in message.get("tool_calls") or []
            if isinstance(call.get("function"), Mapping)
        ]
        return cls(content=message.get("content"), tool_calls=calls, finish_reason=choice.get("finish_reason"))

    def as_message(self) -> dict[str, Any]:
        """The assistant message this answer is, in OpenAI's shape. Tool call ids are `call_0`, `call_1`, ...
        by position, so two answers that call the same tools alike give equal messages."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": f"call_{i}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for i, c in enumerate(self.tool_calls)
            ]
        return message


# ---------------------------------------------------------------------------------------------- graders


class _Spec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    """Base of the grader specs: each subclass sets its `tag` (the wire `type`)."""


class ExactGrader(_Spec, tag="exact", frozen=True):
    """Passes when the content equals `value` (both stripped of surrounding whitespace unless `strip` is
    false; compared case-folded unless `case_sensitive`). No content (tool calls only) fails."""

    value: Annotated[str, msgspec.Meta(max_length=_MAX_TEXT)]
    strip: bool = True
    case_sensitive: bool = True


class RegexGrader(_Spec, tag="regex", frozen=True):
    """Passes when `regex.search(pattern, content)` finds a match (Python's `re` syntax, run by the `regex`
    module for its time limit; flags inline, e.g. `(?i)`). No content fails. A search that takes over
    `REGEX_SECONDS` (catastrophic backtracking) fails the evaluation with that reason."""

    pattern: Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_PATTERN)]

    def __post_init__(self) -> None:
        try:
            _compiled(self.pattern)
        except regex.error as exc:
            raise ValueError(f"`pattern` is not a valid regular expression: {exc}") from None


class JsonSchemaGrader(_Spec, tag="json_schema", frozen=True):
    """Passes when the content parses as JSON (as is: no code fences stripped) and validates against
    `schema` (its `$schema` draft, else 2020-12; `format` is an annotation only, as the draft says)."""

    schema: dict[str, Any]

    def __post_init__(self) -> None:
        try:
            validator_for(self.schema, default=Draft202012Validator).check_schema(self.schema)
        except SchemaError as exc:
            where = "/".join(str(p) for p in exc.absolute_path)
            raise ValueError(
                f"`schema` is not a valid JSON Schema: {exc.message}" + (f" (at '{where}')" if where else "")
            ) from None


class ToolCallGrader(_Spec, tag="tool_call", frozen=True):
    """Passes when some tool call is named `name` and, if `arguments` is given, its arguments parse as a
    JSON object that equals them (`exact`) or contains them (`subset`: every key given, recursively into
    nested objects; other values, lists included, must be equal). Equality is JSON's: `true` is not `1`,
    `1` is `1.0`."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_NAME)]
    arguments: dict[str, Any] | None = None
    match: Literal["exact", "subset"] = "exact"


class WebhookGrader(_Spec, tag="webhook", frozen=True):
    """The user's own reward function: the gateway POSTs the transcript as JSON,
    `{"scenario": <index>, "messages": [...], "tools": [...] | null, "answer": {...}, "metadata": ... | null}`,
    and reads back `{"reward": <number>}` (other fields are ignored). Timeouts (`timeout_seconds` for the
    whole exchange), connection errors and 5xx are retried `retries` times; a 4xx, a redirect or a reply
    without a finite number `reward` is not. `headers` are sent with each request (e.g. a key)."""

    url: Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_URL)]
    timeout_seconds: Annotated[float, msgspec.Meta(gt=0, le=120)] = 10.0
    retries: Annotated[int, msgspec.Meta(ge=0, le=5)] = 2
    headers: Annotated[dict[str, str], msgspec.Meta(max_length=_MAX_HEADERS)] = {}

    def __post_init__(self) -> None:
        problem = _url_problem(self.url)
        if problem:
            raise ValueError(f"`url` must be an http:// or https:// URL with a host: {problem}")
        for name, value in self.headers.items():
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"`headers` has an invalid header name {name!r}")
            if name.lower() in _GATEWAY_HEADERS:
                raise ValueError(f"`headers` must not set {name!r}: the gateway sets it")
            if any(c in value for c in "\r\n\0"):
                raise ValueError(f"`headers` value of {name!r} contains a line break or NUL")


class RulerGrader(_Spec, tag="ruler", frozen=True):
    """Comparative: the judge (RULER) scores the candidate's and the promoted step's answers to the same
    scenario against `rubric` (RULER's default if none), with `judge_model` (the gateway's default if
    none). Graded by `ruler_compare`, not `grade`."""

    rubric: Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_TEXT)] | None = None
    judge_model: Annotated[str, msgspec.Meta(min_length=1, max_length=_MAX_NAME)] | None = None


Grader: TypeAlias = ExactGrader | RegexGrader | JsonSchemaGrader | ToolCallGrader | WebhookGrader | RulerGrader


# ---------------------------------------------------------------------------------------------- eval sets


class EvalScenario(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One chat request of an eval set and how its answers are graded. `metadata` goes to a webhook as is."""

    messages: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1, max_length=256)]
    tools: list[dict[str, Any]] | None = None
    grader: Grader
    metadata: dict[str, Any] | None = None

    # More of the chat request, as a client would send them: tool_choice, temperature, max_tokens, logit_bias...
    # (`model`, `messages`, `tools`, `n` and `stream` are the gate's own).
    params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        taken = sorted({"model", "messages", "tools", "n", "stream"} & set(self.params or {}))
        if taken:
            raise ValueError(f"params may not set {', '.join(taken)}: the gate sets them")


class EvalSetCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The body that registers a named eval set; each scenario is answered `samples` times per step."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[^/]+$")]
    scenarios: Annotated[list[EvalScenario], msgspec.Meta(min_length=1, max_length=10_000)]
    samples: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4


# ---------------------------------------------------------------------------------------------- grading


async def grade(spec: Grader, scenario: EvalScenario, answer: Answer, http: httpx.AsyncClient, *, index: int) -> float:
    """The reward of one answer to `scenario` (the `index`-th of its set) under `spec`.

    `exact`, `regex`, `json_schema`, `tool_call`: 1.0 or 0.0. `webhook`: the number the webhook answered,
    as given: finite, but not clamped to [0, 1] (a user's reward function may use its own scale; the gate
    compares the two steps on the same one), posted with `http`. `ruler` is comparative and goes through
    `ruler_compare` (TypeError here). Raises `GraderFailed` when no reward could be had.
    """
    match spec:
        case ExactGrader():
            return _passed(_exact(spec, answer.content))
        case RegexGrader():
            return _passed(await _regex_found(spec.pattern, answer.content))
        case JsonSchemaGrader():
            return _passed(_json_schema(spec, answer.content))
        case ToolCallGrader():
            return _passed(any(_tool_call(spec, call) for call in answer.tool_calls))
        case WebhookGrader():
            return await _webhook(spec, scenario, answer, http, index=index)
        case RulerGrader():
            raise TypeError("a `ruler` grader is comparative: grade it with ruler_compare, not grade")
    raise TypeError(f"not a grader spec: {type(spec).__name__}")


def _passed(ok: bool) -> float:
    return 1.0 if ok else 0.0


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> regex.Pattern[str]:
    return regex.compile(pattern)


async def _regex_found(pattern: str, content: str | None) -> bool:
    """The search runs in a thread, releasing the GIL (`concurrent`), under a time limit: a pattern that
    backtracks catastrophically on a model's answer fails its evaluation and never stalls the gateway's calls."""
    if content is None:
        return False
    search = functools.partial(_compiled(pattern).search, content, concurrent=True, timeout=REGEX_SECONDS)
    try:
        return await asyncio.to_thread(search) is not None
    except TimeoutError:
        raise GraderFailed(
            f"regex grader: the pattern took over {REGEX_SECONDS:g} s on an answer of {len(content)} characters "
            "(catastrophic backtracking: nested quantifiers such as `(x+)+`)"
        ) from None


def _exact(spec: ExactGrader, content: str | None) -> bool:
    if content is None:
        return False
    value = spec.value
    if spec.strip:
        content, value = content.strip(), value.strip()
    if not spec.case_sensitive:
        content, value = content.casefold(), value.casefold()
    return content == value


def _json_schema(spec: JsonSchemaGrader, content: str | None) -> bool:
    if content is None:
        return False
    try:
        document = json.loads(content)
    except ValueError:
        return False
    validator = validator_for(spec.schema, default=Draft202012Validator)(spec.schema)
    try:
        return bool(validator.is_valid(document))
    except Unresolvable as exc:  # check_schema does not follow $refs; remote ones are never fetched
        raise GraderFailed(f"json_schema grader: the schema's $ref cannot be resolved: {exc}") from None


def _tool_call(spec: ToolCallGrader, call: ToolCall) -> bool:
    if call.name != spec.name:
        return False
    if spec.arguments is None:
        return True
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return False
    if not isinstance(arguments, dict):
        return False
    if spec.match == "exact":
        return _json_equal(arguments, spec.arguments)
    return _contains(arguments, spec.arguments)


def _contains(actual: Any, expected: Any) -> bool:
    """`expected` is a part of `actual`: objects recursively by key, anything else equal."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(k in actual and _contains(actual[k], v) for k, v in expected.items())
    return _json_equal(actual, expected)


def _json_equal(a: Any, b: Any) -> bool:
    """Equal as JSON values: unlike Python's ==, `true` is not `1` (but `1` is `1.0`)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


# ---------------------------------------------------------------------------------------------- webhook


class _WebhookReply(msgspec.Struct, frozen=True):
    reward: float


def _url_problem(url: str) -> str | None:
    if any(c.isspace() or not c.isprintable() for c in url):
        return f"{url!r} contains whitespace or control characters"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number in range)
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as exc:
        return f"{url!r} ({exc})"
    if parts.scheme not in ("http", "https"):
        return f"{url!r} has scheme {parts.scheme!r}" if parts.scheme else f"{url!r} has no scheme"
    if not parts.hostname:
        return f"{url!r} has no host"
    return None


def _public_url(url: str) -> str:
    """The URL as errors show it: without user info, query or fragment (they may carry a secret)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def masked_url(url: str) -> str:
    """A webhook's URL as readers see it in its eval set: user info and query shown as `***` (a password, a
    token in `?key=`), the rest as given."""
    parts = urlsplit(url)
    public = _public_url(url)
    if parts.username is not None or parts.password is not None:
        public = public.replace("://", "://***@", 1)
    return public + ("?***" if parts.query else "") + ("#***" if parts.fragment else "")


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _attempts(n: int) -> str:
    return f"{n} attempt" if n == 1 else f"{n} attempts"


async def _post(http: httpx.AsyncClient, spec: WebhookGrader, body: bytes) -> tuple[int, bytes]:
    """(status, reply body) of one POST; a body over the limit is cut at it and flagged by its length."""
    headers = {**spec.headers, "content-type": "application/json"}
    request = http.build_request("POST", spec.url, content=body, headers=headers, timeout=spec.timeout_seconds)
    response = await http.send(request, stream=True, follow_redirects=False)
    try:
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            chunks.append(chunk)
            size += len(chunk)
            if size > _MAX_REPLY_BYTES:
                break
        return response.status_code, b"".join(chunks)
    finally:
        await response.aclose()


async def _webhook(
    spec: WebhookGrader, scenario: EvalScenario, answer: Answer, http: httpx.AsyncClient, *, index: int
) -> float:
    body = msgspec.json.encode(
        {
            "scenario": index,
            "messages": scenario.messages,
            "tools": scenario.tools,
            "answer": answer,
            "metadata": scenario.metadata,
        }
    )
    where = _public_url(spec.url)
    attempts = spec.retries + 1
    retrying = tenacity.AsyncRetrying(
        stop=tenacity.stop_after_attempt(attempts),
        # Before attempt k + 1: WEBHOOK_BACKOFF_SECONDS * 2**(k-1).
        wait=tenacity.wait_exponential(multiplier=WEBHOOK_BACKOFF_SECONDS, exp_base=2),
        retry=tenacity.retry_if_exception_type(_WebhookRetry),
        reraise=True,
    )
    try:
        async for attempt in retrying:
            with attempt:
                status, reply = await _post_once(http, spec, body)
    except _WebhookRetry as exc:  # the last attempt's problem
        raise GraderFailed(f"webhook {where} failed after {_attempts(attempts)}: {exc.problem}") from None
    tried = attempt.retry_state.attempt_number
    if not 200 <= status < 300:
        why = "redirects are not followed" if 300 <= status < 400 else "not retried"
        # The reply's text goes to the log only: the evaluation's error is shown to every `read` key of the
        # model, and a webhook's error page may say what they should not see.
        log.warning("webhook %s answered HTTP %d: %s", where, status, _one_line(reply.decode(errors="replace")))
        raise GraderFailed(
            f"webhook {where} failed after {_attempts(tried)}: HTTP {status} ({why}; its reply is in the gateway's log)"
        )
    return _reward(reply, where=where, attempt=tried)


class _WebhookRetry(Exception):
    """An attempt worth another: it timed out, could not connect or was cut, or the webhook answered a 5xx."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


async def _post_once(http: httpx.AsyncClient, spec: WebhookGrader, body: bytes) -> tuple[int, bytes]:
    """One attempt's (status, reply); _WebhookRetry when it failed in a way another attempt may not."""
    try:
        async with asyncio.timeout(spec.timeout_seconds):  # the whole exchange, not each read
            status, reply = await _post(http, spec, body)
    except (TimeoutError, httpx.TimeoutException):
        raise _WebhookRetry(f"timed out after {spec.timeout_seconds:g} s") from None
    except httpx.TransportError as exc:
        raise _WebhookRetry(f"{type(exc).__name__}: {_one_line(str(exc)) or 'connection failed'}") from None
    if status >= 500:
        raise _WebhookRetry(f"HTTP {status}")
    return status, reply


def _reward(reply: bytes, *, where: str, attempt: int) -> float:
    def failed(problem: str) -> GraderFailed:
        return GraderFailed(
            f'webhook {where} failed after {_attempts(attempt)}: {problem} (expected {{"reward": <number>}})'
        )

    if len(reply) > _MAX_REPLY_BYTES:
        raise failed(f"the reply is over {_MAX_REPLY_BYTES} bytes")
    try:
        reward = msgspec.json.decode(reply, type=_WebhookReply).reward
    except msgspec.DecodeError as exc:
        raise failed(f"bad reply: {exc}") from None
    if not math.isfinite(reward):
        raise failed(f"the reward is not finite: {reward}")
    return reward


# ---------------------------------------------------------------------------------------------- ruler


@dataclass(frozen=True, kw_only=True)
class RulerJudge:
    """The gateway's side of RULER for `ruler` graders: what an eval set does not carry.

    `default_model`: the judge model (a litellm name) of graders that name none (`None`: they must name
    one). `litellm_params`: api_base, api_key, ... for `litellm.acompletion`: secrets, never in an eval set
    and left out of this object's repr. `cache`: where validated judge answers are kept (the store's
    `StoreJudgeCache` in the gateway, as the groups scorer uses).
    """

    default_model: str | None = None
    litellm_params: Mapping[str, Any] = field(default_factory=dict, repr=False)
    cache: ruler.JudgeCache | None = None


async def ruler_compare(
    spec: RulerGrader,
    scenario: EvalScenario,
    candidate: Answer,
    baseline: Answer,
    judge: RulerJudge,
    *,
    baseline_first: bool = False,
) -> tuple[float, float]:
    """(candidate's score, baseline's score), each in [0, 1], from one RULER judge call that sees both
    answers to `scenario` (its messages and tools, then each answer as the assistant's message).

    The judge is chosen as the groups scorer does: `spec.judge_model`, else `judge.default_model`;
    `spec.rubric`, else `ruler.DEFAULT_RUBRIC`; `judge.litellm_params` and `judge.cache` go to
    `ruler.score_group` as given. Two equal answers score `ruler.NEUTRAL_SCORE` each without a judge call.
    The candidate is shown first unless `baseline_first`: a judge may favour a position, so alternate it
    over samples to cancel that out. Raises `GraderFailed` when there is no judge model or the judge gives
    no valid scores.
    """
    judge_model = spec.judge_model or judge.default_model
    if not judge_model:
        raise GraderFailed("ruler grader: no judge_model in the grader and no default judge model configured")
    trajectories = [
        ruler.Trajectory(messages=[*scenario.messages, answer.as_message()], tools=scenario.tools)
        for answer in ((baseline, candidate) if baseline_first else (candidate, baseline))
    ]
    try:
        result = await ruler.score_group(
            trajectories,
            judge_model=judge_model,
            rubric=spec.rubric or ruler.DEFAULT_RUBRIC,
            litellm_params=judge.litellm_params,
            cache=judge.cache,
        )
    except ruler.RulerError as exc:
        raise GraderFailed(f"ruler grader: {_one_line(str(exc), 500)}") from exc
    first, second = (score.score for score in result.scores)
    return (second, first) if baseline_first else (first, second)
