"""The demo task's scenarios, reward and request bodies (no engine: the agent itself runs in the engine tests)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from artgw import demo_task
from artgw.demo_task import Episode, Scenario


def scenario(chamber: str = "Senate", senate: str = "yes,yes,no", house: str = "no,no,yes") -> Scenario:
    ballots = (("Senate", tuple(senate.split(","))), ("House", tuple(house.split(","))))
    return Scenario("s", "m", chamber, f'Did the {chamber} pass "m"?', ballots)


def test_scenarios_are_deterministic_and_the_splits_never_share_a_motion() -> None:
    train = demo_task.scenarios("train", 200, seed=3)
    assert train == demo_task.scenarios("train", 200, seed=3)
    assert train != demo_task.scenarios("train", 200, seed=4)
    held_out = demo_task.scenarios("heldout", 200, seed=3)
    assert {s.motion for s in train}.isdisjoint({s.motion for s in held_out})
    assert len({s.id for s in train + held_out}) == 400
    with pytest.raises(ValueError):
        demo_task.scenarios("test", 1)  # type: ignore[arg-type]


def test_each_chamber_has_clear_ballots_and_the_other_chamber_voted_the_other_way() -> None:
    scenarios = demo_task.scenarios("train", 300)
    for s in scenarios:
        assert [c for c, _ in s.ballots] == list(demo_task.CHAMBERS)
        for chamber, ballots in s.ballots:
            n = len(ballots)
            assert demo_task.MIN_BALLOTS <= n <= demo_task.MAX_BALLOTS and n % 2 == 1
            majority = max(ballots.count("yes"), ballots.count("no"))
            assert majority / n >= demo_task.MIN_SHARE - 1 / n
            assert s.tool_result(chamber) == ",".join(ballots)
        other = next(c for c in demo_task.CHAMBERS if c != s.chamber)
        assert demo_task.majority(s.ballots_of(s.chamber)) == s.verdict
        assert demo_task.majority(s.ballots_of(other)) != s.verdict  # the wrong chamber points the wrong way
        # The question names the asked chamber, and only it.
        assert s.chamber in s.question and other not in s.question and s.motion in s.question
    # Both chambers and both verdicts occur, in all four combinations.
    combos = {(s.chamber, s.verdict) for s in scenarios}
    assert combos == {(c, v) for c in demo_task.CHAMBERS for v in demo_task.ANSWERS}
    asked = [s.chamber for s in scenarios]
    assert 0.35 < asked.count("Senate") / len(asked) < 0.65
    verdicts = [s.verdict for s in scenarios]
    assert 0.35 < verdicts.count("yes") / len(verdicts) < 0.65


def test_the_tool_schema_is_one_strict_enum() -> None:
    (tool,) = demo_task.TOOLS
    function = tool["function"]
    assert function["name"] == "get_ballots" and function["strict"] is True
    params = function["parameters"]
    assert params["required"] == ["chamber"] and params["additionalProperties"] is False
    assert params["properties"] == {"chamber": {"type": "string", "enum": ["Senate", "House"]}}


def test_tool_result_is_the_named_chambers_ballots() -> None:
    s = scenario()
    assert s.tool_result("Senate") == "yes,yes,no"
    assert s.tool_result("House") == "no,no,yes"
    assert s.tool_result(None) == s.tool_result("senate") == demo_task.UNKNOWN_CHAMBER


@pytest.mark.parametrize(
    ("arguments", "chamber"),
    [
        ('{"chamber": "Senate"}', "Senate"),
        ('{ \n "chamber" :\t"House" }', "House"),
        ('{"chamber": "senate"}', None),
        ('{"room": "Senate"}', None),
        ('["Senate"]', None),
        ('{"chamber": "Sen', None),
        ("", None),
        (None, None),
    ],
)
def test_parse_argument(arguments: str | None, chamber: str | None) -> None:
    assert demo_task.parse_argument(arguments) == chamber


@pytest.mark.parametrize(
    ("asked", "called", "answer", "expected"),
    [
        # Asked about the Senate (passed, 2-1); the House voted it down.
        ("Senate", "Senate", "yes", 1.0),  # right chamber, right answer
        ("Senate", "Senate", "no", 0.0),  # right chamber, wrong answer
        ("Senate", "House", "no", 0.0),  # wrong chamber, answered what it read: still wrong
        ("Senate", "House", "yes", 0.0),  # wrong chamber, even with the right answer
        ("Senate", None, "yes", 0.0),  # no valid chamber
        # Asked about the House (rejected).
        ("House", "House", "no", 1.0),
        ("House", "House", " No. ", 1.0),
        ("House", "House", "yes", 0.0),
        ("House", "Senate", "yes", 0.0),
        ("House", "Senate", "no", 0.0),
        ("House", "House", None, 0.0),
    ],
)
def test_reward_needs_the_asked_chamber_and_its_majority(
    asked: str, called: str | None, answer: str | None, expected: float
) -> None:
    s = scenario(asked)
    assert s.verdict == ("yes" if asked == "Senate" else "no")
    assert demo_task.reward(s, called, answer) == expected


def test_logit_bias_names_the_two_answer_tokens(tmp_path: Path) -> None:
    vocab = {"yes": 508, "no": 479, "maybe": 3}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    assert demo_task.answer_logit_bias(tmp_path) == {"508": 100, "479": 100}


def test_group_body_carries_every_attempt_with_its_reward_and_tool_metric() -> None:
    episodes = [
        Episode("train-0-1", f"r{i}", True, "yes", float(i % 2), argument="Senate", argument_correct=bool(i % 2))
        for i in range(4)
    ]
    body = demo_task.group_body("my-agent", episodes, group_id="g-1")
    assert body["model"] == "my-agent" and body["group_id"] == "g-1"
    assert [r["rollout_id"] for r in body["rollouts"]] == ["r0", "r1", "r2", "r3"]
    assert [r["reward"] for r in body["rollouts"]] == [0.0, 1.0, 0.0, 1.0]
    assert [r["metrics"] for r in body["rollouts"]] == [
        {"called_tool": 1.0, "argument_correct": float(i % 2)} for i in range(4)
    ]
    assert body["metadata"]["scenario"] == "train-0-1"


class FakeCompletions:
    """Stands in for `client.chat.completions`: a tool call with `arguments` first, then the answer `answer`."""

    def __init__(self, arguments: str, answer: str = "yes", complete: bool = True) -> None:
        self.arguments, self.answer, self.complete = arguments, answer, complete
        self.requests: list[dict] = []

    async def create(self, **request):
        self.requests.append(request)
        if "tools" in request:
            if not self.complete:  # cut by max_tokens: vLLM's parser reports no call
                return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="", tool_calls=[]))])
            call = SimpleNamespace(id="call_1", function=SimpleNamespace(name="get_ballots", arguments=self.arguments))
            call.function.model_dump = lambda: {"name": "get_ballots", "arguments": self.arguments}
            message = SimpleNamespace(content=None, tool_calls=[call])
        else:
            message = SimpleNamespace(content=self.answer, tool_calls=None)
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def episode(completions: FakeCompletions, s: Scenario, **options) -> Episode:
    client = SimpleNamespace(chat=SimpleNamespace(completions=completions))
    return asyncio.run(
        demo_task.run_episode(client, s, model="my-agent", logit_bias={"1": 100, "2": 100}, rollout_id="r-1", **options)
    )


def test_an_episode_calls_the_tool_reads_the_named_chamber_then_answers_in_one_biased_token() -> None:
    completions = FakeCompletions('{"chamber": "Senate"}', "yes")
    got = episode(completions, scenario("Senate"))
    assert got == Episode("s", "r-1", True, "yes", 1.0, argument="Senate", argument_correct=True)
    first, second = completions.requests
    assert first["tool_choice"] == {"type": "function", "function": {"name": "get_ballots"}}
    assert first["tools"] == demo_task.TOOLS
    assert first["extra_headers"] == second["extra_headers"] == {"X-ART-Rollout-Id": "r-1"}
    assert first["temperature"] == second["temperature"] == 1.0
    assert second["max_tokens"] == 1 and second["logit_bias"] == {"1": 100, "2": 100}
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "yes,yes,no"}
    assert second["messages"][-2]["tool_calls"][0]["function"] == {
        "name": "get_ballots",
        "arguments": '{"chamber": "Senate"}',
    }


def test_the_wrong_chamber_gets_the_wrong_ballots_and_no_reward() -> None:
    completions = FakeCompletions('{"chamber": "House"}', "no")
    got = episode(completions, scenario("Senate"))
    assert got == Episode("s", "r-1", True, "no", 0.0, argument="House", argument_correct=False)
    assert completions.requests[1]["messages"][-1]["content"] == "no,no,yes"  # what the House cast


def test_greedy_temperatures_and_a_call_cut_short() -> None:
    completions = FakeCompletions('{"chamber": "House"}', "no")
    got = episode(completions, scenario("House"), tool_temperature=0.0, answer_temperature=0.0)
    assert got.reward == 1.0 and got.argument_correct
    assert [r["temperature"] for r in completions.requests] == [0.0, 0.0]
    cut = FakeCompletions("", complete=False)
    assert episode(cut, scenario()) == Episode("s", "r-1", False, None, 0.0)
    assert len(cut.requests) == 1  # no ballots, no answer
