"""Unit tests for the ruler package.

A real judge cannot run in unit tests (no network, no model here), so the judge is faked
with litellm's own seams: ``litellm.acompletion`` replaced by a recording async function
that returns ``litellm.ModelResponse`` objects, or litellm's ``mock_response=`` parameter.
The integration test with a real vLLM judge lives elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

import ruler
from ruler import (
    DEFAULT_RUBRIC,
    NEUTRAL_SCORE,
    MemoryJudgeCache,
    RulerError,
    Score,
    Trajectory,
    build_judge_messages,
    cache_key,
    common_prefix_length,
    parse_judge_answer,
    score_group,
)
from ruler._prompt import response_format

if TYPE_CHECKING:
    import litellm

# litellm (~3 s of CPU to import) is imported by the tests that use it, not at collection by every worker.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-map download

# ---------------------------------------------------------------------------- fixtures

SYSTEM = {"role": "system", "content": "You are a weather agent."}
USER = {"role": "user", "content": "Weather in Paris?"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def call(arguments: str, call_id: str = "call_1") -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        ],
    }


def result(text: str, call_id: str = "call_1") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def answer(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


PARIS = call('{"city": "Paris"}')
GOOD = Trajectory(messages=[SYSTEM, USER, PARIS, result("18C, sunny"), answer("18C and sunny.")], tools=TOOLS)
# Differs from GOOD only in the tool call's arguments.
WRONG_CITY = Trajectory(
    messages=[SYSTEM, USER, call('{"city": "Lyon"}'), result("12C, rain"), answer("12C and rain.")],
    tools=TOOLS,
)
NO_TOOL = Trajectory(messages=[SYSTEM, USER, answer("I cannot check the weather.")], tools=TOOLS)


def judge_json(*scores: float) -> str:
    """A judge answer in the schema's shape: {"scores": {"1": {"explanation": ..., "score": ...}, ...}}."""
    return msgspec.json.encode(
        {"scores": {str(i): {"explanation": f"reason {i}", "score": s} for i, s in enumerate(scores, start=1)}}
    ).decode()


def legacy_judge_json(*scores: float) -> str:
    """A judge answer in the list shape RULER asked for before (still accepted)."""
    return msgspec.json.encode(
        {
            "scores": [
                {"trajectory_id": str(i), "explanation": f"reason {i}", "score": s}
                for i, s in enumerate(scores, start=1)
            ]
        }
    ).decode()


def entries(*pairs: tuple[str, float]) -> str:
    """A hand-written answer object with the given (key, score) entries, repeats kept."""
    body = ", ".join(f'"{key}": {{"explanation": "x", "score": {score}}}' for key, score in pairs)
    return f'{{"scores": {{{body}}}}}'


