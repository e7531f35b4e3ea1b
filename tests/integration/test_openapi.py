"""The OpenAPI document is valid and true: schemathesis generates requests from it (valid and invalid ones, a
bounded number per operation) against a live gateway in front of the stand-in engine, and every answer is
not a 5xx, has a documented status and content type, and matches the documented schema.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import GatewayProcess, start_gateway, start_stub, stop_group

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MAX_EXAMPLES = 20  # per operation and generation mode: keeps the whole module well under a minute
CHAT_BODY = {"model": "my-agent", "messages": [{"role": "user", "content": "hi"}]}
GROUP_BODY = {"model": "my-agent", "group_id": "openapi-real-group"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    url, stub = start_stub()
    gw = start_gateway(tmp_path_factory.mktemp("openapi"), "--upstream", url)
    yield gw
    gw.stop()
    stop_group(stub)


@pytest.fixture(scope="module")
def api_schema(gateway: GatewayProcess) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{gateway.url}/schema/openapi.json")


def test_the_document_is_served_and_valid_openapi(gateway: GatewayProcess) -> None:
    from jsonschema import Draft202012Validator

    doc = httpx.get(f"{gateway.url}/schema/openapi.json", timeout=30).json()
    assert doc["openapi"].startswith("3.1")
    # Every JSON body the gateway reads is described, and every error is OpenAI's shape.
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["required"] == ["model", "messages"]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    with_body = [doc["paths"][path]["post"] for path in ("/v1/art/groups", "/v1/art/models/{name}/adapters")]
    for operation in with_body:
        assert operation["requestBody"]["required"] is True
    for path, item in doc["paths"].items():
        # Anthropic's Messages API answers errors in Anthropic's shape, every other route in OpenAI's.
        shape = "AnthropicError" if path.endswith(("/v1/messages", "/v1/messages/count_tokens")) else "OpenAIError"
        error_ref = {"$ref": f"#/components/schemas/{shape}"}
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                if int(status) >= 400 and path != "/readyz":
                    assert response["content"]["application/json"]["schema"] == error_ref, (method, path, status)
    detail = doc["components"]["schemas"]["OpenAIErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}
    # Each schema in it is a valid JSON Schema (schemathesis's own loading checks the rest of the document).
    inference = [doc["paths"][path]["post"] for path in ("/v1/completions", "/v1/responses", "/v1/messages")]
    for operation in inference:
        assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    bodies = [op["requestBody"]["content"]["application/json"]["schema"] for op in (chat, *with_body, *inference)]
    for schema in [*doc["components"]["schemas"].values(), *bodies]:
        Draft202012Validator.check_schema(schema)


# Every operation of the document (test_every_operation_is_fuzzed keeps this list whole).
OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/rollouts/{rollout_id}/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/rollouts/{rollout_id}/v1/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/rollouts/{rollout_id}/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("GET", "/rollouts/{rollout_id}/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("DELETE", "/rollouts/{rollout_id}/v1/responses/{response_id}"),
    ("GET", "/v1/responses/{response_id}/input_items"),
    ("GET", "/rollouts/{rollout_id}/v1/responses/{response_id}/input_items"),
    ("POST", "/v1/messages"),
    ("POST", "/rollouts/{rollout_id}/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/rollouts/{rollout_id}/v1/messages/count_tokens"),
    ("GET", "/v1/models"),
    ("GET", "/rollouts/{rollout_id}/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/rollouts/{rollout_id}/v1/models/{model_id}"),
    ("GET", "/metrics"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/v1/art/rollouts"),
    ("GET", "/v1/art/rollouts/{rollout_id}"),
    ("GET", "/v1/art/rollouts/{rollout_id}/{choice}"),
    ("POST", "/v1/art/groups"),
    ("POST", "/v1/art/rewards"),
    ("GET", "/v1/art/models/{name}/judge-report"),
    ("GET", "/v1/art/models/{name}/evals"),
    ("POST", "/v1/art/models/{name}/evals"),
    ("DELETE", "/v1/art/models/{name}/evals/{eval_set}"),
    ("POST", "/v1/art/models/{name}/promote"),
    ("POST", "/v1/art/models/{name}/rollback"),
    ("GET", "/v1/art/groups"),
    ("GET", "/v1/art/groups/{group_id}"),
    ("POST", "/v1/art/models/{name}/adapters"),
    ("GET", "/v1/art/models/{name}"),
    ("GET", "/v1/art/models"),
    ("POST", "/v1/art/models"),
    ("DELETE", "/v1/art/models/{name}"),
    ("POST", "/v1/art/keys"),
    ("GET", "/v1/art/keys"),
    ("DELETE", "/v1/art/keys/{key_id}"),
]


def test_every_operation_is_fuzzed(api_schema: schemathesis.BaseSchema) -> None:
    documented = {(op.method.upper(), op.path) for op in (result.ok() for result in api_schema.get_all_operations())}
    assert documented == set(OPERATIONS)


# Operations with something to get wrong (a body, a typed or bounded parameter) are fuzzed with invalid
# requests too; for the others schemathesis can't make one (hypothesis reports that as Unsatisfiable).
HAS_INVALID = {
    ("POST", "/v1/chat/completions"),
    ("POST", "/rollouts/{rollout_id}/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/rollouts/{rollout_id}/v1/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/rollouts/{rollout_id}/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/rollouts/{rollout_id}/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/rollouts/{rollout_id}/v1/messages/count_tokens"),
    ("GET", "/v1/responses/{response_id}/input_items"),
    ("GET", "/rollouts/{rollout_id}/v1/responses/{response_id}/input_items"),
    ("GET", "/v1/art/rollouts"),
    ("GET", "/v1/art/rollouts/{rollout_id}/{choice}"),
    ("POST", "/v1/art/groups"),
    ("POST", "/v1/art/rewards"),
    ("POST", "/v1/art/models/{name}/evals"),
    ("POST", "/v1/art/models/{name}/promote"),
    ("POST", "/v1/art/models/{name}/rollback"),
    ("GET", "/v1/art/groups"),
    ("POST", "/v1/art/models/{name}/adapters"),
    ("POST", "/v1/art/models"),
    ("POST", "/v1/art/keys"),
    ("GET", "/v1/art/keys"),
}
CASES = [
    pytest.param(method, path, mode, id=f"{method} {path} {mode}")
    for method, path in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode == GenerationMode.POSITIVE or (method, path) in HAS_INVALID
]


# schemathesis's own pytest integration (`from_fixture(...).parametrize()`) fails on pytest 9.2 (it sets
# `node._nodeid`), so each operation is a plain parametrized test running hypothesis on its strategy.
@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_the_gateway_answers_as_documented(
    api_schema: schemathesis.BaseSchema, gateway: GatewayProcess, method: str, path: str, mode: GenerationMode
) -> None:
    @given(case=api_schema[path][method].as_strategy(mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def answers_as_documented(case: schemathesis.Case) -> None:
        # With the admin key: it has every scope, so each operation is fuzzed past its guard.
        case.call_and_validate(base_url=gateway.url, checks=CHECKS, timeout=30, headers=gateway.admin)

    answers_as_documented()


def test_real_objects_match_their_documented_schemas(
    api_schema: schemathesis.BaseSchema, gateway: GatewayProcess
) -> None:
    """Fuzzed ids rarely name anything, so the 2xx schemas of the /v1/art objects are checked here on real
    ones: a recorded rollout, a group made of it (created, then the same request again), the model."""
    rollouts = ["openapi-real-a", "openapi-real-b"]
    group = {**GROUP_BODY, "rollouts": [{"rollout_id": r, "reward": float(i)} for i, r in enumerate(rollouts)]}
    calls = [
        *(("POST", "/rollouts/{rollout_id}/v1/chat/completions", {"rollout_id": r}, None, CHAT_BODY) for r in rollouts),
        ("GET", "/v1/art/rollouts/{rollout_id}", {"rollout_id": rollouts[0]}, None, None),
        ("GET", "/v1/art/rollouts", None, {"model": "my-agent"}, None),
        ("POST", "/v1/art/groups", None, None, group),
        ("POST", "/v1/art/groups", None, None, group),  # the same request again: that group, 200
        ("GET", "/v1/art/groups/{group_id}", {"group_id": GROUP_BODY["group_id"]}, None, None),
        ("GET", "/v1/art/groups", None, {"model": "my-agent"}, None),
        ("GET", "/v1/art/models/{name}", {"name": "my-agent"}, None, None),
        ("GET", "/v1/models", None, None, None),
        ("POST", "/v1/art/models", None, None, {"name": "openapi-model"}),
        ("GET", "/v1/art/models", None, None, None),
        ("DELETE", "/v1/art/models/{name}", {"name": "openapi-model"}, None, None),
        ("POST", "/v1/art/keys", None, None, {"name": "openapi", "models": ["my-agent"], "scopes": ["read"]}),
        ("GET", "/v1/art/keys", None, None, None),
    ]
    statuses = []
    for method, path, path_parameters, query, body in calls:
        case = api_schema[path][method].Case(
            path_parameters=path_parameters, query=query, **({} if body is None else {"body": body})
        )
        answer = case.call_and_validate(base_url=gateway.url, checks=CHECKS, timeout=30, headers=gateway.admin)
        statuses.append(answer.status_code)
    assert statuses == [200, 200, 200, 200, 201, 200, 200, 200, 200, 200, 201, 200, 200, 201, 200]
