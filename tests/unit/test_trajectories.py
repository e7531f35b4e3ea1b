"""Trajectory assembly on hand-built calls: merges, splits and their reasons, retries, n > 1, masks."""

from __future__ import annotations

from typing import Any

import pytest

from store.trajectories import (
    SPLIT_CAUSES,
    SPLIT_DROPPED_REASONING,
    SPLIT_NEW_ATTEMPT,
    SPLIT_RERENDERED,
    SPLIT_SERVED_AS_SENT,
    SPLIT_STATE_LOST,
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
    assert [s.split_cause for s in sequences] == [None, "dropped_reasoning", "edited"]
    assert [s.split_reason for s in sequences] == [
        None,
        SPLIT_DROPPED_REASONING,
        "the client edited message 0 (user) of the history",
    ]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
SAMPLED = {"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {**CALL["function"]}}]}
SAMPLED["tool_calls"][0]["function"]["arguments"] = '{"city":"Paris"}'  # as the model wrote it


def split_of(first: dict[str, Any], second: dict[str, Any], *choices: tuple[Any, ...]) -> tuple[str, str]:
    """The cause and reason of the split between two calls whose tokens do not extend (prompt [9] after [1, 2])."""
    c1 = make_call("a", 1, first["messages"], [1, 2], *(choices or ((TOOL_CALL_REPLY, [10]),)), **first["fields"])
    c2 = make_call("b", 2, second["messages"], [9], ({"role": "assistant", "content": "x"}, [5]), **second["fields"])
    _, sequence = assemble("r", [c1, c2]).sequences
    assert sequence.split_cause is not None and sequence.split_reason is not None
    return sequence.split_cause, sequence.split_reason


def call_of(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"messages": messages, "fields": fields}


# One case per cause: the previous call, the next one, the cause and the reason given.
SPLITS = {
    "rerendered": (
        # The tool call sent back as the client's SDK re-serialized it (`{"city": "Paris"}`, content "", an id):
        # it means what the model produced, yet the template rendered other tokens.
        call_of([SYSTEM, USER]),
        call_of([SYSTEM, USER, TOOL_CALL_REPLY, TOOL_RESULT]),
        SPLIT_RERENDERED,
    ),
    "state_lost": (
        # The same, served by a gateway that had lost the rollout's last call (a restart): it could not splice.
        call_of([SYSTEM, USER]),
        call_of([SYSTEM, USER, TOOL_CALL_REPLY, TOOL_RESULT], rollout_known=False),
        SPLIT_STATE_LOST,
    ),
    # The same history, served as sent where the gateway could not splice it: the split names the cause the
    # gateway counted (artgw_continued_calls_total{how}); before, each said `rerendered`.
    **{
        how: (
            call_of([SYSTEM, USER]),
            call_of([SYSTEM, USER, TOOL_CALL_REPLY, TOOL_RESULT], continued=how),
            SPLIT_SERVED_AS_SENT[how][1],
        )
        for how in ("template_mismatch", "render_failed", "no_scale_out")
    },
    "dropped_reasoning": (
        call_of([USER]),
        call_of([USER, {"role": "assistant", "content": "sunny"}, USER]),
        SPLIT_DROPPED_REASONING,
    ),
    "edited": (
        call_of([SYSTEM, USER, TOOL_CALL_REPLY, TOOL_RESULT]),
        call_of([SYSTEM, USER, TOOL_CALL_REPLY, {**TOOL_RESULT, "content": "rainy"}]),
        "the client edited message 3 (tool) of the history",
    ),
    "history_cut": (
        call_of([SYSTEM, USER, TOOL_CALL_REPLY, TOOL_RESULT]),
        call_of([SYSTEM, USER]),
        "the client sent 2 of the history's 4 messages",
    ),
    "system_changed": (
        call_of([SYSTEM, USER]),
        call_of([{"role": "system", "content": "be verbose"}, USER, TOOL_CALL_REPLY, TOOL_RESULT]),
        "another system prompt than the previous call's",
    ),
    "tools_changed": (
        call_of([USER], extra={"tools": [TOOL]}),
        call_of([USER, TOOL_CALL_REPLY, TOOL_RESULT], extra={"tools": []}),
        "other tools than the previous call's",
    ),
    "new_attempt": (call_of([SYSTEM, USER]), call_of([SYSTEM, USER], extra={"temperature": 0.5}), SPLIT_NEW_ATTEMPT),
    "model_changed": (
        call_of([USER]),
        call_of([USER, TOOL_CALL_REPLY, TOOL_RESULT], model=None),
        "another model: the base model, after my-agent",
    ),
}


@pytest.mark.parametrize("cause", list(SPLITS))
def test_each_split_names_its_cause(cause: str) -> None:
    first, second, reason = SPLITS[cause]
    thinking = {"role": "assistant", "content": "sunny", "reasoning": "it is Paris"}
    choices = ((thinking, [10]),) if cause == "dropped_reasoning" else ((SAMPLED, [10]),)
    assert split_of(first, second, *choices) == (cause, reason)


def test_every_cause_has_a_case() -> None:
    assert set(SPLITS) | {"other_choice"} == set(SPLIT_CAUSES)


def test_a_choice_other_than_the_rollouts_is_named() -> None:
    """`rollout/1` of an n = 2 call follows choice 1; a next call that went on from choice 0 is a split that says
    so. Without a choice asked for, the next call's reply (by meaning, the tokens not extending) picks it."""
    p, q = {"role": "assistant", "content": "p"}, {"role": "assistant", "content": "q"}
    c1 = make_call("a", 1, [USER], [1, 2], (p, [5]), (q, [6]))
    c2 = make_call("b", 2, [USER, p, USER], [9], ({"role": "assistant", "content": "r"}, [7]))
    _, second = assemble("r", [c1, c2], choice=1).sequences
    assert (second.split_cause, second.split_reason) == (
        "other_choice",
        "the history goes on from choice 0, not choice 1",
    )
    trajectory = assemble("r", [c1, c2])
    assert {c.id: c.choice for c in trajectory.calls} == {"a": 0, "b": 0}
    assert trajectory.sequences[1].split_cause == "rerendered"


def test_a_completions_prompt_that_goes_on_in_text_is_rerendered() -> None:
    first = make_call(
        "a", 1, None, [1, 2], ({"role": "assistant", "content": " world"}, [5]), request={"prompt": "hello"}
    )
    again = make_call("b", 2, None, [9], request={"prompt": "hello world, and"})
    other = make_call("c", 3, None, [8], request={"prompt": "bye"})
    causes = [s.split_cause for s in assemble("r", [first, again, other]).sequences]
    assert causes == [None, "rerendered", "edited"]


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
