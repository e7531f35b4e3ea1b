"""Unit tests for the eval-set graders (gateway/promotion/graders.py): each grader on passing and failing
answers, the decoding errors of bad specs, and RULER's comparison.

The webhook grader is tested against a real HTTP server in test_webhook_grader.py. A real RULER judge is a
paid API that cannot run here, so `ruler_compare` is tested with a fake judge installed as the existing
RULER tests (test_ruler.py) do: `litellm.acompletion` replaced by an async function returning
`litellm.ModelResponse` objects. The fake reads the prompt RULER built and scores each trajectory by its
content, so the test checks which score comes back for which answer.
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
import pytest

import ruler
from gateway.promotion.graders import (
    Answer,
    EvalScenario,
    EvalSetCreate,
    ExactGrader,
    Grader,
    GraderFailed,
    JsonSchemaGrader,
    RegexGrader,
    RulerGrader,
    RulerJudge,
    ToolCall,
    ToolCallGrader,
    grade,
    ruler_compare,
)
from tests.conftest import ticks

if TYPE_CHECKING:
    import litellm

# litellm (~3 s of CPU to import) is imported by the tests that use it, not at collection by every worker.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-map download

USER = {"role": "user", "content": "Did the motion pass?"}
TOOLS = [{"type": "function", "function": {"name": "report", "parameters": {"type": "object"}}}]


def text(content: str | None) -> Answer:
    return Answer(content=content, finish_reason="stop")


def calls(*pairs: tuple[str, str]) -> Answer:
    return Answer(
        content=None, tool_calls=[ToolCall(name=n, arguments=a) for n, a in pairs], finish_reason="tool_calls"
    )


async def reward(spec: Grader, answer: Answer) -> float:
    async with httpx.AsyncClient() as http:  # unused by these graders: no request is made
        return await grade(spec, EvalScenario(messages=[USER], tools=TOOLS, grader=spec), answer, http, index=0)


def decode_grader(spec: dict[str, Any]) -> Grader:
    """A grader as the API decodes it: inside an eval set's body."""
    body = {"name": "s", "scenarios": [{"messages": [USER], "grader": spec}]}
    return msgspec.json.decode(msgspec.json.encode(body), type=EvalSetCreate).scenarios[0].grader


# ---------------------------------------------------------------------------------------------- exact


@pytest.mark.parametrize(
    ("spec", "content", "expected"),
    [
        ({"value": "yes"}, "yes", 1.0),
        ({"value": "yes"}, "  yes\n", 1.0),  # stripped by default
        ({"value": "yes"}, "no", 0.0),
        ({"value": "yes"}, "yes.", 0.0),
        ({"value": "yes"}, "Yes", 0.0),  # case-sensitive by default
        ({"value": "yes", "case_sensitive": False}, "YES", 1.0),
        ({"value": "straße", "case_sensitive": False}, "STRASSE", 1.0),  # case-folded, not lower-cased
        ({"value": "yes", "strip": False}, " yes", 0.0),
        ({"value": " yes", "strip": False}, " yes", 1.0),
        ({"value": "", "strip": True}, "   ", 1.0),
        ({"value": "yes"}, None, 0.0),  # tool calls only
    ],
)
async def test_exact(spec: dict[str, Any], content: str | None, expected: float) -> None:
    assert await reward(decode_grader({"type": "exact", **spec}), text(content)) == expected


# ---------------------------------------------------------------------------------------------- regex


@pytest.mark.parametrize(
    ("pattern", "content", "expected"),
    [
        ("^no", "no, it failed", 1.0),
        ("^no", "I say no", 0.0),
        ("passed", "It passed.", 1.0),  # re.search: anywhere in the content
        (r"\bpassed\b", "It bypassed it.", 0.0),
        ("(?i)^YES$", "yes", 1.0),  # flags inline
        ("^$", "", 1.0),
        ("yes", None, 0.0),
    ],
)
async def test_regex(pattern: str, content: str | None, expected: float) -> None:
    assert await reward(decode_grader({"type": "regex", "pattern": pattern}), text(content)) == expected


