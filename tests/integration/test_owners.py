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
from pathlib import Path
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


# ---------------------------------------------------------------- a rollout id is its key's

CALLERS = ("owner", "neighbour", "every", "other", "admin")


def _model(who: str) -> str:
    return "b" if who == "other" else "a"


def _key_id(tenants: Tenants, who: str) -> str | None:
    return None if who == "admin" else tenants.key_ids[who]


def _rollouts_listed(tenants: Tenants, who: str, rollout_id: str) -> list[dict[str, Any]]:
    listed = tenants.ask("GET", "/v1/art/rollouts?limit=1000", who)
    assert listed.status_code == 200, listed.text
    return [r for r in listed.json()["data"] if r["id"] == rollout_id]


def test_tenants_naming_one_rollout_id_each_get_their_own(tenants: Tenants) -> None:
    """Before: a rollout id was one rollout for everyone, so the first key to name it took it and every other
    caller naming it (another key of the model, a key of every model, another model's, the admin's call joined
    it) got 409 `rollout_id_taken` (and learnt it was in use). Now an id names a rollout in its caller's
    namespace: five callers, one id, five rollouts, each with its own calls only, read back by its own id."""
    rollout_id = f"task-7-{uuid.uuid4().hex[:8]}"
    for turn in (1, 2):
        for who in CALLERS:
            answered = tenants.chat(who, rollout_id, f"{who}'s turn {turn}", model=_model(who))
            assert answered.status_code == 200, (who, answered.text)
            assert answered.headers[ROLLOUT] == rollout_id
    for who in CALLERS:
        got = tenants.ask("GET", f"/v1/art/rollouts/{rollout_id}", who)
        assert got.status_code == 200, (who, got.text)
        mine = got.json()
        assert (mine["rollout_id"], mine["owner"], mine["model"]) == (
            rollout_id,
            _key_id(tenants, who) or "",
            _model(who),
        )
        assert [c["key_id"] for c in mine["calls"]] == [_key_id(tenants, who)] * 2
        assert f"{who}'s turn 2" in got.text
        assert not [other for other in CALLERS if other != who and f"{other}'s" in got.text], got.text
        if who != "admin":  # a key lists its own rollout under the id, no other
            assert [r["key_id"] for r in _rollouts_listed(tenants, who, rollout_id)] == [_key_id(tenants, who)]
    # The admin lists every owner's, and reads any of them by naming its owner (a key id).
    listed = _rollouts_listed(tenants, "admin", rollout_id)
    assert sorted(r["owner"] for r in listed) == sorted(_key_id(tenants, who) or "" for who in CALLERS)
    owners = tenants.ask("GET", f"/v1/art/rollouts/{rollout_id}?owner={tenants.key_ids['owner']}", "admin")
    assert owners.status_code == 200 and "owner's turn 2" in owners.text and "neighbour's" not in owners.text


def _doors(tenants: Tenants, who: str, mine: str, rollout_id: str) -> list[tuple[int, str]]:
    """What `who` is told at every door that takes a rollout id (`mine`: one of its own, to group it with)."""
    group = {
        "model": _model(who),
        "rollouts": [{"rollout_id": mine, "reward": 0.0}, {"rollout_id": rollout_id, "reward": 1.0}],
    }
    doors = [
        tenants.ask("GET", f"/v1/art/rollouts/{rollout_id}", who),
        tenants.ask("GET", f"/v1/art/rollouts/{rollout_id}/0", who),
        tenants.ask("GET", f"/v1/art/rollouts/{rollout_id}?owner={tenants.key_ids['owner']}", who),
        tenants.ask("GET", f"/ui/rollouts/{rollout_id}", who),
        tenants.ask("POST", "/v1/art/rewards", who, json={"rollout_id": rollout_id, "reward": 1.0}),
        tenants.ask("POST", "/v1/art/groups", who, json=group),
    ]
    return [(r.status_code, r.text.replace(rollout_id, "ID")) for r in doors]


