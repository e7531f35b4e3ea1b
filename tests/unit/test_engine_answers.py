"""The engine's answers read as typed structs (engine/answers.py): vLLM's fields the gateway does not read are
skipped, a field vLLM may leave out is optional, and an answer that is not what vLLM sends is an error naming
where it is wrong, whether read from its body or from the body decoded for forwarding."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.answers import Answer, EngineAnswerError, ErrorBody, ModelList, TokenizeAnswer, read
from gateway.proxy import choice_record, sampled_logprobs, upstream_error
from tests.stub_engine import COMPLETION


def _both(answer: dict[str, Any]) -> list[bytes | dict[str, Any]]:
    return [json.dumps(answer).encode(), answer]


@pytest.mark.parametrize("given", _both({**COMPLETION, "kv_transfer_params": {"x": 1}, "service_tier": None}))
def test_a_chat_answer_is_read_and_fields_unknown_to_the_gateway_skipped(given: bytes | dict[str, Any]) -> None:
    answer = read(given, Answer)
    assert answer.prompt_token_ids == [1, 2, 3]
    assert answer.usage == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    (choice,) = answer.choices
    record = choice_record(choice)
    assert (record.index, record.message, record.finish_reason) == (0, {"role": "assistant", "content": "ok"}, "stop")
    assert (record.token_ids, record.logprobs) == ([7], [-0.5])


def test_a_completions_choice_takes_only_the_sampled_tokens_logprobs() -> None:
    """With `echo` the prompt's logprobs come first, the very first null."""
    choice = {"index": 0, "text": "ab", "token_ids": [5, 6], "logprobs": {"token_logprobs": [None, -1.0, -2.0, -3.0]}}
    (read_choice,) = read({"choices": [choice]}, Answer).choices
    assert sampled_logprobs(read_choice) == [-2.0, -3.0]
    assert choice_record(read_choice).message == {"role": "assistant", "content": "ab"}
    unsampled = {**choice, "logprobs": {"token_logprobs": [-1.0, None]}}
    with pytest.raises(EngineAnswerError, match="without its logprob"):
        sampled_logprobs(read({"choices": [unsampled]}, Answer).choices[0])


@pytest.mark.parametrize(
    ("choice", "where"),
    [
        ({"token_ids": ["7"]}, "Expected `int`, got `str` - at `$.choices[0].token_ids[0]`"),
        ({"logprobs": {"content": [{"token": "o"}]}}, "missing required field `logprob` - at `$.choices[0].logprobs"),
        ({"logprobs": {"content": [{"logprob": "-0.5"}]}}, "Expected `float`, got `str` - at `$.choices[0].logprobs"),
        ({"delta": {"tool_calls": [{"index": "0"}]}}, "Expected `int`, got `str` - at `$.choices[0].delta.tool_calls"),
        ({"message": "ok"}, "Expected `object | null`, got `str` - at `$.choices[0].message`"),
    ],
)
def test_an_answer_vllm_never_sends_is_an_error_naming_where(choice: dict[str, Any], where: str) -> None:
    for given in _both({"choices": [{"index": 0, **choice}]}):
        with pytest.raises(EngineAnswerError) as raised:
            read(given, Answer)
        assert where in raised.value.reason


def test_a_body_that_is_not_json_is_an_error() -> None:
    with pytest.raises(EngineAnswerError, match="JSON is malformed"):
        read(b"{not json", Answer)


def test_the_model_list_needs_each_entry_id() -> None:
    models = read(b'{"object": "list", "data": [{"id": "m", "root": "/p", "max_model_len": 9}]}', ModelList)
    assert [(card.id, card.root, card.parent) for card in models.data] == [("m", "/p", None)]
    with pytest.raises(EngineAnswerError, match=r"missing required field `id` - at `\$.data\[0\]`"):
        read(b'{"data": [{"root": "m"}]}', ModelList)


def test_the_tokenize_count_is_an_int() -> None:
    assert read(b'{"count": 7, "max_model_len": 2048, "tokens": [1, 2]}', TokenizeAnswer).count == 7
    with pytest.raises(EngineAnswerError, match=r"Expected `int`, got `str` - at `\$.count`"):
        read(b'{"count": "7"}', TokenizeAnswer)


def test_the_engines_error_body_is_reshaped_and_an_unreadable_one_named_by_its_status() -> None:
    body = b'{"error": {"message": "bad n", "type": "BadRequestError", "param": "n", "code": 400}}'
    assert read(body, ErrorBody).error.code == 400
    error = upstream_error(400, body)
    assert (error.status, error.message, error.param) == (400, "bad n", "n")
    assert upstream_error(503, b'{"detail": "x"}').message == "Upstream engine error: The engine answered 503."