async def test_a_regex_that_backtracks_catastrophically_fails_the_evaluation_without_stalling_the_loop() -> None:
    """`(x+x+)+y` on 5,000 x's backtracks for far longer than anyone waits; meanwhile the event loop (the
    gateway's calls) keeps running, and the grader fails with the reason after REGEX_SECONDS."""
    ticked = 0
    done = asyncio.Event()

    async def tick() -> None:
        nonlocal ticked
        async for ticked in ticks(0.01, done):  # noqa: B007 (the count is read after the loop)
            pass

    ticker = asyncio.create_task(tick())
    try:
        with pytest.raises(GraderFailed, match=r"took over 1 s on an answer of 5000 characters"):
            await reward(decode_grader({"type": "regex", "pattern": "(x+x+)+y"}), text("x" * 5000))
    finally:
        done.set()
        await ticker
    assert ticked >= 5  # the loop went on while the pattern ran (about 100 ticks of 10 ms; none if it blocked)


# ---------------------------------------------------------------------------------------------- json_schema

VERDICT = {
    "type": "object",
    "properties": {"passed": {"type": "boolean"}, "votes": {"type": "integer", "minimum": 0}},
    "required": ["passed"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"passed": true, "votes": 3}', 1.0),
        (' {"passed": false}\n', 1.0),
        ('{"passed": "yes"}', 0.0),  # valid JSON, wrong type
        ('{"passed": true, "extra": 1}', 0.0),
        ("{}", 0.0),
        ('{"passed": true', 0.0),  # not JSON
        ('```json\n{"passed": true}\n```', 0.0),  # fenced: not JSON as is
        ("", 0.0),
        (None, 0.0),
    ],
)
async def test_json_schema(content: str | None, expected: float) -> None:
    assert await reward(decode_grader({"type": "json_schema", "schema": VERDICT}), text(content)) == expected


async def test_json_schema_follows_local_refs_and_its_draft() -> None:
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"vote": {"enum": ["yes", "no"]}},
        "type": "array",
        "items": {"$ref": "#/definitions/vote"},
    }
    spec = decode_grader({"type": "json_schema", "schema": schema})
    assert await reward(spec, text('["yes", "no"]')) == 1.0
    assert await reward(spec, text('["yes", "maybe"]')) == 0.0


async def test_json_schema_with_a_remote_ref_fails_to_grade_without_fetching_it() -> None:
    spec = decode_grader({"type": "json_schema", "schema": {"$ref": "https://schemas.invalid/verdict.json"}})
    with pytest.raises(GraderFailed, match=r"\$ref cannot be resolved"):
        await reward(spec, text("{}"))


# ---------------------------------------------------------------------------------------------- tool_call


