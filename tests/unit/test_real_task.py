"""The real model's demo task (`artgw demo --model smollm2`): its questions, splits, request and scoring, and the
demo's presets and intervals (no engine: the loop on the real model is tests/integration/test_real_model.py's)."""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from artgw import real_task
from artgw.demo import DemoConfig, mean_interval, wilson_interval
from artgw.real_task import Question


@pytest.mark.parametrize("task", list(real_task.TASKS))
def test_questions_are_deterministic_and_the_splits_share_no_pair(task: real_task.TaskName) -> None:
    train = real_task.questions(task, "train", 300, seed=2)
    assert train == real_task.questions(task, "train", 300, seed=2)
    assert train != real_task.questions(task, "train", 300, seed=3)
    held_out = real_task.questions(task, "heldout", 300, seed=2)

    def pair(q: Question) -> frozenset[int]:
        return frozenset(int(n) for n in re.findall(r"\d+", q.question))

    assert {pair(q) for q in train}.isdisjoint({pair(q) for q in held_out})
    assert len({q.id for q in train + held_out}) == 600
    for q in train + held_out:
        assert q.correct in q.options and len(set(q.options)) == len(q.options)
        a, b = sorted(pair(q)) if len(pair(q)) == 2 else (next(iter(pair(q))),) * 2
        assert int(q.correct) == (max(a, b) if task == "larger" else a + b)
    with pytest.raises(ValueError):
        real_task.questions(task, "test", 1)  # type: ignore[arg-type]


def test_the_larger_answer_is_either_number_about_equally() -> None:
    questions = real_task.questions("larger", "train", 400)
    first = sum(q.correct == q.options[0] for q in questions) / len(questions)
    assert 0.4 < first < 0.6  # no position wins: the model must compare


