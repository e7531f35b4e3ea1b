"""The demo task's scenarios, reward and request bodies (no engine: the agent itself runs in the engine tests)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from artgw import demo_task
from artgw.demo_task import Episode, Scenario


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
    verdicts = [s.verdict for s in scenarios]
    assert 0.35 < verdicts.count("yes") / len(verdicts) < 0.65


def test_reward_is_one_for_the_majority_only() -> None:
    s = Scenario("x", "m", "q", ("yes", "no", "yes"))
    assert s.verdict == "yes"
    assert demo_task.reward("yes", s) == 1.0
    assert demo_task.reward(" Yes. ", s) == 1.0
    assert demo_task.reward("no", s) == 0.0
    assert demo_task.reward(None, s) == 0.0
    assert demo_task.reward("yes!", Scenario("y", "m", "q", ("no", "no", "yes"))) == 0.0


def test_logit_bias_names_the_two_answer_tokens(tmp_path: Path) -> None:
    vocab = {"yes": 508, "no": 479, "maybe": 3}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    assert demo_task.answer_logit_bias(tmp_path) == {"508": 100, "479": 100}


def test_group_body_carries_every_attempt_with_its_reward() -> None:
    episodes = [Episode("train-0-1", f"r{i}", True, "yes", float(i % 2)) for i in range(4)]
    body = demo_task.group_body("my-agent", episodes, group_id="g-1")
    assert body["model"] == "my-agent" and body["group_id"] == "g-1"
    assert [r["rollout_id"] for r in body["rollouts"]] == ["r0", "r1", "r2", "r3"]
    assert [r["reward"] for r in body["rollouts"]] == [0.0, 1.0, 0.0, 1.0]
    assert body["metadata"]["scenario"] == "train-0-1"


class FakeCompletions:
    """Stands in for `client.chat.completions`: a tool call first, then the answer `yes`."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    async def create(self, **request):
        self.requests.append(request)
        if "tools" in request:
            call = SimpleNamespace(id="call_1", function=SimpleNamespace(name="get_ballots", arguments="{}"))
            call.function.model_dump = lambda: {"name": "get_ballots", "arguments": "{}"}
            message = SimpleNamespace(content=None, tool_calls=[call])
        else:
            message = SimpleNamespace(content="yes", tool_calls=None)
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def test_an_episode_calls_the_tool_then_answers_in_one_biased_token() -> None:
    completions = FakeCompletions()
    client = SimpleNamespace(chat=SimpleNamespace(completions=completions))
    scenario = Scenario("s", "m", 'Did the motion "m" pass?', ("yes", "yes", "no"))
    episode = asyncio.run(
        demo_task.run_episode(client, scenario, model="my-agent", logit_bias={"1": 100, "2": 100}, rollout_id="r-1")
    )
    assert episode == Episode("s", "r-1", True, "yes", 1.0)
    first, second = completions.requests
    assert first["tool_choice"] == {"type": "function", "function": {"name": "get_ballots"}}
    assert first["extra_headers"] == second["extra_headers"] == {"X-ART-Rollout-Id": "r-1"}
    assert second["max_tokens"] == 1 and second["logit_bias"] == {"1": 100, "2": 100}
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "yes,yes,no"}
    assert second["messages"][-2]["tool_calls"][0]["function"] == {"name": "get_ballots", "arguments": "{}"}