@pytest.mark.parametrize(
    ("spec", "answer", "expected"),
    [
        ({"name": "report"}, calls(("report", '{"passed": "yes"}')), 1.0),
        ({"name": "report"}, calls(("report", "not json")), 1.0),  # no arguments asked for: the name decides
        ({"name": "report"}, calls(("get_ballots", "{}")), 0.0),
        ({"name": "report"}, text("report"), 0.0),  # no tool call at all
        # exact
        ({"name": "report", "arguments": {"passed": "yes"}}, calls(("report", '{"passed": "yes"}')), 1.0),
        ({"name": "report", "arguments": {"passed": "yes"}}, calls(("report", '{ "passed" : "yes" }')), 1.0),
        ({"name": "report", "arguments": {"passed": "yes"}}, calls(("report", '{"passed": "no"}')), 0.0),
        ({"name": "report", "arguments": {"passed": "yes"}}, calls(("report", '{"passed": "yes", "n": 1}')), 0.0),
        ({"name": "report", "arguments": {}}, calls(("report", "{}")), 1.0),
        ({"name": "report", "arguments": {}}, calls(("report", "")), 0.0),  # "" is not a JSON object
        ({"name": "report", "arguments": {"n": 1}}, calls(("report", '{"n": 1.0}')), 1.0),  # JSON numbers
        ({"name": "report", "arguments": {"n": 1}}, calls(("report", '{"n": true}')), 0.0),  # true is not 1
        ({"name": "report", "arguments": {"ok": True}}, calls(("report", '{"ok": 1}')), 0.0),
        ({"name": "report", "arguments": {"ok": None}}, calls(("report", '{"ok": null}')), 1.0),
        # subset
        (
            {"name": "report", "arguments": {"passed": "yes"}, "match": "subset"},
            calls(("report", '{"passed": "yes", "note": "close vote"}')),
            1.0,
        ),
        ({"name": "report", "arguments": {}, "match": "subset"}, calls(("report", '{"a": 1}')), 1.0),
        (
            {"name": "report", "arguments": {"passed": "yes", "note": "x"}, "match": "subset"},
            calls(("report", '{"passed": "yes"}')),
            0.0,  # a key asked for is missing
        ),
        # nested objects: exact needs the whole tree equal, subset recurses into it
        (
            {"name": "book", "arguments": {"trip": {"from": "PAR"}}, "match": "subset"},
            calls(("book", '{"trip": {"from": "PAR", "to": "ROM"}, "seats": 2}')),
            1.0,
        ),
        (
            {"name": "book", "arguments": {"trip": {"from": "PAR"}}, "match": "exact"},
            calls(("book", '{"trip": {"from": "PAR", "to": "ROM"}}')),
            0.0,
        ),
        (
            {"name": "book", "arguments": {"trip": {"from": "PAR"}}, "match": "subset"},
            calls(("book", '{"trip": {"from": "LYS", "to": "ROM"}}')),
            0.0,
        ),
        (
            {"name": "book", "arguments": {"trip": {"from": "PAR"}}, "match": "subset"},
            calls(("book", '{"trip": "PAR"}')),
            0.0,  # an object asked for, a string given
        ),
        # lists are values: equal as a whole, also under subset
        (
            {"name": "vote", "arguments": {"ids": [1, 2]}, "match": "subset"},
            calls(("vote", '{"ids": [1, 2, 3]}')),
            0.0,
        ),
        ({"name": "vote", "arguments": {"ids": [1, 2]}, "match": "subset"}, calls(("vote", '{"ids": [1, 2]}')), 1.0),
        # arguments that are not a JSON object
        ({"name": "report", "arguments": {"passed": "yes"}}, calls(("report", '{"passed": "yes"')), 0.0),
        ({"name": "report", "arguments": {"passed": "yes"}}, calls(("report", '["yes"]')), 0.0),
        ({"name": "report", "arguments": {}, "match": "subset"}, calls(("report", '"{}"')), 0.0),
        # several calls: one matching is enough
        (
            {"name": "report", "arguments": {"passed": "no"}},
            calls(("get_ballots", "{}"), ("report", '{"passed": "yes"}'), ("report", '{"passed": "no"}')),
            1.0,
        ),
    ],
)
async def test_tool_call(spec: dict[str, Any], answer: Answer, expected: float) -> None:
    assert await reward(decode_grader({"type": "tool_call", **spec}), answer) == expected


async def test_grade_refuses_ruler() -> None:
    with pytest.raises(TypeError, match="ruler_compare"):
        await reward(RulerGrader(), text("yes"))


# ---------------------------------------------------------------------------------------------- decoding