def test_no_answer_tells_a_tenant_that_another_tenant_uses_an_id(tenants: Tenants) -> None:
    """Every door that takes a rollout id (reading it, the trajectory viewer, naming its owner, a reward, a
    group) answers another tenant exactly as for an id nobody ever used. Before: a key of the same model (or
    of every model) read it, and a call naming it got 409 where an unused id got 200."""
    taken, unused = f"secret-{uuid.uuid4().hex[:8]}", f"unused-{uuid.uuid4().hex[:8]}"
    assert tenants.chat("owner", taken, "owner's plan").status_code == 200
    for who in ("neighbour", "every", "other"):
        mine = f"mine-{who}-{uuid.uuid4().hex[:8]}"
        assert tenants.chat(who, mine, f"{who}'s own", model=_model(who)).status_code == 200

        answers = _doors(tenants, who, mine, taken)
        assert answers == _doors(tenants, who, mine, unused), who
        assert [status for status, _ in answers] == [404, 404, 404, 404, 404, 400], (who, answers)
        assert not [text for _, text in answers if "owner's plan" in text]
        assert _rollouts_listed(tenants, who, taken) == []
    # The owner's rollout is as it was.
    assert (
        tenants.ask("GET", f"/v1/art/rollouts/{taken}", "owner").json()["calls"][0]["key_id"]
        == tenants.key_ids["owner"]
    )


def test_each_tenant_groups_and_rewards_its_own_rollouts_of_one_id(tenants: Tenants) -> None:
    """Two keys of model `a` use the same rollout ids, group them and reward them: two groups, each of its
    key's rollouts (a rollout trains at most once: once per owner, not once per id), each reward its own."""
    ids = [f"grp-{i}-{uuid.uuid4().hex[:8]}" for i in range(3)]
    groups = {}
    for who in ("owner", "neighbour"):
        for rollout_id in ids:
            answered = tenants.chat(who, rollout_id, f"{who}'s attempt")
            assert answered.status_code == 200, (who, answered.text)
    for who in ("owner", "neighbour"):
        body = {"model": "a", "rollouts": [{"rollout_id": r, "reward": float(i)} for i, r in enumerate(ids[:2])]}
        made = tenants.ask("POST", "/v1/art/groups", who, json=body)
        assert made.status_code == 201, (who, made.text)
        groups[who] = made.json()
        assert groups[who]["owner"] == tenants.key_ids[who]
        rewarded = tenants.ask("POST", "/v1/art/rewards", who, json={"rollout_id": ids[2], "reward": 0.5})
        assert rewarded.status_code == 201, (who, rewarded.text)
    for who, other in (("owner", "neighbour"), ("neighbour", "owner")):
        # Its own group reads; the other's is unknown, as an id nobody used.
        assert tenants.ask("GET", f"/v1/art/groups/{groups[who]['id']}", who).status_code == 200
        assert tenants.ask("GET", f"/v1/art/groups/{groups[other]['id']}", who).status_code == 404
        members = tenants.ask("GET", f"/v1/art/rollouts?group_id={groups[who]['id']}", who).json()["data"]
        assert sorted((r["id"], r["key_id"]) for r in members) == sorted((r, tenants.key_ids[who]) for r in ids[:2])
    # A rollout is in one group of its owner's at most; another reward of it is a conflict: per owner.
    again = tenants.ask("POST", "/v1/art/rewards", "owner", json={"rollout_id": ids[2], "reward": 0.25})
    assert (again.status_code, again.json()["error"]["code"]) == (409, "reward_conflict")


def test_tenants_naming_one_group_id_each_get_their_own(tenants: Tenants) -> None:
    """Group ids are per key, as rollout ids are. Before: one namespace, so the second tenant to name a group id
    got 409 `group_id_conflict` (and learnt another used it). Now each caller's `group_id` is a group of its own,
    read back, listed and filtered by under that id; the admin reads a key's by naming its owner."""
    group_id = f"task-{uuid.uuid4().hex[:8]}"
    made = {}
    for who in CALLERS:
        ids = [f"{group_id}-{who}-{i}" for i in range(2)]
        for rollout_id in ids:
            assert tenants.chat(who, rollout_id, f"{who}'s try", model=_model(who)).status_code == 200
        body = {"model": _model(who), "group_id": group_id, "rollouts": [{"rollout_id": r, "reward": 1.0} for r in ids]}
        answered = tenants.ask("POST", "/v1/art/groups", who, json=body)
        assert answered.status_code == 201, (who, answered.text)
        made[who] = answered.json()
        assert (made[who]["id"], made[who]["group_id"], made[who]["owner"]) == (
            group_id,
            group_id,
            _key_id(tenants, who) or "",
        )
        # The same request again is the same group; other content under its own id is a conflict, as before.
        assert tenants.ask("POST", "/v1/art/groups", who, json=body).status_code == 200
        changed = {**body, "metadata": {"changed": True}}
        conflict = tenants.ask("POST", "/v1/art/groups", who, json=changed)
        assert (conflict.status_code, conflict.json()["error"]["code"]) == (409, "group_id_conflict")
    for who in CALLERS:
        got = tenants.ask("GET", f"/v1/art/groups/{group_id}", who)
        assert got.status_code == 200 and got.json() == made[who], (who, got.text)
        members = tenants.ask("GET", f"/v1/art/rollouts?group_id={group_id}", who).json()["data"]
        assert sorted(r["id"] for r in members) == [r["rollout_id"] for r in made[who]["rollouts"]], who
        listed = tenants.ask("GET", "/v1/art/groups?limit=1000", who).json()["data"]
        mine = [g for g in listed if g["id"] == group_id]
        if who == "admin":  # every owner's, each with its owner
            assert sorted(g["owner"] for g in mine) == sorted(_key_id(tenants, w) or "" for w in CALLERS)
        else:
            assert mine == [made[who]], who
    # The admin names a key's group by its owner, as it does a rollout; a key cannot name another's.
    owner = tenants.key_ids["owner"]
    assert tenants.ask("GET", f"/v1/art/groups/{group_id}?owner={owner}", "admin").json() == made["owner"]
    assert tenants.ask("GET", f"/v1/art/groups/{group_id}?owner={owner}", "neighbour").status_code == 404
    page = tenants.ask("GET", f"/ui/groups/{group_id}?owner={owner}", "admin")
    assert page.status_code == 200 and f"{group_id}-owner-0" in page.text


