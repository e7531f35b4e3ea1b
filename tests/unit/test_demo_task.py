"""The demo task's scenarios, reward, the calls' logit_bias and request bodies (no engine: the agent itself runs
in the engine tests)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from artgw import demo_task
from artgw.demo_task import Episode, Scenario

BIAS = {"get_ballots": {"1": 100}, "report": {"2": 100}}


def test_scenarios_are_deterministic_and_the_splits_never_share_a_motion() -> None:
    train = demo_task.scenarios("train", 200, seed=3)
    assert train == demo_task.scenarios("train", 200, seed=3)
    assert train != demo_task.scenarios("train", 200, seed=4)
    held_out = demo_task.scenarios("heldout", 200, seed=3)
    assert {s.motion for s in train}.isdisjoint({s.motion for s in held_out})
    assert len({s.id for s in train + held_out}) == 400
    with pytest.raises(ValueError):
        demo_task.scenarios("test", 1)  # type: ignore[arg-type]


def test_ballots_have_a_clear_majority_and_both_verdicts_occur() -> None:
    scenarios = demo_task.scenarios("train", 300)
    for s in scenarios:
        n = len(s.ballots)
        assert demo_task.MIN_BALLOTS <= n <= demo_task.MAX_BALLOTS and n % 2 == 1
        majority = max(s.ballots.count("yes"), s.ballots.count("no"))
        assert majority / n >= demo_task.MIN_SHARE - 1 / n
        assert s.tool_result() == ",".join(s.ballots)
        assert s.motion in s.question
    verdicts = [s.verdict for s in scenarios]
    assert 0.35 < verdicts.count("yes") / len(verdicts) < 0.65


def test_the_tools_get_ballots_without_arguments_and_report_with_one_strict_enum() -> None:
    ballots, report = (t["function"] for t in demo_task.TOOLS)
    assert ballots["name"] == "get_ballots" and report["name"] == "report"
    assert ballots["strict"] is report["strict"] is True
    assert ballots["parameters"]["properties"] == {} and ballots["parameters"]["required"] == []
    assert report["parameters"]["properties"] == {"passed": {"type": "string", "enum": ["yes", "no"]}}
    assert report["parameters"]["required"] == ["passed"] and report["parameters"]["additionalProperties"] is False


@pytest.mark.parametrize(
    ("arguments", "passed"),
    [
        ('{"passed": "yes"}', "yes"),
        ('{ \n "passed" :\t"no" }', "no"),
        ('{"passed": "Yes"}', None),
        ('{"passed": "maybe"}', None),
        ('{"carried": "yes"}', None),
        ('["yes"]', None),
        ('{"passed": "ye', None),
        ("", None),
        (None, None),
    ],
)
def test_parse_argument(arguments: str | None, passed: str | None) -> None:
    assert demo_task.parse_argument(arguments) == passed


@pytest.mark.parametrize(
    ("ballots", "reported", "expected"),
    [
        (("yes", "no", "yes"), "yes", 1.0),  # passed, reported passed
        (("yes", "no", "yes"), "no", 0.0),
        (("no", "no", "yes"), "no", 1.0),  # rejected, reported rejected
        (("no", "no", "yes"), "yes", 0.0),
        (("yes", "no", "yes"), None, 0.0),  # no valid report
    ],
)
def test_reward_is_one_for_reporting_the_majority_only(
    ballots: tuple[str, ...], reported: str | None, expected: float
) -> None:
    s = Scenario("x", "m", "q", ballots)
    assert s.verdict == ("yes" if ballots.count("yes") > ballots.count("no") else "no")
    assert demo_task.reward(reported, s) == expected


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer alone (what call_logit_bias reads): built in about a second, no weights."""
    from artgw.tiny_model import TinyModelSpec, build_tokenizer

    out = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(TinyModelSpec()).save_pretrained(out)
    return out


def test_call_logit_bias_leaves_one_token_at_each_position_but_the_value(tiny_tokenizer: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_tokenizer / "tokenizer.json"))
    biases = demo_task.call_logit_bias(tiny_tokenizer)
    assert set(biases) == {"get_ballots", "report"}
    tokens = {tool: {tokenizer.id_to_token(int(i)): b for i, b in bias.items()} for tool, bias in biases.items()}
    for bias in tokens.values():
        assert {t for t, b in bias.items() if b == -100} == {"Ġ", "ĉ", "Ċ"}  # whitespace: space, tab, newline
        assert all(b in (100, -100) for b in bias.values())
    # Both values of `passed` are favoured alike (the model's own preference decides between them) ...
    assert tokens["report"]["yes"] == tokens["report"]["no"] == 100
    assert "yes" not in tokens["get_ballots"] and "no" not in tokens["get_ballots"]
    # ... and so is each call's own tokenization, but for a token that begins another one (`{` of `{"`).
    for tool, texts in demo_task.CALL_TEXTS.items():
        for text in texts:
            own = tokenizer.encode(text, add_special_tokens=False).tokens
            assert {t for t in own if t not in ("Ġ", "{")} <= {t for t, b in tokens[tool].items() if b == 100}
    assert "{" not in tokens["get_ballots"] and "{" not in tokens["report"]


