"""Whose a rollout and a stored Response are (#40): the key's that made them, not its model's; and what a gateway
with `--auth off` lets a keyless caller (or a web page) do.

Two gateways in front of the stand-in engine (tests/stub_engine.py), each shared by the module: one with
`--auth required`, models `a` and `b`, a key of `a` that owns what it makes, another key of `a`, a key of every
model and a key of `b`; one with `--auth off` and `--allowed-host dev-box.test`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.conftest import GatewayProcess, start_stub, stop_group
from tests.key_helpers import CHAT_A, sent, serve

ROLLOUT = "X-ART-Rollout-Id"
SCOPES = ["infer", "reward", "read"]


@dataclass
class Tenants:
    gateway: GatewayProcess
    keys: dict[str, str]  # role -> secret: "owner" and "neighbour" (both `a`), "every" (every model), "other" (`b`)
    key_ids: dict[str, str]

    def ask(self, method: str, path: str, who: str, **kw: Any) -> httpx.Response:
        secret = self.gateway.admin_key if who == "admin" else self.keys[who]
        headers = {**sent(secret), **kw.pop("headers", {})}
        return httpx.request(method, self.gateway.url + path, headers=headers, timeout=30, **kw)

    def chat(self, who: str, rollout_id: str, content: str, model: str = "a") -> httpx.Response:
        body = {**CHAT_A, "model": model, "messages": [{"role": "user", "content": content}]}
        return self.ask("POST", "/v1/chat/completions", who, json=body, headers={ROLLOUT: rollout_id})


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    stub, stub_proc = start_stub()
    try:
        gateway = serve(tmp_path_factory.mktemp("owners"), stub, "--auth", "required")
        try:
            keys, key_ids = {}, {}
            for role, models in (("owner", ["a"]), ("neighbour", ["a"]), ("every", None), ("other", ["b"])):
                body = {"name": role, "models": models, "scopes": SCOPES}
                made = httpx.post(f"{gateway.url}/v1/art/keys", json=body, headers=gateway.admin, timeout=30)
                assert made.status_code == 201, made.text
                keys[role], key_ids[role] = made.json()["key"], made.json()["id"]
            yield Tenants(gateway, keys, key_ids)
        finally:
            gateway.stop()
    finally:
        stop_group(stub_proc)


# ---------------------------------------------------------------- a rollout is its key's


def test_another_key_of_the_model_cannot_add_to_a_keys_rollout(tenants: Tenants) -> None:
    """Before: any key of `a` (or of every model) that named the rollout's id had its call served into it (with
    the real engine, spliced into its one sequence). Now it is refused before the engine sees it, worded exactly
    as for another model's key (a tenant learns that the id is taken, never whose); the owner and the admin go
    on, and the rollout holds their calls only."""
    rollout_id = f"task-7-{uuid.uuid4().hex[:8]}"
    assert tenants.chat("owner", rollout_id, "owner's first").status_code == 200
    refusals = [tenants.chat(who, rollout_id, f"{who}'s injection") for who in ("neighbour", "every")]
    refusals.append(tenants.chat("other", rollout_id, "other's injection", model="b"))
    for refused in refusals:
        assert refused.status_code == 409, refused.text
        assert refused.headers[ROLLOUT] == rollout_id
    bodies = {r.text for r in refusals}
    assert len(bodies) == 1, bodies  # one answer whoever holds the id
    assert refusals[0].json()["error"]["code"] == "rollout_id_taken"
    assert tenants.chat("owner", rollout_id, "owner's second").status_code == 200
    assert tenants.chat("admin", rollout_id, "the admin's").status_code == 200

    recorded = tenants.ask("GET", f"/v1/art/rollouts/{rollout_id}", "admin")
    assert recorded.status_code == 200, recorded.text
    calls = recorded.json()["calls"]
    assert [c["key_id"] for c in calls] == [tenants.key_ids["owner"], tenants.key_ids["owner"], None]
    assert "injection" not in recorded.text


def test_a_rollout_the_admin_began_is_not_a_keys_to_join(tenants: Tenants) -> None:
    rollout_id = f"admin-{uuid.uuid4().hex[:8]}"
    assert tenants.chat("admin", rollout_id, "the admin's").status_code == 200
    refused = tenants.chat("owner", rollout_id, "owner's")
    assert (refused.status_code, refused.json()["error"]["code"]) == (409, "rollout_id_taken")


# ---------------------------------------------------------------- a stored Response is its key's


def test_a_stored_response_is_read_continued_and_deleted_by_its_key_only(tenants: Tenants) -> None:
    """Before: any key of `a` (or of every model) read, listed the input items of, continued and deleted a
    Response another key of `a` had stored. Now each of those is a 404, as for an id that does not exist; the
    key that made it and the admin still can."""
    made = tenants.ask("POST", "/v1/responses", "owner", json={"model": "a", "input": "my secret plan"})
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    path = f"/v1/responses/{response_id}"
    not_found = {
        "message": f"Response with id '{response_id}' not found.",
        "type": "not_found_error",
        "param": "response_id",
        "code": "response_not_found",
    }
    for who in ("neighbour", "every", "other"):
        for method, where in (("GET", path), ("GET", path + "/input_items"), ("DELETE", path)):
            r = tenants.ask(method, where, who)
            assert (r.status_code, r.json()) == (404, {"error": not_found}), (who, method, where, r.text)
        body = {"model": "a", "input": "and then?", "previous_response_id": response_id}
        continued = tenants.ask("POST", "/v1/responses", who, json=body)
        assert continued.status_code == 404, (who, continued.text)
        assert continued.json()["error"]["code"] in ("previous_response_not_found", "model_not_found")
    # Its own key, and the admin, still read and continue it.
    assert tenants.ask("GET", path, "owner").json()["id"] == response_id
    assert tenants.ask("GET", path, "admin").json()["id"] == response_id
    body = {"model": "a", "input": "and then?", "previous_response_id": response_id}
    assert tenants.ask("POST", "/v1/responses", "owner", json=body).status_code == 200
    assert tenants.ask("DELETE", path, "owner").status_code == 200


def test_a_message_thread_is_continued_by_its_key_only(tenants: Tenants) -> None:
    """Anthropic's message threads (`thread`, kept beside stored Responses): before, `thread` was ignored, so a
    `continue` got no history (and a runner's forced tool a 400 naming `tool_choice`). Now the key that made
    the thread and the admin continue it; any other key, an unknown id and a Response's id get Anthropic's
    `thread_not_found` (404), on which its SDKs send the whole history again; nor does the Responses API read a
    thread's message."""
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    first = {"model": "a", "max_tokens": 4, "system": "Be brief.", "tools": tools, "thread": {"type": "create"}}
    first["messages"] = [{"role": "user", "content": "my secret plan"}]
    made = tenants.ask("POST", "/v1/messages", "owner", json=first)
    assert made.status_code == 200, made.text
    message_id = made.json()["id"]
    response = tenants.ask("POST", "/v1/responses", "owner", json={"model": "a", "input": "hi"}).json()["id"]

    def continue_(who: str, previous: str, **fields: Any) -> httpx.Response:
        body = {"model": "a", "max_tokens": 4, "tool_choice": {"type": "any"}, **fields}
        body.update(
            messages=[{"role": "user", "content": "and then?"}],
            thread={"type": "continue", "previous_message_id": previous},
        )
        return tenants.ask("POST", "/v1/messages", who, json=body)

    for who, previous in [
        *((who, message_id) for who in ("neighbour", "every")),
        ("owner", "msg_nope"),
        ("owner", response),
    ]:
        refused = continue_(who, previous)
        assert (refused.status_code, refused.json()) == (
            404,
            {
                "type": "error",
                "error": {
                    "type": "not_found_error",
                    "message": f"thread.previous_message_id: no message thread holds a message with id '{previous}' "
                    'for this key. Send the whole conversation with `thread: {"type": "create"}` to start one.',
                    "details": {"error_code": "thread_not_found"},
                },
            },
        ), (who, previous)
    changed = continue_("owner", message_id, system="Be long.")
    assert changed.status_code == 400 and changed.json()["error"]["details"] == {
        "error_code": "thread_fingerprint_mismatch"
    }, changed.text
    assert changed.json()["error"]["message"].startswith("system: differs from the `system` this thread")
    assert tenants.ask("GET", f"/v1/responses/{message_id}", "owner").status_code == 404
    # Its own key and the admin continue it: the thread's tools are there for `tool_choice: any`.
    for who in ("owner", "admin"):
        assert continue_(who, message_id).status_code == 200, who


# ---------------------------------------------------------------- --auth off: inference, from this machine only


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    stub, stub_proc = start_stub()
    try:
        gateway = serve(tmp_path_factory.mktemp("keyless"), stub, "--auth", "off", "--allowed-host", "dev-box.test")
        try:
            yield gateway
        finally:
            gateway.stop()
    finally:
        stop_group(stub_proc)


def _rollout_recorded(gateway: GatewayProcess, rollout_id: str) -> int:
    return httpx.get(f"{gateway.url}/v1/art/rollouts/{rollout_id}", headers=gateway.admin, timeout=30).status_code


def test_keyless_callers_may_not_read_or_delete_stored_responses(keyless: GatewayProcess) -> None:
    """Before: with --auth off, any caller without a key (any page a browser loads) could GET, list the input
    items of and DELETE any stored Response. Now those take a key; a keyless caller still keeps and continues its
    own Responses (inference), but not one a key made."""
    url = keyless.url
    made = httpx.post(f"{url}/v1/responses", json={"model": "a", "input": "hi"}, timeout=30)
    assert made.status_code == 200, made.text
    path = f"{url}/v1/responses/{made.json()['id']}"
    refusal = {
        "message": "This endpoint needs an API key with the `infer` scope (or the admin key): without a key, "
        "--auth off lets in inference only.",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
    for method, where in (("GET", path), ("GET", path + "/input_items"), ("DELETE", path)):
        r = httpx.request(method, where, timeout=30)
        assert (r.status_code, r.json()) == (401, {"error": refusal}), (method, where, r.text)
    assert httpx.get(path, headers=keyless.admin, timeout=30).status_code == 200  # not deleted
    body = {"model": "a", "input": "more", "previous_response_id": made.json()["id"]}
    assert httpx.post(f"{url}/v1/responses", json=body, timeout=30).status_code == 200
    # A key's Response is not a keyless caller's to continue.
    key = httpx.post(f"{url}/v1/art/keys", json={"name": "k", "models": ["a"]}, headers=keyless.admin, timeout=30)
    keyed = httpx.post(f"{url}/v1/responses", json={"model": "a", "input": "hi"}, headers=sent(key.json()["key"]))
    body = {"model": "a", "input": "more", "previous_response_id": keyed.json()["id"]}
    r = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
    assert (r.status_code, r.json()["error"]["code"]) == (404, "previous_response_not_found")


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data", None],
)
def test_keyless_bodies_must_be_json(keyless: GatewayProcess, content_type: str | None) -> None:
    """Before: a page anywhere could POST a chat call cross-site as `text/plain` (no preflight) into a rollout it
    named, and it was served and recorded. Now a body that is not JSON is a 415 in OpenAI's error shape (Anthropic's
    under /v1/messages), before the engine or the recorder sees it."""
    rollout_id = f"csrf-{uuid.uuid4().hex[:8]}"
    headers = {ROLLOUT: rollout_id, "Origin": keyless.url}  # the gateway's own origin: only the body is wrong
    if content_type is not None:
        headers["Content-Type"] = content_type
    content = httpx.Request("POST", "http://x", json=CHAT_A).content
    r = httpx.post(f"{keyless.url}/v1/chat/completions", content=content, headers=headers, timeout=30)
    assert r.status_code == 415, r.text
    assert r.json() == {
        "error": {
            "message": f"The body must be JSON, sent as `Content-Type: application/json` (got {content_type!r}).",
            "type": "invalid_request_error",
            "param": "Content-Type",
            "code": "unsupported_media_type",
        }
    }
    message = {"model": "a", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    anthropic = httpx.post(
        f"{keyless.url}/v1/messages", content=httpx.Request("POST", "http://x", json=message).content, headers=headers
    )
    assert anthropic.status_code == 415 and anthropic.json()["type"] == "error", anthropic.text
    assert _rollout_recorded(keyless, rollout_id) == 404
    # JSON, with or without a charset, is served.
    for json_type in ("application/json", "application/json; charset=utf-8"):
        ok = httpx.post(
            f"{keyless.url}/v1/chat/completions", content=content, headers={"Content-Type": json_type}, timeout=30
        )
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("origin", ["https://evil.example", "http://127.0.0.1.evil.example:80", "null"])
def test_keyless_calls_from_another_origin_are_refused(keyless: GatewayProcess, origin: str) -> None:
    """A page elsewhere that gets a JSON call through (a browser that preflights and is not answered, or none at
    all) is refused by its Origin."""
    rollout_id = f"origin-{uuid.uuid4().hex[:8]}"
    r = httpx.post(
        f"{keyless.url}/v1/chat/completions", json=CHAT_A, headers={"Origin": origin, ROLLOUT: rollout_id}, timeout=30
    )
    assert (r.status_code, r.json()["error"]["code"]) == (403, "origin_not_allowed"), r.text
    assert _rollout_recorded(keyless, rollout_id) == 404


@pytest.mark.parametrize(
    ("host", "served"),
    [
        ("rebound.evil.example", False),  # DNS rebinding: the page's own name, now resolving to 127.0.0.1
        ("127.0.0.1.nip.io", False),
        ("localhost", True),
        ("127.0.0.1", True),
        ("[::1]", True),
        ("LOCALHOST.", True),
        ("dev-box.test", True),  # --allowed-host
    ],
)
def test_keyless_gateway_answers_only_its_own_host_names(keyless: GatewayProcess, host: str, served: bool) -> None:
    """Before: any Host was answered, so a page whose name was rebound to 127.0.0.1 had the gateway as its own
    origin: every keyless call, and every read the gateway allowed keyless. Now a Host that is not one of the
    gateway's names (--host, localhost, 127.0.0.1, [::1], each --allowed-host) is refused, whatever the path."""
    port = keyless.url.rpartition(":")[2]
    rollout_id = f"host-{uuid.uuid4().hex[:8]}"
    headers = {"Host": f"{host}:{port}", ROLLOUT: rollout_id}
    chat = httpx.post(f"{keyless.url}/v1/chat/completions", json=CHAT_A, headers=headers, timeout=30)
    models = httpx.get(f"{keyless.url}/v1/models", headers=headers, timeout=30)
    if served:
        assert (chat.status_code, models.status_code) == (200, 200), (chat.text, models.text)
        return
    for r in (chat, models):
        assert (r.status_code, r.json()["error"]["code"]) == (403, "host_not_allowed"), r.text
    assert "--allowed-host" in chat.json()["error"]["message"]
    assert _rollout_recorded(keyless, rollout_id) == 404


def test_a_gateway_with_keys_serves_any_host(tenants: Tenants) -> None:
    """With --auth required a key is what lets a call in: a load balancer's or a proxy's Host name is served."""
    port = tenants.gateway.url.rpartition(":")[2]
    headers = {"Host": f"gateway.example.com:{port}", ROLLOUT: f"lb-{uuid.uuid4().hex[:8]}"}
    r = tenants.ask("POST", "/v1/chat/completions", "owner", json=CHAT_A, headers=headers)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- /metrics names every tenant's models


def test_metrics_of_a_keyed_gateway_need_the_admin_key(tenants: Tenants) -> None:
    """Before: with --auth required and no --metrics-key, /metrics answered anyone, and its series name every
    model of every tenant. Now it asks for the admin key (a --metrics-key adds a scraper's own key: test_keys);
    a client key, even one of every model, is a key of calls, not of the gateway's telemetry."""
    assert tenants.chat("owner", f"m-{uuid.uuid4().hex[:8]}", "a call to count").status_code == 200
    keyless = httpx.get(f"{tenants.gateway.url}/metrics", timeout=30)
    assert keyless.status_code == 401, keyless.text[:200]
    assert keyless.json()["error"]["code"] == "invalid_api_key"
    assert 'model="a"' not in keyless.text
    for who in ("owner", "every"):
        assert tenants.ask("GET", "/metrics", who).status_code == 401
    scraped = tenants.ask("GET", "/metrics", "admin")
    assert scraped.status_code == 200 and 'model="a"' in scraped.text