def test_one_rollout_id_of_one_caller_is_of_one_model(tenants: Tenants) -> None:
    """Within a caller's own ids, a rollout is still its first trainable model's: a call of another model
    naming it is refused (409 `rollout_id_taken`), before the engine sees it."""
    rollout_id = f"two-models-{uuid.uuid4().hex[:8]}"
    assert tenants.chat("every", rollout_id, "a's").status_code == 200
    refused = tenants.chat("every", rollout_id, "b's", model="b")
    assert (refused.status_code, refused.json()["error"]["code"]) == (409, "rollout_id_taken")
    assert refused.json()["error"]["param"] == ROLLOUT


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


def test_a_key_granted_to_read_another_keys_things_reads_and_continues_them_and_changes_nothing(
    tenants: Tenants,
) -> None:
    """An explicit grant (#40: "admin and explicit grants can"): the admin makes a key with `read_keys` naming
    the owner's key. It reads the owner's rollouts, groups and stored Responses (naming the owner, as the admin
    does), lists them beside its own, and continues a Response (the follow-up is its own); it never adds to,
    rewards, groups or deletes them. A key without the grant still reads nothing of the owner's. Before: no
    such grant (`read_keys` an unknown field: 400)."""
    owner = tenants.key_ids["owner"]
    ids = [f"granted-{i}-{uuid.uuid4().hex[:8]}" for i in range(2)]
    for rollout_id in ids:
        assert tenants.chat("owner", rollout_id, "owner's notes").status_code == 200
    group = {"model": "a", "rollouts": [{"rollout_id": r, "reward": float(i)} for i, r in enumerate(ids)]}
    group_id = tenants.ask("POST", "/v1/art/groups", "owner", json=group).json()["id"]
    response_id = tenants.ask("POST", "/v1/responses", "owner", json={"model": "a", "input": "owner's plan"}).json()[
        "id"
    ]

    unknown = {"name": "reader", "models": ["a"], "scopes": SCOPES, "read_keys": ["key_nobody"]}
    refused = tenants.ask("POST", "/v1/art/keys", "admin", json=unknown)
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "read_keys[0]"), refused.text
    made = tenants.ask("POST", "/v1/art/keys", "admin", json={**unknown, "read_keys": [owner]})
    assert made.status_code == 201 and made.json()["read_keys"] == [owner], made.text
    role = f"reader-{uuid.uuid4().hex[:8]}"
    tenants.keys[role], tenants.key_ids[role] = made.json()["key"], made.json()["id"]
    listed_keys = tenants.ask("GET", "/v1/art/keys", "admin").json()["data"]
    assert next(k for k in listed_keys if k["id"] == tenants.key_ids[role])["read_keys"] == [owner]

    # It reads, naming the owner; its own namespace has no such ids.
    rollout = tenants.ask("GET", f"/v1/art/rollouts/{ids[0]}?owner={owner}", role)
    assert rollout.status_code == 200 and "owner's notes" in rollout.text, rollout.text
    assert tenants.ask("GET", f"/v1/art/rollouts/{ids[0]}", role).status_code == 404
    listed = tenants.ask("GET", "/v1/art/rollouts?limit=1000", role).json()["data"]
    assert {(r["id"], r["owner"]) for r in listed} >= {(r, owner) for r in ids}
    assert tenants.ask("GET", f"/v1/art/groups/{group_id}?owner={owner}", role).json()["owner"] == owner
    assert tenants.ask("GET", f"/ui/rollouts/{ids[0]}?owner={owner}", role).status_code == 200
    path = f"/v1/responses/{response_id}"
    assert tenants.ask("GET", path, role).json()["id"] == response_id
    assert tenants.ask("GET", path + "/input_items", role).status_code == 200
    body = {"model": "a", "input": "and then?", "previous_response_id": response_id}
    follow_up = tenants.ask("POST", "/v1/responses", role, json=body)
    assert follow_up.status_code == 200, follow_up.text
    # The follow-up is the reader's: the owner, not granted the reader's, cannot read it.
    assert tenants.ask("GET", f"/v1/responses/{follow_up.json()['id']}", "owner").status_code == 404

    # It changes nothing of the owner's: no delete, no reward, no group, no call added to its rollout.
    deleted = tenants.ask("DELETE", path, role)
    assert (deleted.status_code, deleted.json()["error"]["code"]) == (403, "read_only_grant"), deleted.text
    assert tenants.ask("GET", path, "owner").status_code == 200
    rewarded = tenants.ask("POST", "/v1/art/rewards", role, json={"rollout_id": ids[0], "reward": 1.0})
    assert rewarded.status_code == 404, rewarded.text
    regrouped = tenants.ask("POST", "/v1/art/groups", role, json=group)
    assert (regrouped.status_code, regrouped.json()["error"]["code"]) == (400, "unknown_rollout")
    assert tenants.chat(role, ids[0], "reader's turn").status_code == 200  # a rollout of its own
    calls = tenants.ask("GET", f"/v1/art/rollouts/{ids[0]}", "owner").json()["calls"]
    assert [c["key_id"] for c in calls] == [owner]

    # Without the grant, another key of the model still reads nothing of the owner's.
    assert tenants.ask("GET", f"/v1/art/rollouts/{ids[0]}?owner={owner}", "neighbour").status_code == 404
    assert tenants.ask("GET", f"/v1/art/groups/{group_id}?owner={owner}", "neighbour").status_code == 404
    assert tenants.ask("GET", path, "neighbour").status_code == 404


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


