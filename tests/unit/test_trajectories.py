"""Trajectory assembly on hand-built calls: merges, splits and their reasons, retries, n > 1, masks."""

from __future__ import annotations

from store.trajectories import (
    SPLIT_DROPPED_REASONING,
    SPLIT_EDITED,
    SPLIT_RERENDERED,
    assemble,
    sampled_under_grammar,
)
from tests.conftest import make_call

SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "weather in Paris?"}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_CALL_REPLY = {"role": "assistant", "content": "", "tool_calls": [CALL]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_three_turn_tool_rollout_that_extends_its_prefix_is_one_sequence() -> None:
    c1 = make_call("a", 1, [SYSTEM, USER], [1, 2, 3], (TOOL_CALL_REPLY, [10, 11, 12]))
    c2 = make_call(
        "b",
        2,
        [SYSTEM, USER, TOOL_CALL_REPLY, TOOL_RESULT],
        [1, 2, 3, 10, 11, 12, 4, 5],
        ({"role": "assistant", "content": "sunny"}, [13, 14]),
        step=1,
    )
    trajectory = assemble("r", [c2, c1])  # order of arrival does not matter
    (seq,) = trajectory.sequences
    assert seq.token_ids == [1, 2, 3, 10, 11, 12, 4, 5, 13, 14]
    assert seq.sampled_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert seq.logprobs == [None, None, None, -0.5, -0.6, -0.7, None, None, -0.5, -0.6]
    assert seq.call_ids == ["a", "b"]
    assert seq.steps == [0, 1]
    assert seq.split_reason is None
    assert seq.sampled_spans == [(3, 6), (8, 10)]  # each call's sampled tokens, in call order
    assert (trajectory.trainable_tokens, trajectory.context_tokens) == (5, 5)
    assert trajectory.messages[-1] == {"role": "assistant", "content": "sunny"}
    assert trajectory.messages[:4] == [SYSTEM, USER, TOOL_CALL_REPLY, TOOL_RESULT]


def test_rerendered_template_splits_with_reason() -> None:
    c1 = make_call("a", 1, [USER], [1, 2], (TOOL_CALL_REPLY, [10, 11]))
    # Same messages, but the template rendered the earlier tool call with other tokens (20, 21).
    c2 = make_call(
        "b", 2, [USER, TOOL_CALL_REPLY, TOOL_RESULT], [1, 2, 20, 21, 4], ({"role": "assistant", "content": "x"}, [9])
    )
    first, second = assemble("r", [c1, c2]).sequences
    assert first.token_ids == [1, 2, 10, 11] and first.sampled_mask == [0, 0, 1, 1]
    assert second.token_ids == [1, 2, 20, 21, 4, 9] and second.sampled_mask == [0, 0, 0, 0, 0, 1]
    assert second.split_reason == SPLIT_RERENDERED


def test_edited_history_and_dropped_reasoning_are_told_apart() -> None:
    thinking = {"role": "assistant", "content": "sunny", "reasoning": "it is Paris"}
    c1 = make_call("a", 1, [USER], [1, 2], (thinking, [10, 11]))
    dropped = make_call(
        "b",
        2,
        [USER, {"role": "assistant", "content": "sunny"}, USER],
        [1, 2, 11, 3],
        ({"role": "assistant", "content": "y"}, [8]),
    )
    edited = make_call(
        "c", 3, [{"role": "user", "content": "other"}], [7, 7], ({"role": "assistant", "content": "z"}, [6])
    )
    sequences = assemble("r", [c1, dropped, edited]).sequences
    assert [s.split_reason for s in sequences] == [None, SPLIT_DROPPED_REASONING, SPLIT_EDITED]


def test_identical_retry_is_kept_marked_and_only_the_last_attempt_trains() -> None:
    first = make_call("a", 1, [USER], [1, 2], ({"role": "assistant", "content": "p"}, [5]))
    retry = make_call("b", 2, [USER], [1, 2], ({"role": "assistant", "content": "q"}, [6]))
    trajectory = assemble("r", [first, retry])
    by_id = {c.id: c for c in trajectory.calls}
    assert by_id["a"].superseded and by_id["a"].retry_of is None
    assert by_id["b"].retry_of == "a" and not by_id["b"].superseded
    (seq,) = trajectory.sequences
    assert seq.token_ids == [1, 2, 6] and seq.call_ids == ["b"]


def test_failed_calls_are_listed_but_not_trained() -> None:
    ok = make_call("a", 1, [USER], [1, 2], ({"role": "assistant", "content": "p"}, [5]))
    failed = make_call("b", 2, [USER, {"role": "assistant", "content": "p"}, USER], [], status="upstream_error")
    trajectory = assemble("r", [ok, failed])
    assert [c.status for c in trajectory.calls] == ["ok", "upstream_error"]
    assert [s.call_ids for s in trajectory.sequences] == [["a"]]


def test_n_greater_than_one_follows_the_choice_the_next_call_continued() -> None:
    c1 = make_call(
        "a",
        1,
        [USER],
        [1, 2],
        ({"role": "assistant", "content": "p"}, [5]),
        ({"role": "assistant", "content": "q"}, [6]),
    )
    c2 = make_call(
        "b",
        2,
        [USER, {"role": "assistant", "content": "q"}, USER],
        [1, 2, 6, 3],
        ({"role": "assistant", "content": "r"}, [7]),
    )
    trajectory = assemble("r", [c1, c2])
    (seq,) = trajectory.sequences
    assert seq.token_ids == [1, 2, 6, 3, 7]
    assert {c.id: c.choice for c in trajectory.calls} == {"a": 1, "b": 0}


def test_empty_rollout_of_only_failures() -> None:
    trajectory = assemble("r", [make_call("a", 1, [USER], [], status="cancelled")])
    assert trajectory.sequences == [] and trajectory.messages == [] and trajectory.trainable_tokens == 0


def test_calls_sampled_under_a_grammar_are_flagged() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert sampled_under_grammar({"tools": tools, "tool_choice": named})
    assert sampled_under_grammar({"tools": tools, "tool_choice": "required"})
    assert sampled_under_grammar({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert sampled_under_grammar({"response_format": {"type": "json_object"}})
    assert sampled_under_grammar({"structured_outputs": {"choice": ["yes", "no"]}})
    assert sampled_under_grammar({"response_format": {"type": "structural_tag", "format": {}}})
    # `auto` with a strict tool, or one call at most: vLLM constrains what follows `<tool_call>`.
    strict = [{"type": "function", "function": {"name": "get_weather", "parameters": {}, "strict": True}}]
    assert sampled_under_grammar({"tools": strict, "tool_choice": "auto"})
    assert sampled_under_grammar({"tools": strict})
    assert sampled_under_grammar({"tools": tools, "parallel_tool_calls": False})
    # Free sampling: the model's own distribution, whatever tools it was offered.
    assert not sampled_under_grammar({"guided_regex": "[0-9]+"})  # removed in vLLM 0.32: ignored
    assert not sampled_under_grammar({"tools": strict, "tool_choice": "none"})
    assert not sampled_under_grammar({"tools": tools, "tool_choice": "auto"})
    assert not sampled_under_grammar({"tools": tools})
    assert not sampled_under_grammar({"tool_choice": "none"})
    assert not sampled_under_grammar({"response_format": {"type": "text"}})
    assert not sampled_under_grammar({"logit_bias": {"5": 100}})

    c1 = make_call("a", 1, [USER], [1, 2], (TOOL_CALL_REPLY, [10, 11]), extra={"tools": tools, "tool_choice": named})
    c2 = make_call("b", 2, [USER, TOOL_CALL_REPLY, TOOL_RESULT], [1, 2, 10, 11, 4], ({"role": "assistant"}, [13]))
    trajectory = assemble("r", [c1, c2])
    assert [(c.id, c.constrained) for c in trajectory.calls] == [("a", True), ("b", False)]
    (seq,) = trajectory.sequences
    assert seq.sampled_spans == [(2, 4), (5, 6)]