def test_group_body_carries_every_attempt_with_its_reward() -> None:
    episodes = [Episode("train-0-1", f"r{i}", True, "yes", float(i % 2), reported=True) for i in range(4)]
    body = demo_task.group_body("my-agent", episodes, group_id="g-1")
    assert body.model == "my-agent" and body.group_id == "g-1"
    assert [r.rollout_id for r in body.rollouts] == ["r0", "r1", "r2", "r3"]
    assert [r.reward for r in body.rollouts] == [0.0, 1.0, 0.0, 1.0]
    assert all(r.metrics == {"called_tool": 1.0, "reported": 1.0} for r in body.rollouts)
    assert body.metadata is not None and body.metadata["scenario"] == "train-0-1"


class FakeCompletions:
    """Stands in for `client.chat.completions`: answers each forced call with a call of that tool, `arguments`
    for report (a call of the named tool that is cut short: no call)."""

    def __init__(self, arguments: str = '{"passed": "yes"}', cut: str | None = None) -> None:
        self.arguments, self.cut = arguments, cut
        self.requests: list[dict] = []

    async def create(self, **request):
        self.requests.append(request)
        name = request["tool_choice"]["function"]["name"]
        if name == self.cut:
            return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="", tool_calls=[]))])
        arguments = "{}" if name == "get_ballots" else self.arguments
        function = SimpleNamespace(name=name, arguments=arguments)
        function.model_dump = lambda: {"name": name, "arguments": arguments}
        call = SimpleNamespace(id=f"call_{len(self.requests)}", function=function)
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=None, tool_calls=[call]))])


def episode(completions: FakeCompletions, scenario: Scenario, **options) -> Episode:
    client = SimpleNamespace(chat=SimpleNamespace(completions=completions))
    return asyncio.run(
        demo_task.run_episode(client, scenario, model="my-agent", logit_bias=BIAS, rollout_id="r-1", **options)
    )


def test_an_episode_calls_get_ballots_then_reports_the_value_that_decides_the_reward() -> None:
    completions = FakeCompletions('{"passed": "yes"}')
    scenario = Scenario("s", "m", 'Did the motion "m" pass?', ("yes", "yes", "no"))
    assert episode(completions, scenario) == Episode("s", "r-1", True, "yes", 1.0, reported=True)
    first, second = completions.requests
    for request, tool in ((first, "get_ballots"), (second, "report")):
        assert request["tool_choice"] == {"type": "function", "function": {"name": tool}}
        assert request["tools"] == demo_task.TOOLS
        assert request["logit_bias"] == BIAS[tool]
        assert request["temperature"] == 1.0 and request["max_tokens"] == demo_task.TOOL_CALL_MAX_TOKENS
        assert request["extra_headers"] == {"X-ART-Rollout-Id": "r-1"}
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "yes,yes,no"}
    assert second["messages"][-2]["tool_calls"][0]["function"] == {"name": "get_ballots", "arguments": "{}"}
    # The wrong value: the calls are made all the same, the reward is 0.
    wrong = episode(FakeCompletions('{"passed": "no"}'), scenario, temperature=0.0)
    assert wrong == Episode("s", "r-1", True, "no", 0.0, reported=True)


def test_greedy_and_calls_cut_short() -> None:
    scenario = Scenario("s", "m", "q", ("no", "no", "yes"))
    completions = FakeCompletions('{"passed": "no"}')
    assert episode(completions, scenario, temperature=0.0).reward == 1.0
    assert [r["temperature"] for r in completions.requests] == [0.0, 0.0]
    cut = FakeCompletions(cut="get_ballots")
    assert episode(cut, scenario) == Episode("s", "r-1", False, None, 0.0)
    assert len(cut.requests) == 1  # no ballots, no report
    cut = FakeCompletions(cut="report")
    assert episode(cut, scenario) == Episode("s", "r-1", True, None, 0.0, reported=False)


def test_a_failing_episode_is_kept_with_its_error() -> None:
    class Broken:
        async def create(self, **request):
            raise RuntimeError("engine down")

    client = SimpleNamespace(chat=SimpleNamespace(completions=Broken()))
    jobs = [(Scenario("s", "m", "q", ("yes",)), "r-1")]
    (got,) = asyncio.run(demo_task.run_episodes(client, jobs, model="my-agent", logit_bias=BIAS))
    assert got == Episode("s", "r-1", False, None, 0.0, error="RuntimeError: engine down")


def test_a_failing_episode_names_what_caused_its_error() -> None:
    class Dropped:
        async def create(self, **request):
            try:
                raise ConnectionResetError("reset by peer")
            except ConnectionResetError as exc:
                raise RuntimeError("Connection error.") from exc

    client = SimpleNamespace(chat=SimpleNamespace(completions=Dropped()))
    jobs = [(Scenario("s", "m", "q", ("yes",)), "r-1")]
    (got,) = asyncio.run(demo_task.run_episodes(client, jobs, model="my-agent", logit_bias=BIAS))
    assert got.error == "RuntimeError: Connection error. <- ConnectionResetError: reset by peer"


def test_logit_bias_keys_are_token_ids_of_the_tokenizer(tiny_tokenizer: Path) -> None:
    vocab = json.loads((tiny_tokenizer / "tokenizer.json").read_text())["model"]["vocab"]
    for bias in demo_task.call_logit_bias(tiny_tokenizer).values():
        assert all(k.isdigit() for k in bias)
    assert str(vocab["yes"]) in demo_task.call_logit_bias(tiny_tokenizer)["report"]