def test_specs_decode_with_their_defaults() -> None:
    assert decode_grader({"type": "exact", "value": "yes"}) == ExactGrader(value="yes", strip=True, case_sensitive=True)
    assert decode_grader({"type": "tool_call", "name": "f"}) == ToolCallGrader(name="f", arguments=None, match="exact")
    webhook = decode_grader({"type": "webhook", "url": "https://rewards.example.com/grade?key=1"})
    assert (webhook.timeout_seconds, webhook.retries, webhook.headers) == (10.0, 2, {})
    assert decode_grader({"type": "ruler"}) == RulerGrader(rubric=None, judge_model=None)
    body = {
        "name": "yes-no",
        "scenarios": [{"messages": [USER], "tools": TOOLS, "grader": {"type": "regex", "pattern": "x"}}],
    }
    created = msgspec.json.decode(msgspec.json.encode(body), type=EvalSetCreate)
    assert created.samples == 4 and created.scenarios[0].tools == TOOLS and created.scenarios[0].metadata is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"type": "fuzzy", "value": "x"}, "Invalid value 'fuzzy' - at `$.scenarios[0].grader.type`"),
        ({"value": "x"}, "missing required field `type` - at `$.scenarios[0].grader`"),
        ({"type": "exact"}, "missing required field `value` - at `$.scenarios[0].grader`"),
        ({"type": "exact", "value": "x", "vaule": "y"}, "unknown field `vaule` - at `$.scenarios[0].grader`"),
        ({"type": "exact", "value": 1}, "Expected `str`, got `int` - at `$.scenarios[0].grader.value`"),
        ({"type": "regex", "pattern": "(yes"}, "`pattern` is not a valid regular expression: missing )"),
        ({"type": "regex", "pattern": ""}, "Expected `str` of length >= 1 - at `$.scenarios[0].grader.pattern`"),
        ({"type": "json_schema", "schema": {"type": "nope"}}, "`schema` is not a valid JSON Schema"),
        ({"type": "json_schema", "schema": {"minimum": "0"}}, "`schema` is not a valid JSON Schema"),
        ({"type": "json_schema", "schema": []}, "Expected `object`, got `array` - at `$.scenarios[0].grader.schema`"),
        ({"type": "tool_call", "name": "f", "match": "fuzzy"}, "Invalid enum value 'fuzzy'"),
        ({"type": "tool_call", "name": "f", "arguments": [1]}, "at `$.scenarios[0].grader.arguments`"),
        ({"type": "tool_call", "name": ""}, "at `$.scenarios[0].grader.name`"),
        ({"type": "webhook", "url": "ftp://example.com/x"}, "`url` must be an http:// or https:// URL"),
        ({"type": "webhook", "url": "example.com/grade"}, "`url` must be an http:// or https:// URL"),
        ({"type": "webhook", "url": "http:///grade"}, "has no host"),
        ({"type": "webhook", "url": "http://example.com:99999/"}, "`url` must be an http:// or https:// URL"),
        ({"type": "webhook", "url": "http://exa mple.com/"}, "`url` must be an http:// or https:// URL"),
        (
            {"type": "webhook", "url": "http://x", "timeout_seconds": 0},
            "> 0.0 - at `$.scenarios[0].grader.timeout_seconds`",
        ),
        (
            {"type": "webhook", "url": "http://x", "timeout_seconds": 121},
            "<= 120.0 - at `$.scenarios[0].grader.timeout_seconds`",
        ),
        ({"type": "webhook", "url": "http://x", "timeout_seconds": -1}, "at `$.scenarios[0].grader.timeout_seconds`"),
        ({"type": "webhook", "url": "http://x", "retries": 6}, "<= 5 - at `$.scenarios[0].grader.retries`"),
        ({"type": "webhook", "url": "http://x", "retries": -1}, ">= 0 - at `$.scenarios[0].grader.retries`"),
        ({"type": "webhook", "url": "http://x", "headers": {"Bad Name": "v"}}, "`headers` has an invalid header name"),
        ({"type": "webhook", "url": "http://x", "headers": {"X-K": "a\r\nHost: evil"}}, "`headers` value of 'X-K'"),
        ({"type": "webhook", "url": "http://x", "headers": {"Content-Type": "text/plain"}}, "`headers` must not set"),
        ({"type": "webhook", "url": "http://x", "headers": {"X-K": 1}}, "at `$.scenarios[0].grader.headers"),
        ({"type": "ruler", "rubric": ""}, "at `$.scenarios[0].grader.rubric`"),
        ({"type": "ruler", "judge": "openai/gpt-4o"}, "unknown field `judge`"),
    ],
)
def test_bad_specs_are_validation_errors_naming_the_field(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(msgspec.ValidationError) as caught:
        decode_grader(spec)
    assert message in str(caught.value)
    assert "at `$.scenarios[0].grader" in str(caught.value)  # where in the body, for the API's 400


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"name": "a/b"}, "at `$.name`"),
        ({"name": ""}, "Expected `str` of length >= 1 - at `$.name`"),
        ({"name": "x" * 129}, "Expected `str` of length <= 128 - at `$.name`"),
        ({"samples": 0}, "Expected `int` >= 1 - at `$.samples`"),
        ({"samples": 65}, "Expected `int` <= 64 - at `$.samples`"),
        ({"scenarios": []}, "Expected `array` of length >= 1 - at `$.scenarios`"),
        (
            {"scenarios": [{"messages": [], "grader": {"type": "regex", "pattern": "x"}}]},
            "at `$.scenarios[0].messages`",
        ),
        ({"scenarios": [{"messages": [USER] * 257, "grader": {"type": "regex", "pattern": "x"}}]}, "length <= 256"),
        ({"scenarios": [{"messages": [USER]}]}, "missing required field `grader` - at `$.scenarios[0]`"),
        ({"scenarios": [{"messages": [USER], "grader": {"type": "ruler"}, "tool": []}]}, "unknown field `tool`"),
        ({"shuffle": True}, "unknown field `shuffle`"),
        (
            {"scenarios": [{"messages": [USER], "grader": {"type": "ruler"}, "params": {"n": 2, "model": "x"}}]},
            "params may not set model, n: the gate sets them - at `$.scenarios[0]`",
        ),
    ],
)
def test_bad_eval_sets_are_validation_errors_naming_the_field(body: dict[str, Any], message: str) -> None:
    full = {"name": "yes-no", "scenarios": [{"messages": [USER], "grader": {"type": "exact", "value": "yes"}}], **body}
    with pytest.raises(msgspec.ValidationError, match=re.escape(message)):
        msgspec.json.decode(msgspec.json.encode(full), type=EvalSetCreate)


