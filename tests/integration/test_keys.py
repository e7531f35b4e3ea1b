"""API keys, end to end: who may call which endpoint, what each refusal says, and what each key may see.

The key table: every endpoint (inference, read, reward, admin, open) asked by every kind of caller (no key, a
key never made, a revoked key, a key for the other model, a key without the endpoint's scope, the right key,
the admin key), each key sent both as `Authorization: Bearer` and as `x-api-key`: the exact status and the
exact body (OpenAI's error shape; Anthropic's on /v1/messages). Then: listings never show another model's data,
each recorded call keeps its key's id (never its secret), the OpenAI and Anthropic SDKs see typed errors, rate
limits answer 429 with Retry-After and recover, `artgw keys` works end to end, and the admin key file is private
and never logged. The same table with `--auth off`: a keyless caller may infer and nothing more.

One gateway (`--auth required`, two trainable models `a` and `b`, the admin key it made itself, a metrics
key) in front of the stand-in engine (tests/stub_engine.py: it returns token ids), shared by the module.
Revocation across replicas on PostgreSQL: tests/integration/test_key_replicas.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import stat
import subprocess
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import psutil
import pytest

from gateway.errors import OpenAIError
from tests.conftest import ARTGW, GatewayProcess, start_stub, stop_group
from tests.key_helpers import CHAT_A, MODELS, USER, sent, serve

SCOPES = ("infer", "reward", "read")
METRICS_KEY = "metrics-key-for-prometheus-0123"
NEVER_MADE = "sk-art-this-key-was-never-made-0000"  # a well-formed key the gateway never issued


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a process started here: the shell's ARTGW_* removed, so only what a test sets counts."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("ARTGW_")}, **extra}


def shown(secret: str) -> str:
    """How a 401 names a wrong key: its first 7 and last 4 characters."""
    return f"{secret[:7]}...{secret[-4:]}"


# ---------------------------------------------------------------- the module's gateway and its keys


@dataclass
class World:
    """The gateway, its keys (by role) and data recorded for both models."""

    gateway: GatewayProcess
    admin_key: str
    adapter_dir: Path
    keys: dict[str, dict[str, Any]]  # role -> POST /v1/art/keys's answer (id, key, models, scopes, ...)
    revoked: dict[str, Any]
    rollouts: dict[str, list[str]]  # model -> rollout ids recorded with its key
    groups: dict[str, str]  # model -> a group id
    responses: dict[str, str]  # model -> a stored response id
    key_ids: dict[str, str] = field(default_factory=dict)  # secret -> id, of every key made here

    @property
    def url(self) -> str:
        return self.gateway.url

    def ask(self, method: str, path: str, secret: str | None = None, how: str = "bearer", **kw: Any) -> httpx.Response:
        headers = {**sent(secret, how), **kw.pop("headers", {})}
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kw)

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = self.ask(method, path, self.admin_key, **kw)
        assert r.is_success, r.text
        return r

    def make_key(self, name: str, models: list[str] | None, scopes: list[str], **limits: int) -> dict[str, Any]:
        body = {"name": name, "models": models, "scopes": scopes, **limits}
        made: dict[str, Any] = self.admin("POST", "/v1/art/keys", json=body).json()
        self.key_ids[made["key"]] = made["id"]
        return made

    def record(self, model: str, secret: str, rollout_id: str | None = None) -> str:
        """One chat call of `model` with `secret`, in its own rollout; its id, once stored."""
        rollout_id = rollout_id or f"r-{model}-{uuid.uuid4().hex[:10]}"
        body = {"model": model, "messages": USER, "max_tokens": 4}
        r = self.ask("POST", "/v1/chat/completions", secret, json=body, headers={"X-ART-Rollout-Id": rollout_id})
        assert r.status_code == 200, r.text
        # Read-your-writes: waits until it is stored. Rollout ids are per key: the admin names whose.
        self.admin("GET", f"/v1/art/rollouts/{rollout_id}", params={"owner": self.key_id_of(secret)})
        return rollout_id

    def key_id_of(self, secret: str) -> str:
        """The id of the key `secret` is ("" for the admin's: its rollout ids are those of no key)."""
        return self.key_ids.get(secret, "")

    def group(self, model: str, secret: str) -> dict[str, Any]:
        rollouts = [{"rollout_id": self.record(model, secret), "reward": float(i)} for i in range(2)]
        r = self.ask("POST", "/v1/art/groups", secret, json={"model": model, "rollouts": rollouts})
        assert r.status_code == 201, r.text
        return r.json()  # type: ignore[no-any-return]

    def response(self, model: str) -> str:
        """A stored Responses API response of `model`, made by the key the table's "right" column sends (a
        stored Response is its key's): its id."""
        secret = self.keys["a:infer" if model == "a" else f"{model}:all"]["key"]
        r = self.ask("POST", "/v1/responses", secret, json={"model": model, "input": "hi"})
        assert r.status_code == 200, r.text
        return r.json()["id"]  # type: ignore[no-any-return]

    def key_for(self, who: str, scope: str | None, *, owned: bool = False) -> str | None:
        """The secret a column of the table sends, for an endpoint needing `scope` (None: admin-only or open).
        On admin-only and open endpoints "right" is a client key of `a` with every scope, "no scope" one with
        only `infer`: no client key is right for an admin endpoint."""
        if who == "none":
            return None
        if who == "bad":
            return NEVER_MADE
        if who == "admin":
            return self.admin_key
        if who == "revoked":
            return self.revoked["key"]  # type: ignore[no-any-return]
        role = {
            "other": "b:all",
            "no scope": f"a:all but {scope}" if scope else "a:infer",
            "right": f"a:{scope}" if scope and not owned else "a:all",
        }[who]
        return self.keys[role]["key"]  # type: ignore[no-any-return]


def _world(where: Path, auth: str) -> Iterator[World]:
    """A gateway (`--auth AUTH`) in front of a stand-in engine, its keys made and data recorded for both models."""
    stub, stub_proc = start_stub()
    try:
        gateway = serve(where, stub, "--auth", auth, env={"ARTGW_METRICS_KEY": METRICS_KEY})
        try:
            yield _populated(World(gateway, gateway.admin_key, where / "adapter", {}, {}, {}, {}, {}))
        finally:
            gateway.stop()
    finally:
        stop_group(stub_proc)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    yield from _world(tmp_path_factory.mktemp("keys"), "required")


@pytest.fixture(scope="module")
def world_off(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The same world behind a gateway with `--auth off` (on loopback)."""
    yield from _world(tmp_path_factory.mktemp("keys-off"), "off")


def _populated(w: World) -> World:
    w.adapter_dir.mkdir()
    (w.adapter_dir / "adapter_config.json").write_text("{}")  # enough for the stand-in engine's LoRA API
    # Keys of `a`: each scope alone, each scope missing, every scope; `b`'s with every scope; one revoked.
    for scope in SCOPES:
        w.keys[f"a:{scope}"] = w.make_key(f"a-{scope}", ["a"], [scope])
        w.keys[f"a:all but {scope}"] = w.make_key(f"a-no-{scope}", ["a"], [s for s in SCOPES if s != scope])
    for model in MODELS:
        w.keys[f"{model}:all"] = w.make_key(f"{model}-all", [model], list(SCOPES))
    w.revoked = w.make_key("revoked", ["a"], list(SCOPES))
    w.admin("DELETE", f"/v1/art/keys/{w.revoked['id']}")
    # Data of both models, made with each model's own key.
    for model in MODELS:
        secret = w.keys[f"{model}:all"]["key"]
        w.rollouts[model] = [w.record(model, secret) for _ in range(2)]
        w.groups[model] = w.group(model, secret)["id"]
        w.responses[model] = w.response(model)
    return w


# ---------------------------------------------------------------- the endpoints: each row's request, and its success


@dataclass
class Asked:
    """A row's request, made: what its outcome is checked against."""

    world: World
    endpoint: Endpoint
    who: str
    secret: str | None
    target: dict[str, Any]  # what the endpoint's `prepare` filled its path and body with
    r: httpx.Response

    def error(
        self, status: int, message: str, code: str | None, *, type: str | None = None, param: str | None = None
    ) -> None:
        """The exact error: OpenAI's shape, or Anthropic's on /v1/messages (its type chosen by the status)."""
        types = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
        if self.endpoint.anthropic:
            expected: dict[str, Any] = {"type": "error", "error": {"type": types[status], "message": message}}
        else:
            expected = {"error": {"message": message, "type": type or types[status], "param": param, "code": code}}
        assert (self.r.status_code, self.r.json()) == (status, expected)


@dataclass(frozen=True)
class Endpoint:
    scope: str | None  # what a client key needs; None: admin-only or open
    # Per row: the path's {id}, the "json" body, the query "params" (`owned`: of the world and the row's secret).
    prepare: Callable[..., dict[str, Any]]
    ok: Callable[[Asked], None]  # what a success looks like
    hidden: str | None = None  # what the other model's key is told does not exist: model, rollout, group, response
    listed: Callable[[httpx.Response], set[str]] | None = None  # a listing: the models its answer shows
    anthropic: bool = False  # errors in Anthropic's shape
    # A key's own rollouts (and groups of them): rollout ids are per key (#40), so `prepare` takes the row's secret
    # too, "right" is the key that made them (`a:all`: every scope) and the admin names their owner.
    owned: bool = False


def _status(a: Asked, status: int = 200) -> Any:
    assert a.r.status_code == status, a.r.text
    return a.r.json() if a.r.headers.get("content-type", "").startswith("application/json") else a.r.text


def _models_of(ids: list[str]) -> set[str]:
    return {i.partition("@")[0] for i in ids}


def _listed_models(r: httpx.Response) -> set[str]:
    return _models_of([m["id"] for m in r.json()["data"]])


def _listed_by_model(r: httpx.Response) -> set[str]:
    return {row["model"] for row in r.json()["data"]}


def _listed_art_models(r: httpx.Response) -> set[str]:
    return set(r.json()["data"])


def _listing(listed: Callable[[httpx.Response], set[str]], ids: Callable[[World], set[str]]) -> Callable[[Asked], None]:
    """A listing's success: `a`'s key sees `a` only (`ids(world)` among its items), the admin both models."""

    def check(a: Asked) -> None:
        _status(a)
        seen = listed(a.r)
        if a.who == "admin":
            assert {"a", "b"} <= seen, seen
        else:
            assert seen == {"a"}, seen
        items = a.r.json()["data"]
        found = {item if isinstance(item, str) else item["id"] for item in items}
        assert ids(a.world) <= found, a.r.text

    return check


def _answered(kind: str) -> Callable[[Asked], None]:
    """An inference answer of model `a`, of this kind (`object`, or `type` for Anthropic's message)."""

    def check(a: Asked) -> None:
        body = _status(a)
        assert (body["model"], body.get("object", body.get("type"))) == ("a", kind), body

    return check


def _has(code: int, /, **fields: Callable[[Asked], Any] | Any) -> Callable[[Asked], None]:
    """A success with this status whose body has these fields (a callable: computed from the row)."""

    def check(a: Asked) -> None:
        body = _status(a, code)
        want = {name: value(a) if callable(value) else value for name, value in fields.items()}
        assert {name: body[name] for name in fields} == want, body

    return check


def _id(a: Asked) -> Any:
    return a.target["id"]


def _maker(w: World, secret: str | None) -> str:
    """Who records a row's fresh rollouts: the caller that will name them, where it may make calls."""
    return secret if secret in (w.admin_key, w.keys["a:all"]["key"]) else w.admin_key


def _fresh_rollouts(w: World, secret: str | None) -> dict[str, Any]:
    rollouts = [{"rollout_id": w.record("a", _maker(w, secret)), "reward": float(i)} for i in range(2)]
    return {"json": {"model": "a", "rollouts": rollouts}}


def _owned_rollout(w: World, secret: str | None) -> dict[str, Any]:
    """`a`'s first rollout (made by `a:all`); the admin names its owner."""
    owner = {"owner": w.keys["a:all"]["id"]} if secret == w.admin_key else {}
    return {"id": w.rollouts["a"][0], "params": owner}


def _owned_group(w: World, secret: str | None) -> dict[str, Any]:
    """`a`'s group (made by `a:all`); group ids are per key too, so the admin names its owner."""
    owner = {"owner": w.keys["a:all"]["id"]} if secret == w.admin_key else {}
    return {"id": w.groups["a"], "params": owner}


def _next_adapter(w: World) -> dict[str, Any]:
    step = w.admin("GET", "/v1/art/models/a").json()["latest_step"] + 1
    return {"id": "a", "step": step, "json": {"step": step, "path": str(w.adapter_dir)}}


EVAL_SET = {
    "scenarios": [{"messages": [{"role": "user", "content": "hi"}], "grader": {"type": "exact", "value": "ok"}}]
}


def _fresh_eval_set(w: World) -> dict[str, Any]:
    """An eval set of `a` named `a`: the path's two {id}s are the same."""
    w.admin("POST", "/v1/art/models/a/evals", json={**EVAL_SET, "name": "a"})
    return {"id": "a"}


def _fresh_reward(w: World, secret: str | None) -> dict[str, Any]:
    rollout_id = w.record("a", _maker(w, secret))
    return {"id": rollout_id, "json": {"rollout_id": rollout_id, "reward": 1.0}}


def _fresh_model(w: World) -> dict[str, Any]:
    name = f"m-{uuid.uuid4().hex[:8]}"
    w.admin("POST", "/v1/art/models", json={"name": name})
    return {"id": name}


def _input_items(a: Asked) -> None:
    items = _status(a)["data"]
    assert [(i["role"], i["content"]) for i in items] == [("user", [{"type": "input_text", "text": "hi"}])]


def _keys_listed(a: Asked) -> None:
    body = _status(a)
    ids = {k["id"] for k in body["data"]}
    assert {k["id"] for k in a.world.keys.values()} <= ids
    assert a.world.revoked["id"] not in ids  # revoked keys only with ?include_revoked=true
    assert all("key" not in k for k in body["data"])
    assert not any(k["key"] in a.r.text for k in a.world.keys.values())  # secrets are shown once, when made


def _key_made(a: Asked) -> None:
    body = _status(a, 201)
    assert body["key"].startswith("sk-art-") and (body["models"], body["scopes"]) == (["a"], ["infer"]), body


def _revoked(a: Asked) -> None:
    body = _status(a)
    assert body["id"] == a.target["id"] and body["revoked_at"] is not None, body


def _metrics(a: Asked) -> None:
    assert "artgw_requests_total" in _status(a)


ENDPOINTS: dict[str, Endpoint] = {
    # inference: scope `infer`
    "POST /v1/chat/completions": Endpoint(
        "infer", lambda w: {"json": CHAT_A}, _answered("chat.completion"), hidden="model"
    ),
    "POST /rollouts/{id}/v1/chat/completions": Endpoint(
        "infer",
        lambda w: {"id": f"p-{uuid.uuid4().hex[:8]}", "json": CHAT_A},
        _answered("chat.completion"),
        hidden="model",
    ),
    "POST /v1/completions": Endpoint(
        "infer", lambda w: {"json": {"model": "a", "prompt": "hi", "max_tokens": 4}}, _has(200, model="a"), "model"
    ),
    "POST /v1/responses": Endpoint(
        "infer", lambda w: {"json": {"model": "a", "input": "hi"}}, _answered("response"), hidden="model"
    ),
    "GET /v1/responses/{id}": Endpoint(
        "infer", lambda w: {"id": w.responses["a"]}, _has(200, id=_id, model="a"), hidden="response"
    ),
    "GET /v1/responses/{id}/input_items": Endpoint(
        "infer", lambda w: {"id": w.responses["a"]}, _input_items, hidden="response"
    ),
    "DELETE /v1/responses/{id}": Endpoint(
        "infer",
        lambda w: {"id": w.response("a")},
        _has(200, id=_id, object="response.deleted", deleted=True),
        hidden="response",
    ),
    "POST /v1/messages": Endpoint(
        "infer",
        lambda w: {"json": {"model": "a", "max_tokens": 4, "messages": USER}},
        _answered("message"),
        hidden="model",
        anthropic=True,
    ),
    "POST /v1/messages/count_tokens": Endpoint(
        "infer",
        lambda w: {"json": {"model": "a", "messages": USER}},
        _has(200, input_tokens=2),  # the stand-in engine's count: one a message, one to answer
        hidden="model",
        anthropic=True,
    ),
    "GET /v1/models": Endpoint("infer", lambda w: {}, _listing(_listed_models, lambda w: {"a"}), listed=_listed_models),
    "GET /v1/models/{id}": Endpoint("infer", lambda w: {"id": "a"}, _has(200, id="a", object="model"), "model"),
    # reading: scope `read`
    "GET /v1/art/rollouts/{id}": Endpoint(
        "read", _owned_rollout, _has(200, rollout_id=_id, model="a"), hidden="rollout", owned=True
    ),
    "GET /v1/art/rollouts/{id}/0": Endpoint(
        "read",
        _owned_rollout,
        _has(200, rollout_id=lambda a: f"{a.target['id']}/0", model="a"),
        hidden="rollout",
        owned=True,
    ),
    "GET /v1/art/rollouts": Endpoint(
        "read",
        lambda w, _: {"params": {"limit": 1000}},
        _listing(_listed_by_model, lambda w: set(w.rollouts["a"])),
        listed=_listed_by_model,
        owned=True,
    ),
    "GET /v1/art/groups/{id}": Endpoint("read", _owned_group, _has(200, id=_id, model="a"), hidden="group", owned=True),
    "GET /v1/art/groups": Endpoint(
        "read",
        lambda w, _: {"params": {"limit": 1000}},
        _listing(_listed_by_model, lambda w: {w.groups["a"]}),
        listed=_listed_by_model,
        owned=True,
    ),
    "GET /v1/art/models": Endpoint(
        "read", lambda w: {}, _listing(_listed_art_models, lambda w: {"a"}), listed=_listed_art_models
    ),
    "GET /v1/art/models/{id}": Endpoint(
        "read", lambda w: {"id": "a"}, _has(200, name="a", retired=False), hidden="model"
    ),
    "GET /v1/art/models/{id}/judge-report": Endpoint(
        "read", lambda w: {"id": "a"}, _has(200, model="a"), hidden="model"
    ),
    "GET /v1/art/models/{id}/evals": Endpoint("read", lambda w: {"id": "a"}, _has(200, object="list"), hidden="model"),
    # rewards: scope `reward`
    "POST /v1/art/groups": Endpoint(
        "reward", _fresh_rollouts, _has(201, model="a", state="ready"), hidden="model", owned=True
    ),
    "POST /v1/art/rewards": Endpoint(
        "reward", _fresh_reward, _has(201, rollout_id=_id, reward=1.0), hidden="rollout", owned=True
    ),
    # admin only
    "POST /v1/art/models/{id}/adapters": Endpoint(
        None, _next_adapter, _has(200, name="a", served_step=lambda a: a.target["step"])
    ),
    "POST /v1/art/models": Endpoint(
        None,
        lambda w: {"json": {"name": f"m-{uuid.uuid4().hex[:8]}"}},
        _has(201, name=lambda a: a.target["json"]["name"], retired=False),
    ),
    "DELETE /v1/art/models/{id}": Endpoint(None, _fresh_model, _has(200, name=_id, retired=True)),
    "POST /v1/art/models/{id}/promote": Endpoint(
        None, lambda w: {"id": "a", "json": {"step": 0, "reason": "a row"}}, _has(200, name="a", served_step=0)
    ),
    "POST /v1/art/models/{id}/rollback": Endpoint(
        None, lambda w: {"id": "a", "json": {"step": 0}}, _has(200, name="a", served_step=0)
    ),
    "POST /v1/art/models/{id}/evals": Endpoint(
        None,
        lambda w: {"id": "a", "json": {**EVAL_SET, "name": f"s-{uuid.uuid4().hex[:8]}"}},
        _has(201, model="a", name=lambda a: a.target["json"]["name"]),
    ),
    "DELETE /v1/art/models/{id}/evals/{id}": Endpoint(None, _fresh_eval_set, lambda a: _status(a, 204)),
    "POST /v1/art/keys": Endpoint(
        None, lambda w: {"json": {"name": "made-in-a-row", "models": ["a"], "scopes": ["infer"]}}, _key_made
    ),
    "GET /v1/art/keys": Endpoint(None, lambda w: {}, _keys_listed),
    "DELETE /v1/art/keys/{id}": Endpoint(
        None, lambda w: {"id": w.make_key("to-revoke", ["a"], ["infer"])["id"]}, _revoked
    ),
    # open (and /metrics, guarded by the metrics key this gateway has)
    "GET /healthz": Endpoint(None, lambda w: {}, _has(200, status="ok")),
    "GET /readyz": Endpoint(None, lambda w: {}, _has(200, status="ready", engine="ready", store="ok")),
    "GET /metrics": Endpoint(None, lambda w: {}, _metrics),
}


# ---------------------------------------------------------------- what a row expects


@dataclass(frozen=True)
class Outcome:
    name: str
    check: Callable[[Asked], None]

    def __repr__(self) -> str:
        return self.name


NO_KEY_MESSAGE = (
    "You didn't provide an API key. Send it as `Authorization: Bearer <key>` (the OpenAI SDK's api_key) or "
    "`x-api-key`; an admin makes keys with POST /v1/art/keys or `artgw keys create`."
)
NEEDS_ADMIN_MESSAGE = (
    "This endpoint needs the admin key: `Authorization: Bearer <admin key>` (its file is printed when `artgw serve` "
    "starts)."
)


def _no_scope(a: Asked, scope: str) -> None:
    has = ", ".join(s for s in sorted(SCOPES) if s != scope)
    a.error(403, f"This API key lacks the `{scope}` scope needed here (it has: {has}).", "missing_scope")


def _hidden(a: Asked) -> None:
    """The other model's things are answered as if they did not exist: a key learns nothing of the others'."""
    kind, thing = a.endpoint.hidden, a.target.get("id")
    if kind == "model":
        message = "The model `a` does not exist or you do not have access to it."
        a.error(404, message, "model_not_found", type="invalid_request_error", param="model")
    elif kind == "rollout":
        a.error(404, f"No rollout `{thing}` has been recorded.", "rollout_not_found")
    elif kind == "group":
        a.error(404, f"No group `{thing}`.", "group_not_found")
    else:
        assert kind == "response", kind
        a.error(404, f"Response with id '{thing}' not found.", "response_not_found", param="response_id")


def _only_b(a: Asked) -> None:
    """A listing asked with `b`'s key: 200, and only `b`'s data."""
    assert a.r.status_code == 200, a.r.text
    assert a.endpoint.listed is not None
    assert a.endpoint.listed(a.r) == {"b"}, a.r.text


NO_KEY = Outcome("401 no key", lambda a: a.error(401, NO_KEY_MESSAGE, "invalid_api_key"))
BAD_KEY = Outcome(
    "401 wrong key", lambda a: a.error(401, f"Incorrect API key provided: {shown(a.secret or '')}.", "invalid_api_key")
)
NO_ADMIN = Outcome("401 needs the admin key", lambda a: a.error(401, NEEDS_ADMIN_MESSAGE, "invalid_api_key"))
NOT_ADMIN = Outcome(
    "403 admin only",
    lambda a: a.error(403, "This endpoint needs the admin key; a client API key cannot use it.", "admin_only"),
)
NO_INFER = Outcome("403 no infer", lambda a: _no_scope(a, "infer"))
NO_READ = Outcome("403 no read", lambda a: _no_scope(a, "read"))
NO_REWARD = Outcome("403 no reward", lambda a: _no_scope(a, "reward"))
HIDDEN = Outcome("404 as if it did not exist", _hidden)
ONLY_B = Outcome("200 b's only", _only_b)
NO_METRICS = Outcome(
    "401 needs the metrics key",
    lambda a: a.error(401, "/metrics needs `Authorization: Bearer <metrics key>`.", "invalid_api_key"),
)
OK = Outcome("2xx", lambda a: a.endpoint.ok(a))


# ---------------------------------------------------------------- the table

WHO = ("none", "bad", "revoked", "other", "no scope", "right", "admin")
# Columns: no key; a key never made; a revoked key (of `a`, every scope); a key of the other model `b` (every
# scope); a key of `a` with every scope but the endpoint's; a key of `a` with only the endpoint's scope; the
# admin key. Admin-only and open endpoints: "no scope" is a key of `a` with `infer`, "right" one with every scope
# (no client key is right for an admin endpoint). Rows target `a`'s things; {id} is filled in per row.
# fmt: off
TABLE: dict[str, tuple[Outcome, ...]] = {
    #                                           no key     bad key    revoked    other      no scope   right      admin
    "POST /v1/chat/completions":               (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_INFER,  OK,        OK),
    "POST /rollouts/{id}/v1/chat/completions": (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_INFER,  OK,        OK),
    "POST /v1/completions":                    (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_INFER,  OK,        OK),
    "POST /v1/responses":                      (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_INFER,  OK,        OK),
    "GET /v1/responses/{id}":                  (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_INFER,  OK,        OK),
    "GET /v1/responses/{id}/input_items":      (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_INFER,  OK,        OK),
    "DELETE /v1/responses/{id}":               (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_INFER,  OK,        OK),
    "POST /v1/messages":                       (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_INFER,  OK,        OK),
    "POST /v1/messages/count_tokens":          (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_INFER,  OK,        OK),
    "GET /v1/models":                          (NO_KEY,    BAD_KEY,   BAD_KEY,   ONLY_B,    NO_INFER,  OK,        OK),
    "GET /v1/models/{id}":                     (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_INFER,  OK,        OK),
    "GET /v1/art/rollouts/{id}":               (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_READ,   OK,        OK),
    "GET /v1/art/rollouts/{id}/0":             (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_READ,   OK,        OK),
    "GET /v1/art/rollouts":                    (NO_KEY,    BAD_KEY,   BAD_KEY,   ONLY_B,    NO_READ,   OK,        OK),
    "GET /v1/art/groups/{id}":                 (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_READ,   OK,        OK),
    "GET /v1/art/groups":                      (NO_KEY,    BAD_KEY,   BAD_KEY,   ONLY_B,    NO_READ,   OK,        OK),
    "GET /v1/art/models":                      (NO_KEY,    BAD_KEY,   BAD_KEY,   ONLY_B,    NO_READ,   OK,        OK),
    "GET /v1/art/models/{id}":                 (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_READ,   OK,        OK),
    "GET /v1/art/models/{id}/judge-report":    (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_READ,   OK,        OK),
    "GET /v1/art/models/{id}/evals":           (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_READ,   OK,        OK),
    "POST /v1/art/groups":                     (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_REWARD, OK,        OK),
    "POST /v1/art/rewards":                    (NO_KEY,    BAD_KEY,   BAD_KEY,   HIDDEN,    NO_REWARD, OK,        OK),
    "POST /v1/art/models/{id}/adapters":       (NO_ADMIN,  NO_ADMIN,  NO_ADMIN,  NOT_ADMIN, NOT_ADMIN, NOT_ADMIN, OK),
    "POST /v1/art/models":                     (NO_ADMIN,  NO_ADMIN,  NO_ADMIN,  NOT_ADMIN, NOT_ADMIN, NOT_ADMIN, OK),
    "DELETE /v1/art/models/{id}":              (NO_ADMIN,  NO_ADMIN,  NO_ADMIN,  NOT_ADMIN, NOT_ADMIN, NOT_ADMIN, OK),
    "POST /v1/art/models/{id}/promote":        (NO_ADMIN,  NO_ADMIN,  NO_ADMIN,  NOT_ADMIN, NOT_ADMIN, NOT_ADMIN, OK),
    "POST /v1/art/models/{id}/rollback":       (NO_ADMIN,  NO_ADMIN,  NO_ADMIN,  NOT_ADMIN, NOT_ADMIN, NOT_ADMIN, OK),
    "POST /v1/art/models/{id}/evals":          (NO_ADMIN,  NO_ADMIN,  NO_ADMIN,  NOT_ADMIN, NOT_ADMIN, NOT_ADMIN, OK),
    "DELETE /v1/art/models/{id}/evals/{id}":   (NO_ADMIN,  NO_ADMIN,  NO_ADMIN,  NOT_ADMIN, NOT_ADMIN, NOT_ADMIN, OK),
    "POST /v1/art/keys":                       (NO_ADMIN,  NO_ADMIN,  NO_ADMIN,  NOT_ADMIN, NOT_ADMIN, NOT_ADMIN, OK),
    "GET /v1/art/keys":                        (NO_ADMIN,  NO_ADMIN,  NO_ADMIN,  NOT_ADMIN, NOT_ADMIN, NOT_ADMIN, OK),
    "DELETE /v1/art/keys/{id}":                (NO_ADMIN,  NO_ADMIN,  NO_ADMIN,  NOT_ADMIN, NOT_ADMIN, NOT_ADMIN, OK),
    "GET /healthz":                            (OK,        OK,        OK,        OK,        OK,        OK,        OK),
    "GET /readyz":                             (OK,        OK,        OK,        OK,        OK,        OK,        OK),
    "GET /metrics":                            (NO_METRICS,NO_METRICS,NO_METRICS,NO_METRICS,NO_METRICS,NO_METRICS,OK),
}
# fmt: on
# One row per endpoint, caller and way of sending the key (no key is sent one way only).
ROWS = [
    pytest.param(endpoint, who, outcome, how, id=f"{endpoint} | {who} | {how}")
    for endpoint, outcomes in TABLE.items()
    for who, outcome in zip(WHO, outcomes, strict=True)
    for how in (("bearer",) if who == "none" else ("bearer", "x-api-key"))
]


PLACEHOLDER = re.compile(r"\{[^}]*\}")


def _every_model(a: Asked) -> None:
    """A listing asked without a key where none is needed: every model (both trainable ones and the base)."""
    assert a.r.status_code == 200, a.r.text
    assert a.endpoint.listed is not None
    assert a.endpoint.listed(a.r) >= {"a", "b"}, a.r.text


EVERY_MODEL = Outcome("200 every model", _every_model)
KEYLESS = Outcome(
    "401 keyless: inference only",
    lambda a: a.error(
        401,
        f"This endpoint needs an API key with the `{a.endpoint.scope}` scope (or the admin key): without a key, "
        "--auth off lets in inference only.",
        "invalid_api_key",
    ),
)


STORED_RESPONSE = ("GET /v1/responses/{id}", "GET /v1/responses/{id}/input_items", "DELETE /v1/responses/{id}")


def auth_off(endpoint: str, who: str, required: Outcome) -> Outcome:
    """The table's cell with `--auth off`: no key, or a key never made, may infer (on every model) and nothing
    more, stored Responses' reads and delete included; a revoked key is refused as with `--auth required`, and so
    is everything else (#24: keyless callers read every model's rollouts there; #40: and any stored Response)."""
    if who in ("none", "bad") and required in (NO_KEY, BAD_KEY):
        if ENDPOINTS[endpoint].scope != "infer" or endpoint in STORED_RESPONSE:
            return KEYLESS  # a stored Response too (#40): what is kept is read with a key, not by any page
        return EVERY_MODEL if ENDPOINTS[endpoint].listed else OK
    return required


OFF_ROWS = [
    pytest.param(endpoint, who, auth_off(endpoint, who, outcome), how, id=f"{endpoint} | {who} | {how}")
    for endpoint, outcomes in TABLE.items()
    for who, outcome in zip(WHO, outcomes, strict=True)
    for how in (("bearer",) if who == "none" else ("bearer", "x-api-key"))
]


def ask_row(world: World, endpoint: str, who: str, outcome: Outcome, how: str) -> None:
    spec = ENDPOINTS[endpoint]
    method, path = endpoint.split(" ")
    secret = world.key_for(who, spec.scope, owned=spec.owned)
    target = spec.prepare(world, secret) if spec.owned else spec.prepare(world)
    r = world.ask(method, path.format(**target), secret, how, json=target.get("json"), params=target.get("params"))
    outcome.check(Asked(world, spec, who, secret, target, r))


@pytest.mark.parametrize(("endpoint", "who", "outcome", "how"), ROWS)
def test_key_table(world: World, endpoint: str, who: str, outcome: Outcome, how: str) -> None:
    ask_row(world, endpoint, who, outcome, how)


@pytest.mark.parametrize(("endpoint", "who", "outcome", "how"), OFF_ROWS)
def test_key_table_with_auth_off(world_off: World, endpoint: str, who: str, outcome: Outcome, how: str) -> None:
    ask_row(world_off, endpoint, who, outcome, how)


def test_the_table_has_a_row_for_every_route(world: World) -> None:
    """Every operation of the gateway's OpenAPI document (its routes) is a row, bar the path-prefixed copies of
    the inference routes (`/rollouts/{rollout_id}/v1/...`: one of them is a row) and the document itself."""
    document = world.ask("GET", "/schema/openapi.json").json()
    served = {
        f"{method.upper()} {PLACEHOLDER.sub('{id}', path)}"
        for path, operations in document["paths"].items()
        for method in operations
        if method in ("get", "post", "delete", "put", "patch") and not path.startswith(("/rollouts/", "/schema"))
    }
    tabled = {endpoint.replace("/{id}/0", "/{id}/{id}") for endpoint in TABLE}
    assert served == {e for e in tabled if " /rollouts/" not in e}  # and every row is a route


# ---------------------------------------------------------------- listings, and the key id on each call


def test_a_reader_sees_no_secret_of_a_webhook_grader(world: World) -> None:
    """An eval set's webhook URL (user info, query) and header values are the admin's secrets: a `read` key
    sees them as `***` (#24: `https://svc:hunter2@...?token=...` was shown)."""
    url = "https://svc:hunter2@grader.example:8443/reward?token=s3cr3t"
    grader = {"type": "webhook", "url": url, "headers": {"Authorization": "Bearer s3cr3t"}}
    scenario = {"messages": [{"role": "user", "content": "hi"}], "grader": grader}
    made = world.admin("POST", "/v1/art/models/a/evals", json={"name": "webhook-secrets", "scenarios": [scenario]})
    assert made.status_code in (200, 201), made.text
    listed = world.ask("GET", "/v1/art/models/a/evals", world.keys["a:read"]["key"])
    assert listed.status_code == 200, listed.text
    assert "hunter2" not in listed.text and "s3cr3t" not in listed.text
    (shown,) = [s for s in listed.json()["data"] if s["name"] == "webhook-secrets"]
    assert shown["spec"]["scenarios"][0]["grader"]["url"] == "https://***@grader.example:8443/reward?***"
    assert shown["spec"]["scenarios"][0]["grader"]["headers"] == {"Authorization": "***"}
    world.admin("DELETE", "/v1/art/models/a/evals/webhook-secrets")


def _call(world: World, model: str, secret: str, rollout_id: str, content: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return world.ask("POST", "/v1/chat/completions", secret, json=body, headers={"X-ART-Rollout-Id": rollout_id})


@pytest.mark.parametrize("first", ["b", "a"], ids=["b's key first", "a's key first"])
def test_a_rollout_id_used_by_two_keys_is_two_rollouts(world: World, first: str) -> None:
    """The attack of #24, both ways: keys of `a` and `b` send calls with one rollout id (guessable ids get
    reused). Rollout ids are per key (#40): each key's calls make a rollout of its own under the id, which it
    reads, groups and rewards; neither sees the other's calls."""
    secrets = {"a": world.keys["a:all"]["key"], "b": world.keys["b:all"]["key"]}
    key_ids = {"a": world.keys["a:all"]["id"], "b": world.keys["b:all"]["id"]}
    shared = f"task-42-attempt-1-{uuid.uuid4().hex[:6]}"
    for who in (first, "a" if first == "b" else "b"):
        assert _call(world, who, secrets[who], shared, f"{who}'s secret").status_code == 200
    for who, other in (("a", "b"), ("b", "a")):
        mine = world.ask("GET", f"/v1/art/rollouts/{shared}", secrets[who])
        assert mine.status_code == 200, mine.text
        assert mine.json()["model"] == who and [c["key_id"] for c in mine.json()["calls"]] == [key_ids[who]]
        assert f"{who}'s secret" in mine.text and f"{other}'s secret" not in mine.text
        listed = world.ask("GET", "/v1/art/rollouts", secrets[who], params={"limit": 1000}).json()["data"]
        assert [row["key_id"] for row in listed if row["id"] == shared] == [key_ids[who]]
        own = f"r-{who}-{uuid.uuid4().hex[:8]}"
        assert _call(world, who, secrets[who], own, "more").status_code == 200
        group = {"model": who, "rollouts": [{"rollout_id": own, "reward": 1}, {"rollout_id": shared, "reward": 0}]}
        assert world.ask("POST", "/v1/art/groups", secrets[who], json=group).status_code == 201


def test_listings_show_only_the_keys_models(world: World) -> None:
    """After calls and groups for both models, a key of one sees only that model's, whatever it asks for."""
    for mine, theirs in (("a", "b"), ("b", "a")):
        key = world.keys[f"{mine}:all"]["key"]
        ids = [m["id"] for m in world.ask("GET", "/v1/models", key).json()["data"]]
        assert _models_of(ids) == {mine}, ids  # not the other model, not the base
        for path in ("/v1/art/rollouts", "/v1/art/groups"):
            page = world.ask("GET", path, key, params={"limit": 1000}).json()["data"]
            assert {row["model"] for row in page} == {mine}
            shown_ids = {row["id"] for row in page}
            assert set(world.rollouts[mine] if path.endswith("rollouts") else [world.groups[mine]]) <= shown_ids
            # Asking for the other model by name shows nothing either.
            assert world.ask("GET", path, key, params={"model": theirs}).json()["data"] == []
        assert world.ask("GET", "/v1/art/models", key).json()["data"] == [mine]
        # Its key_id filter can't reach across: the other model's key finds nothing here.
        other_key_id = world.keys[f"{theirs}:all"]["id"]
        assert world.ask("GET", "/v1/art/rollouts", key, params={"key_id": other_key_id}).json()["data"] == []
        # And its rollouts can't be rewarded under this model's name: unknown, as one never recorded.
        theirs_id = world.rollouts[theirs][0]
        body = {"model": mine, "rollouts": [{"rollout_id": r, "reward": 1.0} for r in (theirs_id, "never-recorded")]}
        r = world.ask("POST", "/v1/art/groups", key, json=body)
        assert (r.status_code, r.json()) == (400, _unknown_rollout(theirs_id, 0)), r.text
        body["rollouts"].reverse()
        r = world.ask("POST", "/v1/art/groups", key, json=body)
        assert (r.status_code, r.json()) == (400, _unknown_rollout("never-recorded", 0)), r.text


def _unknown_rollout(rollout_id: str, index: int) -> dict[str, Any]:
    message = f"Unknown rollout `{rollout_id}`: no call with this rollout id has been recorded."
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": f"rollouts[{index}].rollout_id",
            "code": "unknown_rollout",
        }
    }


def test_each_call_keeps_its_key_id_never_its_secret(world: World) -> None:
    one = world.make_key("one", ["a"], ["infer", "read"])
    two = world.make_key("two", ["a"], ["infer"])
    mine = {world.record("a", one["key"]) for _ in range(2)}
    theirs = world.record("a", two["key"])
    by_admin = world.record("a", world.admin_key)
    for rollout_id in mine:
        calls = world.ask("GET", f"/v1/art/rollouts/{rollout_id}", one["key"]).json()["calls"]
        assert [c["key_id"] for c in calls] == [one["id"]]
    theirs_read = world.admin("GET", f"/v1/art/rollouts/{theirs}", params={"owner": two["id"]})  # ids are per key
    assert [c["key_id"] for c in theirs_read.json()["calls"]] == [two["id"]]
    assert [c["key_id"] for c in world.admin("GET", f"/v1/art/rollouts/{by_admin}").json()["calls"]] == [None]

    # /v1/art/rollouts?key_id=: exactly the key's rollouts (for the admin, and for a key reading its own).
    for secret in (world.admin_key, one["key"]):
        page = world.ask("GET", "/v1/art/rollouts", secret, params={"key_id": one["id"], "limit": 1000}).json()
        assert {row["id"] for row in page["data"]} == mine
        assert {row["key_id"] for row in page["data"]} == {one["id"]}

    # `artgw export --key-id`: the same rollouts, read from the store.
    done = subprocess.run(
        [ARTGW, "export", "--data-dir", str(world.gateway.data_dir), "--key-id", one["id"]],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    exported = [json.loads(line) for line in done.stdout.splitlines()]
    assert {t["rollout_id"] for t in exported} == mine
    assert {c["key_id"] for t in exported for c in t["calls"]} == {one["id"]}
    assert "exported 2 trajectories" in done.stderr

    # The store holds ids, never a secret (SQLite's file and its WAL).
    stored = b"".join(p.read_bytes() for p in world.gateway.data_dir.glob("artgw.sqlite*"))
    assert one["id"].encode() in stored
    for key in (one, two, *world.keys.values()):
        assert key["key"].encode() not in stored


# ---------------------------------------------------------------- what an SDK user sees


def test_openai_sdk_sees_typed_errors(world: World) -> None:
    def client(secret: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{world.url}/v1", api_key=secret, max_retries=0)

    right = client(world.keys["a:infer"]["key"])
    assert right.chat.completions.create(model="a", messages=USER, max_tokens=4).choices[0].message.content == "ok"  # type: ignore[arg-type]
    assert right.completions.create(model="a", prompt="hi", max_tokens=4).model == "a"
    response = right.responses.create(model="a", input="hi")
    assert right.responses.retrieve(response.id).output_text == "ok"
    assert [i.type for i in right.responses.input_items.list(response.id)] == ["message"]
    right.responses.delete(response.id)
    listed = [m.id for m in right.models.list()]
    assert "a" in listed and _models_of(listed) == {"a"}  # `a` and its loaded steps `a@K`
    assert right.models.retrieve("a").id == "a"

    calls: dict[str, Callable[[openai.OpenAI], Any]] = {
        "chat": lambda c: c.chat.completions.create(model="a", messages=USER, max_tokens=4),  # type: ignore[arg-type]
        "completions": lambda c: c.completions.create(model="a", prompt="hi", max_tokens=4),
        "responses": lambda c: c.responses.create(model="a", input="hi"),
        "retrieve": lambda c: c.responses.retrieve(world.responses["a"]),
        "input items": lambda c: c.responses.input_items.list(world.responses["a"]),
        "models": lambda c: c.models.list(),
        "model": lambda c: c.models.retrieve("a"),
    }
    refusals: list[tuple[str, type[openai.APIStatusError], str]] = [
        (NEVER_MADE, openai.AuthenticationError, "invalid_api_key"),
        (world.revoked["key"], openai.AuthenticationError, "invalid_api_key"),
        (world.keys["a:all but infer"]["key"], openai.PermissionDeniedError, "missing_scope"),
    ]
    for secret, error, code in refusals:
        for name, call in calls.items():
            with pytest.raises(error) as caught:
                call(client(secret))
            assert caught.value.code == code, name
    # The other model's key: `a` does not exist for it (a listing shows it only `b`).
    other = client(world.keys["b:all"]["key"])
    for name, call in calls.items():
        if name == "models":
            assert _models_of([m.id for m in call(other)]) == {"b"}
            continue
        with pytest.raises(openai.NotFoundError) as caught:
            call(other)
        assert caught.value.code == ("response_not_found" if name in ("retrieve", "input items") else "model_not_found")

    # Anthropic's SDK sends its key as x-api-key, and reads Anthropic's error shape.
    def messages(secret: str) -> Any:
        client = anthropic.Anthropic(base_url=world.url, api_key=secret, max_retries=0)
        return client.messages.create(model="a", max_tokens=4, messages=[{"role": "user", "content": "hi"}])

    assert messages(world.keys["a:infer"]["key"]).content[0].text == "ok"
    with pytest.raises(anthropic.AuthenticationError):
        messages(NEVER_MADE)
    with pytest.raises(anthropic.PermissionDeniedError):
        messages(world.keys["a:all but infer"]["key"])
    with pytest.raises(anthropic.NotFoundError):
        messages(world.keys["b:all"]["key"])


def test_metrics_key_guards_metrics(world: World) -> None:
    for how in ("bearer", "x-api-key"):
        assert world.ask("GET", "/metrics", METRICS_KEY, how).status_code == 200
        assert world.ask("GET", "/metrics", world.admin_key, how).status_code == 200
        assert world.ask("GET", "/metrics", METRICS_KEY[:-1] + "X", how).status_code == 401
    assert world.ask("GET", "/metrics").status_code == 401


# ---------------------------------------------------------------- rate limits


def _until_limited(world: World, secret: str, most: int) -> tuple[int, httpx.Response, float]:
    """Chat calls until one is refused: (calls admitted, the refusal, seconds it took)."""
    started = time.monotonic()
    for admitted in range(most):
        r = world.ask("POST", "/v1/chat/completions", secret, json=CHAT_A)
        if r.status_code != 200:
            return admitted, r, time.monotonic() - started
    raise AssertionError(f"no 429 after {most} calls")


def _limited(r: httpx.Response, limit: str) -> int:
    """The refusal is a 429 `rate_limit_exceeded` whose Retry-After (whole seconds) the message repeats."""
    assert r.status_code == 429, r.text
    wait = int(r.headers["Retry-After"])
    assert wait >= 1
    assert r.json() == {
        "error": {
            "message": f"Rate limit reached for this API key: {limit}. Try again in {wait} s.",
            "type": "rate_limit_error",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    return wait


def test_requests_per_minute(world: World) -> None:
    rpm = 6  # one request back every 10 s: the refusals below are checked well within that
    key = world.make_key("rpm", ["a"], ["infer"], rpm=rpm)
    admitted, refused, took = _until_limited(world, key["key"], 200)
    # The whole minute's requests pass (the bucket starts full), and no more than what refilled meanwhile.
    assert rpm <= admitted <= rpm + math.ceil(took * rpm / 60), (admitted, took)
    _limited(refused, f"{rpm} requests per minute")
    # The key is refused on every inference API, each in its own shape; the SDKs raise their own errors.
    with pytest.raises(openai.RateLimitError) as caught:
        openai.OpenAI(base_url=f"{world.url}/v1", api_key=key["key"], max_retries=0).completions.create(
            model="a", prompt="hi"
        )
    assert caught.value.code == "rate_limit_exceeded" and int(caught.value.response.headers["Retry-After"]) >= 1
    r = world.ask(
        "POST", "/v1/messages", key["key"], "x-api-key", json={"model": "a", "max_tokens": 4, "messages": USER}
    )
    assert r.status_code == 429, r.text
    message = (
        f"Rate limit reached for this API key: {rpm} requests per minute. Try again in {r.headers['Retry-After']} s."
    )
    assert r.json() == {"type": "error", "error": {"type": "rate_limit_error", "message": message}}
    # Other keys are not limited by it.
    assert world.ask("POST", "/v1/chat/completions", world.keys["a:infer"]["key"], json=CHAT_A).status_code == 200
    # Admitted again once the bucket refills: on a clock the test moves, tests/integration/test_clock.py.


def test_tokens_per_minute(world: World) -> None:
    """Each stub call spends 4 tokens as recorded (prompt ids [1, 2, 3] + one sampled token)."""
    tpm, per_call = 120, 4
    key = world.make_key("tpm", ["a"], ["infer", "read"], tpm=tpm)
    rollout = world.record("a", key["key"])
    trajectory = world.ask("GET", f"/v1/art/rollouts/{rollout}", key["key"]).json()
    assert len(trajectory["sequences"][0]["token_ids"]) == per_call  # what the limit counts
    admitted, refused, took = _until_limited(world, key["key"], 200)
    admitted += 1  # the recorded call above
    # Calls are let in while a token is left: tpm / per_call calls, and those the refill let in meanwhile (each
    # call's tokens are known only at its end, so the last one may overdraw).
    most = (tpm + took * tpm / 60) / per_call + 1
    assert tpm // per_call <= admitted <= math.ceil(most), (admitted, took)
    _limited(refused, f"{tpm} tokens per minute")  # admitted again: tests/integration/test_clock.py


# ---------------------------------------------------------------- `artgw keys`


def artgw_keys(world: World, *args: str) -> subprocess.CompletedProcess[str]:
    """`artgw keys ...` as an admin on the gateway's machine: the key comes from the data dir's file."""
    port = world.url.rsplit(":", 1)[1]
    command = [ARTGW, "keys", *args, "--data-dir", str(world.gateway.data_dir), "--port", port]
    env = clean_env(COLUMNS="200")  # `list` prints a table: as on a terminal wide enough for all of it
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, check=False)


def test_artgw_keys_create_list_revoke(world: World) -> None:
    # A long name: piped, `keys list` prints it whole (rich cut tables at 80 columns).
    name = "cli-bot-" + "x" * 100
    made = artgw_keys(world, "create", "--name", name, "--model", "a", "--scope", "infer", "--scope", "read",
                      "--rpm", "600")  # fmt: skip
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert secret.startswith("sk-art-") and "\n" not in secret  # alone on stdout: KEY=$(artgw keys create ...)
    key_id = made.stderr.split("made key ", 1)[1].split(" ", 1)[0]
    assert world.ask("POST", "/v1/chat/completions", secret, json=CHAT_A).status_code == 200
    assert world.ask("GET", "/v1/art/rollouts", secret).status_code == 200
    assert world.ask("POST", "/v1/art/groups", secret, json={"model": "a", "rollouts": []}).status_code == 403

    listed = artgw_keys(world, "list")
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if key_id in line)
    assert name in line and "600" in line and "yes" not in line
    assert secret not in listed.stdout and secret[len("sk-art-") + 4 :] not in listed.stdout
    described = world.admin("GET", "/v1/art/keys").json()["data"]
    as_json = artgw_keys(world, "list", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == world.admin("GET", "/v1/art/keys?include_revoked=true").json()["data"]
    assert next(k for k in described if k["id"] == key_id) | {"created_at": 0} == {
        "id": key_id,
        "name": name,
        "prefix": secret[: len("sk-art-") + 4],
        "models": ["a"],
        "scopes": ["infer", "read"],
        "rpm": 600,
        "tpm": None,
        "created_at": 0,
        "revoked_at": None,
        "object": "art.api_key",
        "read_keys": [],
    }
    # A key granted to read the first one's rollouts, groups and stored Responses (#40); an unknown id is refused.
    reader = artgw_keys(world, "create", "--name", "reader", "--model", "a", "--scope", "read", "--grant-read", key_id)
    assert reader.returncode == 0, reader.stderr
    reader_id = reader.stderr.split("made key ", 1)[1].split(" ", 1)[0]
    described = world.admin("GET", "/v1/art/keys").json()["data"]
    assert next(k for k in described if k["id"] == reader_id)["read_keys"] == [key_id]
    line = next(line for line in artgw_keys(world, "list").stdout.splitlines() if reader_id in line)
    assert key_id in line
    unknown = artgw_keys(world, "create", "--name", "reader", "--grant-read", "key_nobody")
    assert unknown.returncode != 0 and "key_nobody" in unknown.stderr, unknown.stderr

    revoked = artgw_keys(world, "revoke", key_id)
    assert revoked.returncode == 0, revoked.stderr
    assert revoked.stdout.strip() == f"revoked key {key_id} ({name})"
    r = world.ask("POST", "/v1/chat/completions", secret, json=CHAT_A)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    line = next(line for line in artgw_keys(world, "list").stdout.splitlines() if key_id in line)
    assert "yes" in line

    # Without the admin key (another data dir), the command says what the gateway said, in one line.
    port = world.url.rsplit(":", 1)[1]
    refused = subprocess.run(
        [ARTGW, "keys", "list", "--data-dir", str(world.gateway.data_dir / "elsewhere"), "--port", port],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        check=False,
    )
    assert refused.returncode == 1
    elsewhere = world.gateway.data_dir / "elsewhere" / "admin_key"
    missing = f" (no admin key sent: none in {elsewhere}; set --data-dir or ARTGW_ADMIN_KEY)"
    assert refused.stderr.strip() == f"artgw keys list: {world.url} answered 401: {NEEDS_ADMIN_MESSAGE}{missing}"


# ---------------------------------------------------------------- --auth off


def test_auth_off_lets_keyless_calls_in_but_not_to_admin_endpoints(tmp_path: Path) -> None:
    stub, stub_proc = start_stub()
    gateway = serve(tmp_path, stub, "--auth", "off")
    try:
        url = gateway.url
        # Inference needs no key on loopback (an SDK's dummy key is no key either); reading recorded data does.
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT_A, timeout=30).status_code == 200
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert sdk.chat.completions.create(model="b", messages=USER, max_tokens=4).model == "b"  # type: ignore[arg-type]
        assert httpx.get(f"{url}/v1/art/rollouts", timeout=30).status_code == 401
        assert httpx.get(f"{url}/v1/art/rollouts", headers=sent(gateway.admin_key), timeout=30).status_code == 200
        # So do the UI's pages: a browser without a key goes to the login page.
        page = httpx.get(f"{url}/ui/rollouts", timeout=30)
        assert (page.status_code, page.headers["location"]) == (303, "/ui/login?next=%2Fui%2Frollouts"), page.text
        assert httpx.get(f"{url}/ui/rollouts", headers=sent(gateway.admin_key), timeout=30).status_code == 200
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200  # no --metrics-key: open
        # Admin endpoints still need the admin key: none, a wrong one, or the SDK's dummy one is a 401.
        for headers in ({}, sent(NEVER_MADE), sent("unused", "x-api-key")):
            for method, path, body in (
                ("POST", "/v1/art/keys", {"name": "k"}),
                ("GET", "/v1/art/keys", None),
                ("POST", "/v1/art/models", {"name": "c"}),
                ("DELETE", "/v1/art/models/a", None),
                ("POST", "/v1/art/models/a/adapters", {"step": 1, "path": "/nowhere"}),
            ):
                r = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
                expected = {"message": NEEDS_ADMIN_MESSAGE, "type": "authentication_error", "param": None}
                assert (r.status_code, r.json()) == (401, {"error": {**expected, "code": "invalid_api_key"}})
        admin = sent(gateway.admin_key)
        made = httpx.post(f"{url}/v1/art/keys", json={"name": "b-only", "models": ["b"]}, headers=admin, timeout=30)
        assert made.status_code == 201, made.text
        # A client key sent is still that key: it covers `b` only, even where no key is needed.
        only_b = sent(made.json()["key"])
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT_A, headers=only_b, timeout=30)
        assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
        r = httpx.post(f"{url}/v1/art/keys", json={"name": "k"}, headers=only_b, timeout=30)
        assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_only")
    finally:
        gateway.stop()
        stop_group(stub_proc)


# ---------------------------------------------------------------- the key ring, against a real store


async def test_a_refresh_under_way_undoes_no_key_made_or_revoked_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ring re-reads the store every second. A read that began before a key was made (or revoked) here and
    ends after must not drop the new key (a spurious 401 right after `POST /v1/art/keys`) nor bring the revoked
    one back (for up to a second): here the read is held open while the key is made, then revoked."""
    from gateway import auth
    from gateway.adapters import AdapterRegistry
    from gateway.keys import KeyCreate, KeyService
    from store import create_engine, migrate

    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'store.sqlite'}")
    try:
        await migrate(engine, "head")
        ring = auth.KeyRing(engine, admin_key="admin" * 8, required=True)
        service = KeyService(engine, ring, AdapterRegistry("base", ["a"]))
        read, go_on = asyncio.Event(), asyncio.Event()
        real = auth.live_keys

        async def held(conn: Any) -> Any:
            keys = await real(conn)
            read.set()
            await go_on.wait()
            return keys

        monkeypatch.setattr(auth, "live_keys", held)

        async def meanwhile(change: Callable[[], Awaitable[Any]]) -> Any:
            read.clear()
            go_on.clear()
            refresh = asyncio.create_task(ring.refresh())
            await read.wait()  # the refresh has read the store
            done = await change()
            go_on.set()
            await refresh
            return done

        made = await meanwhile(lambda: service.create(KeyCreate(name="new", models=["a"])))
        assert ring.caller({"authorization": f"Bearer {made.key}"}).key_id == made.id
        await meanwhile(lambda: service.revoke(made.id))
        with pytest.raises(OpenAIError) as caught:
            ring.caller({"authorization": f"Bearer {made.key}"})
        assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")
    finally:
        await engine.dispose()


def test_an_admin_key_file_being_written_is_waited_for_and_an_empty_one_refused(tmp_path: Path) -> None:
    """Two gateways starting at once on one data dir: the second finds the file the first has just created and
    not yet written, and takes the first's key once it is there. An empty file left for good is an error, not
    an empty admin key (which no request could ever match)."""
    import threading

    from gateway.auth import load_admin_key

    path = tmp_path / "admin_key"
    path.touch(mode=0o600)
    writer = threading.Timer(0.3, lambda: path.write_text("the-first-gateways-key-0123456789\n"))
    writer.start()
    try:
        assert load_admin_key(None, path) == ("the-first-gateways-key-0123456789", False)
    finally:
        writer.join()
    path.write_text("")
    with pytest.raises(ValueError, match=r"admin key file .* is empty: delete it to have a new key made"):
        load_admin_key(None, path)


# ---------------------------------------------------------------- the admin key (last: it reads the whole log)


def test_admin_key_file_is_private_and_never_logged_or_in_arguments(world: World) -> None:
    path = world.gateway.data_dir / "admin_key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.read_text().strip()
    assert len(key) >= 32 and key == world.admin_key
    log = world.gateway.log()
    assert f"made an admin key; it is in {path} (mode 0600)" in log  # where it is, not what it is
    assert key not in log
    for secret in (k["key"] for k in world.keys.values()):
        assert secret not in log
    procs = [psutil.Process(world.gateway.proc.pid)]
    procs += procs[0].children(recursive=True)
    for proc in procs:
        assert key not in " ".join(proc.cmdline())