class FakeJudge:
    """Stands in for ``litellm.acompletion``: plays back outcomes, records every call."""

    def __init__(self, *outcomes: str | Exception) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, **kwargs: Any) -> litellm.ModelResponse:
        import litellm

        self.calls.append(kwargs)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return litellm.ModelResponse(
            model="judge",
            choices=[{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": outcome}}],
            usage={"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120},
        )


@pytest.fixture
def fake_judge(monkeypatch: pytest.MonkeyPatch):
    import litellm

    def install(*outcomes: str | Exception) -> FakeJudge:
        judge = FakeJudge(*outcomes)
        monkeypatch.setattr(litellm, "acompletion", judge)
        return judge

    return install


def transient() -> Exception:
    import litellm

    return litellm.ServiceUnavailableError(message="overloaded", llm_provider="openai", model="judge")


# ------------------------------------------------------------------------ public surface


def test_public_api_is_pinned() -> None:
    assert sorted(ruler.__all__) == [
        "Criterion",
        "DEFAULT_RUBRIC",
        "Judge",
        "JudgeCache",
        "JudgeUsage",
        "Judgement",
        "MemoryJudgeCache",
        "NEUTRAL_SCORE",
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


def test_check_judge_model_knows_providers_without_calling_them() -> None:
    ruler.check_judge_model("openai/gpt-4o-mini")
    ruler.check_judge_model("hosted_vllm/tiny", {"api_base": "http://127.0.0.1:1/v1"})
    with pytest.raises(ruler.RulerError, match="unknown judge model"):
        ruler.check_judge_model("no-such-provider-model-xyz")


def test_import_stays_out_of_the_gateway_and_litellm() -> None:
    # A fresh interpreter: other tests may have imported these modules into this one.
    code = (
        "import sys, ruler; "
        "banned = {'gateway', 'trainer', 'artgw', 'litellm'}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in banned))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------ common prefix


def test_prefix_stops_at_differing_tool_call_argument() -> None:
    # Message 2 is an assistant tool call in both; only its JSON arguments differ.
    assert common_prefix_length([GOOD, WRONG_CITY]) == 2


def test_prefix_stops_at_differing_tool_call_id() -> None:
    other = Trajectory(messages=[SYSTEM, USER, call('{"city": "Paris"}', call_id="call_2")])
    assert common_prefix_length([GOOD, other]) == 2


def test_prefix_includes_identical_tool_calls_and_ignores_key_order() -> None:
    reordered = {"tool_calls": PARIS["tool_calls"], "content": None, "role": "assistant"}
    other = Trajectory(messages=[SYSTEM, USER, reordered, result("18C, sunny"), answer("Sunny, 18C.")])
    assert common_prefix_length([GOOD, other]) == 4


def test_prefix_edge_cases() -> None:
    short = Trajectory(messages=[SYSTEM, USER])
    assert common_prefix_length([GOOD, short]) == 2  # one trajectory is a prefix of the other
    assert common_prefix_length([GOOD, GOOD]) == 5
    assert common_prefix_length([GOOD]) == 5
    assert common_prefix_length([]) == 0
    assert common_prefix_length([GOOD, Trajectory(messages=[USER])]) == 0


# ------------------------------------------------------------------------ judge prompt


def test_prompt_shows_context_once_and_each_remainder_in_its_block() -> None:
    system, user = build_judge_messages([GOOD, WRONG_CITY, NO_TOOL], "Be strict.")
    assert system["role"] == "system" and "Be strict." in system["content"]
    text = user["content"]

    # Context: the shared system + user messages, exactly once.
    assert text.count("<context>") == 1
    context = text.split("<context>\n", 1)[1].split("\n</context>", 1)[0]
    assert context.splitlines() == [
        '{"role":"system","content":"You are a weather agent."}',
        '{"role":"user","content":"Weather in Paris?"}',
    ]
    assert text.count("You are a weather agent.") == 1

    # Tools identical across trajectories: shown once, before the trajectories.
    assert text.count("<tools>") == 1
    assert text.index("<tools>") < text.index('<trajectory id="1">')

    blocks = {i: text.split(f'<trajectory id="{i}">\n', 1)[1].split("\n</trajectory>", 1)[0] for i in (1, 2, 3)}
    assert blocks[1].splitlines() == [
        '{"role":"assistant","tool_calls":[{"id":"call_1","type":"function","function":'
        '{"name":"get_weather","arguments":"{\\"city\\": \\"Paris\\"}"}}]}',
        '{"role":"tool","tool_call_id":"call_1","content":"18C, sunny"}',
        '{"role":"assistant","content":"18C and sunny."}',
    ]
    assert '\\"Lyon\\"' in blocks[2] and "12C and rain." in blocks[2] and "Paris" not in blocks[2]
    assert blocks[3] == '{"role":"assistant","content":"I cannot check the weather."}'
    assert '(ids "1", "2", "3")' in text and 'exactly the keys "1", "2", "3"' in text
    assert '{"scores": {"1": {"explanation": "...", "score":' in text
    assert '{"scores": {"1": {"explanation": "...", "score": 0.0}' in system["content"]
    assert "trajectory_id" not in system["content"] + text


def test_prompt_shows_differing_tools_per_trajectory() -> None:
    no_tools = Trajectory(messages=NO_TOOL.messages)
    _, user = build_judge_messages([GOOD, no_tools], DEFAULT_RUBRIC)
    text = user["content"]
    assert text.count("<tools>") == 2
    block_1 = text.split('<trajectory id="1">', 1)[1].split("</trajectory>", 1)[0]
    block_2 = text.split('<trajectory id="2">', 1)[1].split("</trajectory>", 1)[0]
    assert "get_weather" in block_1.split("</tools>")[0]
    assert "<tools>\n(none)\n</tools>" in block_2


def test_prompt_without_tools_or_shared_prefix() -> None:
    a = Trajectory(messages=[answer("a")])
    b = Trajectory(messages=[answer("b")])
    _, user = build_judge_messages([a, b], DEFAULT_RUBRIC)
    assert "<tools>" not in user["content"] and "<context>" not in user["content"]


def test_prompt_marks_a_trajectory_that_is_all_prefix() -> None:
    short = Trajectory(messages=[SYSTEM, USER], tools=TOOLS)
    _, user = build_judge_messages([GOOD, short], DEFAULT_RUBRIC)
    block_2 = user["content"].split('<trajectory id="2">\n', 1)[1].split("\n</trajectory>", 1)[0]
    assert block_2 == "(no messages after the shared context)"


# ------------------------------------------------------------------------ judge answer


def test_parse_good_answer_in_id_order() -> None:
    text = '{"scores": {"2": {"explanation": "worse", "score": 0.25}, "1": {"explanation": "better", "score": 1}}}'
    assert parse_judge_answer(text, 2) == [
        Score(score=1.0, explanation="better"),
        Score(score=0.25, explanation="worse"),
    ]
    assert [s.score for s in parse_judge_answer(judge_json(0.1, 0.2, 0.3), 3)] == [0.1, 0.2, 0.3]


def test_parse_tolerates_a_code_fence() -> None:
    assert parse_judge_answer(f"```json\n{judge_json(0.5, 0.0)}\n```", 2)[1].score == 0.0


def test_parse_accepts_the_legacy_list_shape() -> None:
    # Judges that ignore the schema may still answer in RULER's earlier list format.
    text = (
        '{"scores": [{"trajectory_id": "2", "explanation": "worse", "score": 0.25},'
        ' {"trajectory_id": 1, "explanation": "better", "score": 1}]}'
    )
    assert parse_judge_answer(text, 2) == [
        Score(score=1.0, explanation="better"),
        Score(score=0.25, explanation="worse"),
    ]
    assert parse_judge_answer(legacy_judge_json(0.5, 0.0), 2)[1] == Score(score=0.0, explanation="reason 2")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("The first one is better.", "not the expected JSON"),
        ('{"scores": "1: 0.5, 2: 0.5"}', "not the expected JSON"),
        ('{"score": {"1": {"explanation": "x", "score": 0.5}}}', "not the expected JSON"),  # no "scores"
        ('{"scores": {"1": {"explanation": "x"}, "2": {"explanation": "y"}}}', "not the expected JSON"),  # no score
        ('{"scores": {"1": {"score": 0.5}, "2": {"score": 0.5}}}', "not the expected JSON"),  # no explanation
        (entries(("1", '"high"'), ("2", 0.5)), "not the expected JSON"),
        (entries(("1", 0.5)), "1 scores for 2 trajectories; missing ids 2"),
        (entries(("2", 0.5)), "1 scores for 2 trajectories; missing ids 1"),
        ('{"scores": {}}', "0 scores for 2 trajectories; missing ids 1, 2"),
        (judge_json(0.5, 0.5, 0.5), "unknown trajectory id '3'; expected ids 1..2"),
        (entries(("1", 0.5), ("2", 0.5), ("4", 0.5)), "unknown trajectory id '4'"),
        (entries(("0", 0.5), ("1", 0.5)), "unknown trajectory id '0'"),
        (entries(("first", 0.5), ("2", 0.5)), "unknown trajectory id 'first'"),
        (judge_json(0.5, 1.5), "is 1.5, not in [0, 1]"),
        (judge_json(-0.1, 0.5), "is -0.1, not in [0, 1]"),
        (entries(("1", "NaN"), ("2", 0.5)), "not the expected JSON"),
        (entries(("1", "1e999"), ("2", 0.5)), "not the expected JSON"),
        # msgspec alone would keep the last of repeated keys; a repeat is rejected instead.
        (entries(("1", 0.1), ("2", 0.5), ("1", 0.2)), "scores trajectory '1' more than once"),
        (entries(("1", 0.1), ("01", 0.2)), "scores trajectory '1' more than once"),
        # The legacy list shape is checked the same way.
        (legacy_judge_json(0.5), "1 scores for 2 trajectories; missing ids 2"),
        (legacy_judge_json(0.5, 0.5, 0.5), "unknown trajectory id '3'"),
        (legacy_judge_json(0.5, 1.5), "is 1.5, not in [0, 1]"),
        ('{"scores": [{"trajectory_id": "1", "explanation": "x", "score": NaN}]}', "not the expected JSON"),
        (
            '{"scores": [{"trajectory_id": "1", "explanation": "a", "score": 0.1},'
            ' {"trajectory_id": "1", "explanation": "b", "score": 0.2}]}',
            "scores trajectory '1' more than once",
        ),
        (
            '{"scores": [{"explanation": "a", "score": 0.1}, {"explanation": "b", "score": 0.2}]}',
            "not the expected JSON",
        ),  # missing trajectory_id
    ],
)
def test_parse_rejects_malformed_answers(text: str, problem: str) -> None:
    with pytest.raises(RulerError, match="judge") as info:
        parse_judge_answer(text, 2)
    assert problem in str(info.value)


def test_response_format_schema_fixes_the_ids() -> None:
    fmt = response_format(3)
    assert fmt["type"] == "json_schema"
    assert fmt["json_schema"]["name"] == "ruler_scores" and fmt["json_schema"]["strict"] is True
    schema = fmt["json_schema"]["schema"]
    assert schema["required"] == ["scores"] and schema["additionalProperties"] is False
    scores = schema["properties"]["scores"]
    assert scores["type"] == "object" and scores["additionalProperties"] is False
    assert list(scores["properties"]) == ["1", "2", "3"] and scores["required"] == ["1", "2", "3"]
    for entry in scores["properties"].values():
        assert entry == {
            "type": "object",
            "properties": {
                "explanation": {"type": "string"},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["explanation", "score"],
            "additionalProperties": False,
        }
        assert list(entry["properties"]) == ["explanation", "score"]  # the judge reasons, then scores
    # Every id gets its own schema object, so a change to one cannot leak into the others.
    assert scores["properties"]["1"] is not scores["properties"]["2"]
    # An answer in exactly the schema's shape parses.
    assert [s.score for s in parse_judge_answer(judge_json(0.0, 0.5, 1.0), 3)] == [0.0, 0.5, 1.0]


# ------------------------------------------------------------------------ cache key


def test_cache_key_is_canonical_and_covers_model_rubric_and_trajectories() -> None:
    key = cache_key("judge", DEFAULT_RUBRIC, [GOOD, WRONG_CITY])
    reordered = Trajectory(messages=[dict(reversed(m.items())) for m in GOOD.messages], tools=TOOLS)
    assert cache_key("judge", DEFAULT_RUBRIC, [reordered, WRONG_CITY]) == key
    assert len(key) == 64 and int(key, 16) >= 0
    assert cache_key("other-judge", DEFAULT_RUBRIC, [GOOD, WRONG_CITY]) != key
    assert cache_key("judge", "Be strict.", [GOOD, WRONG_CITY]) != key
    assert cache_key("judge", DEFAULT_RUBRIC, [WRONG_CITY, GOOD]) != key


def test_cache_key_covers_the_prompt_version(monkeypatch: pytest.MonkeyPatch) -> None:
    # Answers cached under an older prompt/answer format are never looked up again.
    key = cache_key("judge", DEFAULT_RUBRIC, [GOOD, WRONG_CITY])
    monkeypatch.setattr(ruler._prompt, "_PROMPT_VERSION", ruler._prompt._PROMPT_VERSION - 1)
    assert cache_key("judge", DEFAULT_RUBRIC, [GOOD, WRONG_CITY]) != key


# ------------------------------------------------------------------------ score_group


async def test_identical_trajectories_get_neutral_scores_without_a_judge_call(fake_judge) -> None:
    judge = fake_judge()  # no outcomes: any call would fail
    copy = Trajectory(messages=[dict(m) for m in GOOD.messages], tools=TOOLS)
    result = await score_group([GOOD, copy, GOOD], judge_model="judge")
    assert judge.calls == []
    assert [s.score for s in result.scores] == [NEUTRAL_SCORE] * 3
    assert result.usage.judge_calls == 0 and result.usage.cost_usd == 0.0

    single = await score_group([GOOD], judge_model="judge")
    assert single.scores[0].score == NEUTRAL_SCORE and judge.calls == []
    assert (await score_group([], judge_model="judge")).scores == []


async def test_judges_distinct_trajectories_once_and_fans_scores_out(fake_judge) -> None:
    judge = fake_judge(judge_json(0.9, 0.1))
    result = await score_group(
        [GOOD, WRONG_CITY, GOOD],
        judge_model="hosted_vllm/judge",
        litellm_params={"api_base": "http://judge:8000/v1", "api_key": "sk-test", "temperature": 0.0},
        backoff_seconds=0,
    )
    assert [s.score for s in result.scores] == [0.9, 0.1, 0.9]
    assert result.scores[1].explanation == "reason 2"
    assert result.usage.judge_calls == 1 and result.usage.prompt_tokens == 100
    assert result.usage.completion_tokens == 20 and result.usage.cost_usd is None  # no price for "judge"

    (sent,) = judge.calls
    assert sent["model"] == "hosted_vllm/judge"
    assert sent["messages"] == build_judge_messages([GOOD, WRONG_CITY], DEFAULT_RUBRIC)
    assert sent["api_base"] == "http://judge:8000/v1" and sent["api_key"] == "sk-test"
    assert sent["temperature"] == 0.0
    fmt = sent["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "ruler_scores"
    assert fmt["json_schema"]["strict"] is True
    assert fmt == response_format(2)
    scores = fmt["json_schema"]["schema"]["properties"]["scores"]
    assert list(scores["properties"]) == ["1", "2"] and scores["required"] == ["1", "2"]


async def test_transient_failure_is_retried(fake_judge) -> None:
    judge = fake_judge(transient(), judge_json(0.2, 0.8))
    result = await score_group([GOOD, NO_TOOL], judge_model="judge", backoff_seconds=0)
    assert len(judge.calls) == 2
    assert [s.score for s in result.scores] == [0.2, 0.8]
    assert result.usage.judge_calls == 2 and result.usage.prompt_tokens == 100  # one response received


async def test_invalid_answer_is_retried(fake_judge) -> None:
    judge = fake_judge("not json", judge_json(0.7, 0.3))
    result = await score_group([GOOD, NO_TOOL], judge_model="judge", backoff_seconds=0)
    assert len(judge.calls) == 2
    assert [s.score for s in result.scores] == [0.7, 0.3]
    assert result.usage.judge_calls == 2 and result.usage.prompt_tokens == 200  # both responses cost tokens


async def test_legacy_list_answer_is_accepted(fake_judge) -> None:
    fake_judge(legacy_judge_json(0.4, 0.6))
    result = await score_group([GOOD, NO_TOOL], judge_model="judge", backoff_seconds=0)
    assert [s.score for s in result.scores] == [0.4, 0.6] and result.usage.judge_calls == 1


async def test_auth_error_fails_at_once(fake_judge) -> None:
    import litellm

    error = litellm.AuthenticationError(message="bad key", llm_provider="openai", model="judge")
    judge = fake_judge(error, judge_json(0.5, 0.5))
    with pytest.raises(RulerError, match="AuthenticationError") as info:
        await score_group(
            [GOOD, NO_TOOL], judge_model="judge", litellm_params={"api_key": "sk-secret"}, backoff_seconds=0
        )
    assert len(judge.calls) == 1
    assert info.value.__cause__ is error
    assert "sk-secret" not in str(info.value)


async def test_bad_request_fails_at_once(fake_judge) -> None:
    import litellm

    error = litellm.BadRequestError(message="no json_schema", model="judge", llm_provider="openai")
    judge = fake_judge(error)
    with pytest.raises(RulerError, match="BadRequestError"):
        await score_group([GOOD, NO_TOOL], judge_model="judge", backoff_seconds=0)
    assert len(judge.calls) == 1


async def test_gives_up_after_max_retries_with_the_last_problem(fake_judge) -> None:
    judge = fake_judge(transient(), "not json", judge_json(0.5, 2.0))
    with pytest.raises(RulerError, match=r"in 3 attempts; last problem: .*is 2\.0, not in \[0, 1\]"):
        await score_group([GOOD, NO_TOOL], judge_model="judge", max_retries=2, backoff_seconds=0)
    assert len(judge.calls) == 3


async def test_cache_hit_skips_the_judge(fake_judge) -> None:
    judge = fake_judge(judge_json(0.9, 0.1))
    cache = MemoryJudgeCache()
    first = await score_group([GOOD, WRONG_CITY], judge_model="judge", cache=cache, backoff_seconds=0)
    second = await score_group([GOOD, WRONG_CITY, WRONG_CITY], judge_model="judge", cache=cache)
    assert len(judge.calls) == 1
    assert first.usage.cache_hits == 0 and first.usage.judge_calls == 1
    assert second.usage.cache_hits == 1 and second.usage.judge_calls == 0 and second.usage.prompt_tokens == 0
    assert [s.score for s in second.scores] == [0.9, 0.1, 0.1]
    assert await cache.get(cache_key("judge", DEFAULT_RUBRIC, [GOOD, WRONG_CITY])) == judge_json(0.9, 0.1)

    # Another rubric is another question: the judge is asked again.
    fake_judge(judge_json(0.6, 0.4))
    third = await score_group([GOOD, WRONG_CITY], judge_model="judge", rubric="Be strict.", cache=cache)
    assert third.usage.cache_hits == 0 and [s.score for s in third.scores] == [0.6, 0.4]


async def test_unusable_cache_entry_is_ignored(fake_judge) -> None:
    cache = MemoryJudgeCache()
    await cache.put(cache_key("judge", DEFAULT_RUBRIC, [GOOD, NO_TOOL]), "garbage")
    judge = fake_judge(judge_json(1.0, 0.0))
    result = await score_group([GOOD, NO_TOOL], judge_model="judge", cache=cache)
    assert len(judge.calls) == 1 and result.usage.cache_hits == 0
    assert await cache.get(cache_key("judge", DEFAULT_RUBRIC, [GOOD, NO_TOOL])) == judge_json(1.0, 0.0)


async def test_through_litellm_mock_response() -> None:
    # litellm's own mock: the real acompletion path, no network.
    result = await score_group(
        [GOOD, NO_TOOL],
        judge_model="openai/gpt-4o-mini",
        litellm_params={"mock_response": judge_json(0.8, 0.2), "api_key": "sk-unused"},
    )
    assert [s.score for s in result.scores] == [0.8, 0.2]
    assert result.usage.judge_calls == 1 and result.usage.prompt_tokens > 0
    assert result.usage.cost_usd is not None and result.usage.cost_usd > 0  # a model litellm has prices for


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"litellm_params": {"model": "x"}}, "must not set model"),
        (
            {"litellm_params": {"response_format": {}, "messages": []}},
            "must not set messages, response_format",
        ),
        ({"max_retries": -1}, "max_retries"),
        ({"backoff_seconds": -1.0}, "backoff_seconds"),
    ],
)
async def test_rejects_bad_arguments(kwargs: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        await score_group([GOOD, NO_TOOL], judge_model="judge", **kwargs)