def test_specs_built_in_code_are_checked_too() -> None:
    with pytest.raises(ValueError, match="`pattern`"):
        RegexGrader(pattern="[")
    with pytest.raises(ValueError, match="`schema`"):
        JsonSchemaGrader(schema={"type": 5})


# ---------------------------------------------------------------------------------------------- answers


def test_answer_from_an_openai_choice_and_back() -> None:
    choice = {
        "index": 0,
        "finish_reason": "tool_calls",
        "message": {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "chatcmpl-tool-9f", "type": "function", "function": {"name": "report", "arguments": '{"a":1}'}}
            ],
        },
    }
    answer = Answer.from_choice(choice)
    assert answer == Answer(content=None, tool_calls=[ToolCall("report", '{"a":1}')], finish_reason="tool_calls")
    assert answer.as_message() == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "report", "arguments": '{"a":1}'}}],
    }
    plain = Answer.from_choice({"message": {"role": "assistant", "content": "yes"}, "finish_reason": "stop"})
    assert plain.as_message() == {"role": "assistant", "content": "yes"}


# ---------------------------------------------------------------------------------------------- ruler

_BLOCK = re.compile(r'<trajectory id="(\d+)">\n(.*?)\n</trajectory>', re.S)


class ContentJudge:
    """Stands in for `litellm.acompletion`: scores each trajectory of RULER's prompt by what it contains
    (the first listed word found wins), in the answer schema RULER asks for, and records every call."""

    def __init__(self, scores: dict[str, float]) -> None:
        self.scores = scores
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, **kwargs: Any) -> litellm.ModelResponse:
        import litellm

        self.calls.append(kwargs)
        prompt = kwargs["messages"][-1]["content"]
        scores = {}
        for trajectory_id, block in _BLOCK.findall(prompt):
            word = next(w for w in self.scores if w in block)
            scores[trajectory_id] = {"explanation": f"it says {word}", "score": self.scores[word]}
        return litellm.ModelResponse(
            model="judge",
            choices=[
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": msgspec.json.encode({"scores": scores}).decode()},
                }
            ],
            usage={"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
        )


@pytest.fixture
def content_judge(monkeypatch: pytest.MonkeyPatch):
    import litellm

    def install(scores: dict[str, float]) -> ContentJudge:
        judge = ContentJudge(scores)
        monkeypatch.setattr(litellm, "acompletion", judge)
        return judge

    return install