# ---------------------------------------------------------------- the real engine: one sequence each


@pytest.mark.engine
def test_two_tenants_of_one_rollout_id_each_train_one_sequence(vllm_url: str, tmp_path: Path) -> None:
    """Two keys of model `a` hold a two-turn conversation each under one rollout id, their turns interleaved,
    against the real vLLM: each key's rollout is its two calls, the second spliced onto the first's sampled
    tokens (one sequence), with nothing of the other's. Before: the second key's calls got 409."""
    gateway = serve(tmp_path, vllm_url, "--auth", "required")
    try:
        keys = []
        for name in ("first", "second"):
            body = {"name": name, "models": ["a"], "scopes": ["infer", "read"]}
            made = httpx.post(f"{gateway.url}/v1/art/keys", json=body, headers=gateway.admin, timeout=30)
            assert made.status_code == 201, made.text
            keys.append(made.json())
        rollout_id = f"shared-{uuid.uuid4().hex[:8]}"
        histories = {key["id"]: [{"role": "user", "content": f"Hello, I am {key['name']}."}] for key in keys}
        for _turn in range(2):
            for key in keys:
                history = histories[key["id"]]
                body = {"model": "a", "messages": history, "max_tokens": 8, "seed": 1}
                answered = httpx.post(
                    f"{gateway.url}/v1/chat/completions",
                    json=body,
                    headers={**sent(key["key"]), ROLLOUT: rollout_id},
                    timeout=120,
                )
                assert answered.status_code == 200, answered.text
                reply = answered.json()["choices"][0]["message"]
                history += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "More."}]
        for key in keys:
            got = httpx.get(f"{gateway.url}/v1/art/rollouts/{rollout_id}", headers=sent(key["key"]), timeout=60)
            assert got.status_code == 200, got.text
            mine = got.json()
            assert [c["key_id"] for c in mine["calls"]] == [key["id"]] * 2
            assert len(mine["sequences"]) == 1, mine["sequences"]
            other = next(k for k in keys if k is not key)
            assert f"I am {other['name']}" not in got.text
    finally:
        gateway.stop()
