"""Where RULER may send (gateway/groups/policy.py, #40): the operator's judges by name with only sampling
parameters from a caller, webhooks only at or under an allowed endpoint, and the settings that name them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gateway.groups.policy import CALLER_PARAMS, OperatorJudge, Refused, RulerPolicy, load_judges
from gateway.settings import Settings
from store.api import RulerIn

HOUSE = OperatorJudge("hosted_vllm/judge", {"api_base": "http://127.0.0.1:9/v1", "api_key": "k", "temperature": 0.2})
POLICY = RulerPolicy({"house": HOUSE}, ("http://127.0.0.1:8080/hooks/reward", "https://127.0.0.1/r"))


def ruler_in(**spec: Any) -> RulerIn:
    return msgspec.convert(spec, RulerIn)


def test_a_group_picks_the_operators_judge_and_may_set_only_sampling_parameters() -> None:
    (judge,) = POLICY.panel(ruler_in(judge_model="house", litellm_params={"temperature": 0.9, "max_tokens": 50}))
    assert judge.judge_model == "hosted_vllm/judge"  # litellm's name, and the operator's endpoint and key
    # Precedence: the caller's sampling choice, then the operator's parameters.
    assert judge.litellm_params == {"api_base": "http://127.0.0.1:9/v1", "api_key": "k", "temperature": 0.9,
                                    "max_tokens": 50}  # fmt: skip
    assert CALLER_PARAMS == {"temperature", "top_p", "max_tokens", "max_completion_tokens", "seed"}


@pytest.mark.parametrize(
    ("spec", "field", "code"),
    [
        ({"judge_model": "openai/gpt-4o-mini"}, "judge_model", "unknown_judge"),
        ({"judge_model": "house", "litellm_params": {"api_base": "http://127.0.0.1:1"}}, "litellm_params.api_base",
         "judge_param_not_allowed"),
        ({"judge_model": "house", "litellm_params": {"custom_llm_provider": "openai"}},
         "litellm_params.custom_llm_provider", "judge_param_not_allowed"),
        ({"judges": [{"judge_model": "house"}, {"judge_model": "house", "litellm_params": {"headers": {}}}]},
         "judges[1].litellm_params.headers", "judge_param_not_allowed"),
        ({"judges": [{"judge_model": "elsewhere"}]}, "judges[0].judge_model", "unknown_judge"),
        ({"judge_model": "house", "litellm_params": {"temperature": {"api_base": "x"}}},
         "litellm_params.temperature", "invalid_value"),
        ({"judge_model": "house", "litellm_params": {"max_tokens": 1.5}}, "litellm_params.max_tokens",
         "invalid_value"),
    ],
)  # fmt: skip
def test_anything_else_is_refused_naming_where(spec: dict[str, Any], field: str, code: str) -> None:
    with pytest.raises(Refused) as refused:
        POLICY.panel(ruler_in(**spec))
    assert (refused.value.field, refused.value.code) == (field, code)
    assert "127.0.0.1:9" not in refused.value.message  # what stands behind a name is never told


def test_without_a_judges_file_every_judge_is_refused() -> None:
    with pytest.raises(Refused, match=r"judges \(none\); its operator lists them in --judges-file"):
        RulerPolicy({}, ()).panel(ruler_in(judge_model="openai/gpt-4o-mini"))


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://127.0.0.1:8080/hooks/reward", True),
        ("http://127.0.0.1:8080/hooks/reward/", True),
        ("http://127.0.0.1:8080/hooks/reward/task-7?k=1", True),
        ("HTTP://127.0.0.1:8080/hooks/reward", True),
        ("https://127.0.0.1:443/r", True),  # the scheme's own port, written or not
        ("https://127.0.0.1/r/x", True),
        ("http://127.0.0.1:8080/hooks/rewards", False),  # whole segments
        ("http://127.0.0.1:8080/hooks", False),
        ("http://127.0.0.1:8080/hooks/reward/../../admin", False),
        ("http://127.0.0.1:8080/hooks/reward/%2e%2e/admin", False),
        ("http://127.0.0.1:8081/hooks/reward", False),
        ("https://127.0.0.1:8080/hooks/reward", False),
        ("http://127.0.0.1/r", False),
        ("http://127.0.0.1:8080@127.0.0.2:8080/hooks/reward", False),  # the host it goes to is after the `@`
        ("http://127.0.0.2:8080/hooks/reward", False),
        ("ftp://127.0.0.1:8080/hooks/reward", False),
        ("not a url", False),
    ],
)
def test_a_webhook_posts_only_at_or_under_an_allowed_endpoint(url: str, allowed: bool) -> None:
    assert POLICY.allows_webhook(url) is allowed
    assert RulerPolicy({}, ()).allows_webhook(url) is False  # none allowed: deny by default


def test_the_judges_file_is_checked_when_the_settings_are_made(tmp_path: Path) -> None:
    judges = tmp_path / "judges.json"
    judges.write_text(json.dumps({"house": {"model": "hosted_vllm/judge", "litellm_params": {"api_base": "x"}}}))
    assert Settings(upstream=("http://127.0.0.1:1",), judges_file=judges).judges_file == judges
    assert load_judges(judges) == {"house": OperatorJudge("hosted_vllm/judge", {"api_base": "x"})}
    for content, problem in [
        ("{", "truncated"),
        (json.dumps({"house": {"model": "openai/x", "key": "k"}}), "unknown field `key`"),
        (json.dumps({"house": {"model": "no-such-provider-xyz"}}), "judge 'house': unknown judge model"),
        (json.dumps({"house": {"model": "openai/x", "litellm_params": {"stream": True}}}), "sets stream"),
        (json.dumps({" house": {"model": "openai/x"}}), "judge name ' house'"),
    ]:
        judges.write_text(content)
        with pytest.raises(ValueError, match=f"--judges-file {re.escape(str(judges))}: .*{problem}"):
            Settings(upstream=("http://127.0.0.1:1",), judges_file=judges)
    with pytest.raises(ValueError, match=r"--judges-file .*nothere\.json"):
        Settings(upstream=("http://127.0.0.1:1",), judges_file=tmp_path / "nothere.json")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("127.0.0.1:8080/hook", "http:// or https://"),
        ("http://127.0.0.1:8080/hook?token=1", "a query"),
        ("http://me:pw@127.0.0.1:8080/hook", "user info"),
        ("http://127.0.0.1:8080/a/%2e%2e/hook", "without `.` or `..`"),
    ],
)
def test_a_group_webhook_setting_is_an_endpoint(url: str, problem: str) -> None:
    assert Settings(upstream=("http://127.0.0.1:1",), group_webhooks=("http://127.0.0.1:8080/hook",)).group_webhooks
    with pytest.raises(ValueError, match=f"--group-webhook '{re.escape(url)}'.*{re.escape(problem)}"):
        Settings(upstream=("http://127.0.0.1:1",), group_webhooks=(url,))