def test_the_request_constrains_the_answer_to_the_options() -> None:
    q = Question("q1", "Which number is larger: 12 or 57?", ("12", "57"), "57")
    body = real_task.request(q)
    assert body["messages"] == [{"role": "user", "content": "Which number is larger: 12 or 57? Answer in JSON."}]
    schema = body["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["answer"]["enum"] == ["12", "57"] and schema["required"] == ["answer"]
    assert real_task.parse_answer('{"answer": "57"}', q) == "57"
    assert real_task.parse_answer('{ "answer" : "12" }', q) == "12"
    for bad in ('{"answer": "99"}', '{"answer": "5', "", None, "[]"):
        assert real_task.parse_answer(bad, q) is None


class FakeCompletions:
    """Answers each call with the JSON it is given, and keeps the request (what the SDK would send)."""

    def __init__(self, content: str) -> None:
        self.content = content
        self.requests: list[dict[str, Any]] = []

    async def create(self, **request: Any) -> Any:
        self.requests.append(request)
        if self.content == "raise":
            raise RuntimeError("engine gone")
        # A JSON object is complete ("stop"); anything else was cut at max_tokens ("length").
        finish_reason = "stop" if self.content.endswith("}") else "length"
        return SimpleNamespace(
            choices=[SimpleNamespace(message=SimpleNamespace(content=self.content), finish_reason=finish_reason)]
        )


def _client(content: str) -> Any:
    return SimpleNamespace(chat=SimpleNamespace(completions=FakeCompletions(content)))


def test_an_episode_is_one_call_scored_by_its_answer() -> None:
    q = Question("q1", "Which number is larger: 12 or 57?", ("12", "57"), "57")
    right, wrong, cut, failing = (
        _client('{"answer": "57"}'),
        _client('{"answer": "12"}'),
        _client('{"ans'),
        _client("raise"),
    )
    jobs = [(q, "r-1")]
    (good,) = asyncio.run(real_task.run_episodes(right, jobs, model="my-agent", temperature=0.0))
    assert (good.answer, good.reward, good.reported, good.rollout_id) == ("57", 1.0, True, "r-1")
    assert good.finish_reason == "stop"
    sent = right.chat.completions.requests[0]
    assert sent["extra_headers"] == {"X-ART-Rollout-Id": "r-1"} and sent["temperature"] == 0.0
    assert sent["model"] == "my-agent" and json.dumps(sent["response_format"])  # the schema goes as it is
    (bad,) = asyncio.run(real_task.run_episodes(wrong, jobs, model="my-agent"))
    assert (bad.answer, bad.reward) == ("12", 0.0)
    (short,) = asyncio.run(real_task.run_episodes(cut, jobs, model="my-agent"))
    assert (short.answer, short.reward, short.reported, short.finish_reason) == (None, 0.0, False, "length")
    (broken,) = asyncio.run(real_task.run_episodes(failing, jobs, model="my-agent"))
    assert broken.reward == 0.0 and broken.scenario_id == "q1" and "engine gone" in (broken.error or "")


def test_the_real_models_preset_is_under_what_was_given() -> None:
    real = DemoConfig.preset(model="smollm2")
    assert (real.steps, real.groups_per_step, real.learning_rate) == (10, 4, 2e-3)
    assert DemoConfig.preset(quick=True, model="smollm2", steps=2).steps == 2
    assert DemoConfig.preset(quick=True, model="smollm2").steps == 4
    assert DemoConfig.preset() == DemoConfig() and DemoConfig.quick().steps == 8  # the toy's are as they were


def test_intervals() -> None:
    low, high = wilson_interval(0.5, 48)
    assert low < 0.5 < high and high - low == pytest.approx(0.27, abs=0.01)
    assert wilson_interval(1.0, 16)[1] == 1.0 and wilson_interval(1.0, 16)[0] > 0.75
    assert mean_interval([0.5] * 10) == (0.5, 0.5)
    low, high = mean_interval([0.0, 1.0] * 24)
    assert low < 0.5 < high and high - low == pytest.approx(2 * 1.96 * 0.505 / 48**0.5, abs=0.01)


def test_the_outputs_name_the_real_task_and_show_intervals(tmp_path: Path) -> None:
    from rich.console import Console

    from artgw.demo import REAL_LABELS, DemoResult, EvalResult, StepResult, write_outputs

    def evaluation(step: int, reward: float, elapsed: float) -> EvalResult:
        return EvalResult(step, reward, reward, 1.0, 0, 30.0, (reward - 0.1, reward + 0.1), (0.2, 0.7), elapsed)

    result = DemoResult(
        config={},
        before=evaluation(0, 0.4, 100.0),
        after=evaluation(2, 0.6, 400.0),
        steps=[StepResult(s, s - 1, s, 0.5, 0.5, 1.0, 0, 10.0, 60.0, 0, 100.0 + 100 * s) for s in (1, 2)],
        examples=[{"question": "Which number is larger: 12 or 57?", "shown": "12 or 57", "correct": "57",
                   "answers": {"0": "12", "2": "57"}}],
    )  # fmt: skip
    result.evals = [result.before, result.after]  # type: ignore[list-item]
    write_outputs(result, tmp_path, Console(file=io.StringIO()), REAL_LABELS)
    table = (tmp_path / "table.txt").read_text()
    assert "answer correct (greedy, T=0)" in table and "tool argument" not in table
    assert "0.400 [0.30, 0.50]" in table and "0.600 [0.50, 0.70]" in table and "+0.200" in table
    assert "Which number is larger: 12 or 57?" in table and "12 or 57" in table
    assert (tmp_path / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "results.json").read_text())["after"]["reward_ci"] == [0.5, 0.7]


def test_the_demos_model_option_is_not_the_trainers_variable() -> None:
    from artgw import cli, options

    args = cli.build_parser().parse_args(["demo"])
    options.resolve(args, {"ARTGW_MODEL": "my-agent", "ARTGW_DEMO_MODEL": "smollm2"})  # the trainer's is ignored
    assert options.given(args, DemoConfig) == {"model": "smollm2"}