RULER_SCENARIO = EvalScenario(messages=[USER], tools=TOOLS, grader=RulerGrader())
GOOD = calls(("report", '{"passed": "yes"}'))
BAD = calls(("report", '{"passed": "no"}'))


@pytest.mark.parametrize("baseline_first", [False, True])
async def test_ruler_compare_returns_candidate_then_baseline(content_judge, baseline_first: bool) -> None:
    judge = content_judge({"yes": 0.9, "no": 0.2})
    # The candidate answers well and the baseline badly, then the other way round: the pair follows.
    for candidate, baseline, expected in ((GOOD, BAD, (0.9, 0.2)), (BAD, GOOD, (0.2, 0.9))):
        scores = await ruler_compare(
            RulerGrader(),
            RULER_SCENARIO,
            candidate,
            baseline,
            RulerJudge(default_model="openai/judge-default"),
            baseline_first=baseline_first,
        )
        assert scores == expected
    assert len(judge.calls) == 2
    # Which answer is shown first: the prompt's trajectory 1.
    first = _BLOCK.findall(judge.calls[0]["messages"][-1]["content"])[0][1]
    assert ('\\"no\\"' if baseline_first else '\\"yes\\"') in first


async def test_ruler_compare_judges_as_the_groups_scorer_does(content_judge) -> None:
    judge = content_judge({"yes": 1.0, "no": 0.0})
    cache = ruler.MemoryJudgeCache()
    params = {"api_base": "http://127.0.0.1:1/v1", "temperature": 0.0}
    # The grader's own judge and rubric win over the gateway's default.
    spec = RulerGrader(rubric="Reward the correct verdict.", judge_model="hosted_vllm/judge")
    gateway_judge = RulerJudge(default_model="openai/other", litellm_params=params, cache=cache)
    assert await ruler_compare(spec, RULER_SCENARIO, GOOD, BAD, gateway_judge) == (1.0, 0.0)
    call = judge.calls[0]
    assert call["model"] == "hosted_vllm/judge" and call["api_base"] == params["api_base"]
    system, user = call["messages"]
    assert "Reward the correct verdict." in system["content"]
    assert "Did the motion pass?" in user["content"] and "<tools>" in user["content"]  # the scenario, once
    assert len(cache) == 1
    # Without its own: the default judge model and RULER's default rubric.
    await ruler_compare(RulerGrader(), RULER_SCENARIO, GOOD, BAD, RulerJudge(default_model="openai/judge-default"))
    assert judge.calls[1]["model"] == "openai/judge-default"
    assert ruler.DEFAULT_RUBRIC in judge.calls[1]["messages"][0]["content"]


async def test_ruler_compare_equal_answers_are_neutral_without_a_judge_call(content_judge) -> None:
    judge = content_judge({"yes": 1.0})
    scores = await ruler_compare(RulerGrader(), RULER_SCENARIO, GOOD, GOOD, RulerJudge(default_model="openai/j"))
    assert scores == (ruler.NEUTRAL_SCORE, ruler.NEUTRAL_SCORE)
    assert judge.calls == []


async def test_ruler_compare_failures_are_grader_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    import litellm

    with pytest.raises(GraderFailed, match="no judge_model"):
        await ruler_compare(RulerGrader(), RULER_SCENARIO, GOOD, BAD, RulerJudge())

    async def refuses(**kwargs: Any) -> litellm.ModelResponse:
        raise litellm.AuthenticationError(message="bad key", llm_provider="openai", model="judge")

    monkeypatch.setattr(litellm, "acompletion", refuses)
    with pytest.raises(GraderFailed, match="ruler grader: judge 'openai/j' failed: AuthenticationError"):
        await ruler_compare(RulerGrader(), RULER_SCENARIO, GOOD, BAD, RulerJudge(default_model="openai/j"))


def test_ruler_judge_keeps_its_secrets_out_of_its_repr() -> None:
    judge = RulerJudge(default_model="openai/j", litellm_params={"api_key": "sk-s3cret"})
    assert "sk-s3cret" not in repr(judge) and "openai/j" in repr(judge)
