"""client/'s ArtClient on the wire, against a stand-in HTTP server: the requests its key and group calls send (the
server's structs, encoded as the server decodes them), how it reads pages, and its two errors; and `artgw keys`
saying what went wrong in one line. tests/integration/test_art_client.py runs the same calls against a gateway."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from artgw import cli
from client import ArtClient, GatewayRefused, NotAnArtGateway
from store.api import GroupCreate, KeyCreate, RolloutIn, RulerIn

KEY = {
    "id": "key_1",
    "name": "bot",
    "prefix": "sk-art-abcd",
    "models": ["my-agent"],
    "scopes": ["infer"],
    "rpm": None,
    "tpm": None,
    "created_at": 1.0,
    "revoked_at": None,
    "object": "art.api_key",
}


def group(group_id: str) -> dict[str, Any]:
    return {
        "id": group_id,
        "group_id": group_id,
        "model": "my-agent",
        "state": "ready",
        "failure_reason": None,
        "no_signal": False,
        "reward_mean": 0.5,
        "reward_std": 0.5,
        "rollouts": [],
        "ruler": None,
        "judge_usage": None,
        "metadata": None,
        "trained_step": None,
        "created_at": 1.0,
        "updated_at": 1.0,
        "object": "art.group",
    }


@dataclass
class Request:
    method: str
    path: str  # with the query
    headers: dict[str, str]
    body: bytes


@dataclass
class StandIn:
    """A plain HTTP server on loopback: `answer(request)` gives each request's status and JSON body."""

    url: str
    answer: Callable[[Request], tuple[int, Any]] = lambda _: (404, {"error": {"message": "no route"}})
    seen: list[Request] = field(default_factory=list)


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def _any(self) -> None:
            headers = {k.lower(): v for k, v in self.headers.items()}
            request = Request(self.command, self.path, headers, self.rfile.read(int(headers.get("content-length", 0))))
            server.seen.append(request)
            status, body = server.answer(request)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _any

        def log_message(self, *_: Any) -> None:
            pass

    http_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server = StandIn(f"http://127.0.0.1:{http_server.server_address[1]}")
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    yield server
    http_server.shutdown()
    http_server.server_close()


def test_keys_send_the_servers_struct_and_read_its_answers(stand_in: StandIn) -> None:
    made = {k: v for k, v in KEY.items() if k not in ("prefix", "revoked_at")} | {"key": "sk-art-abcdefgh"}
    answers = {
        ("POST", "/v1/art/keys"): (201, made),
        ("GET", "/v1/art/keys"): (200, {"data": [KEY], "object": "list"}),
        ("GET", "/v1/art/keys?include_revoked=true"): (200, {"data": [KEY], "object": "list"}),
        ("DELETE", "/v1/art/keys/key%2F1"): (200, {**KEY, "revoked_at": 2.0}),
    }
    stand_in.answer = lambda r: answers[(r.method, r.path)]
    spec = KeyCreate(name="bot", models=["my-agent"], scopes=["infer", "read"], tpm=1000)
    with ArtClient(stand_in.url, "admin-secret") as client:
        assert client.create_key(spec).key == "sk-art-abcdefgh"
        assert [k.id for k in client.keys()] == ["key_1"]
        assert client.keys(include_revoked=True)[0].name == "bot"
        assert client.revoke_key("key/1").revoked_at == 2.0
    posted = stand_in.seen[0]
    assert posted.headers["content-type"] == "application/json"
    assert json.loads(posted.body) == {"name": "bot", "models": ["my-agent"], "scopes": ["infer", "read"],
                                       "rpm": None, "tpm": 1000, "read_keys": []}  # fmt: skip
    assert msgspec.json.decode(posted.body, type=KeyCreate) == spec  # what the server decodes it to
    assert {r.headers["authorization"] for r in stand_in.seen} == {"Bearer admin-secret"}


def test_groups_are_posted_and_read_page_by_page(stand_in: StandIn) -> None:
    pages: dict[str, dict[str, Any]] = {
        "/v1/art/groups?model=my-agent&limit=2": {"data": [group("a"), group("b")], "next_cursor": "c1"},
        "/v1/art/groups?model=my-agent&limit=2&cursor=c1": {"data": [group("c")], "next_cursor": None},
        "/v1/art/groups?state=trained&limit=100": {"data": [], "next_cursor": None},
    }

    def answer(r: Request) -> tuple[int, Any]:
        if r.method == "POST":
            return 201, group("g-1")
        if r.path.startswith("/v1/art/groups/"):
            return 200, group(r.path.rsplit("/", 1)[1])
        return 200, {**pages[r.path], "object": "list"}

    stand_in.answer = answer
    spec = GroupCreate(
        model="my-agent",
        rollouts=[RolloutIn("r1", 1.0, {"len": 3.0}), RolloutIn("r2/1")],
        ruler=RulerIn("openai/gpt-4o", litellm_params={"temperature": 0}),
        group_id="g-1",
    )
    with ArtClient(stand_in.url, "k") as client:
        assert client.post_group(spec, idempotency_key="once").id == "g-1"
        assert client.group("g-9").state == "ready"
        assert [g.id for g in client.groups(model="my-agent", page=2)] == ["a", "b", "c"]
        assert client.group_page(state="trained").data == []
    posted = stand_in.seen[0]
    assert (posted.method, posted.path, posted.headers["idempotency-key"]) == ("POST", "/v1/art/groups", "once")
    assert msgspec.json.decode(posted.body, type=GroupCreate) == spec
    assert [r.path for r in stand_in.seen[1:]] == ["/v1/art/groups/g-9", *pages]


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.create_key(KeyCreate(name="x")),
        lambda c: c.keys(),
        lambda c: c.revoke_key("key_1"),
        lambda c: c.post_group(GroupCreate("my-agent", [])),
        lambda c: c.group("g"),
        lambda c: list(c.groups()),
    ],
)
def test_each_call_tells_a_refusal_from_another_server(stand_in: StandIn, call: Callable[[ArtClient], Any]) -> None:
    with ArtClient(stand_in.url) as client:
        stand_in.answer = lambda _: (503, {"error": {"message": "the store is down"}})
        with pytest.raises(GatewayRefused, match="the store is down") as refused:
            call(client)
        assert refused.value.status == 503
        stand_in.answer = lambda _: (200, {"hello": "world"})  # 2xx, but not the API's answer
        with pytest.raises(NotAnArtGateway, match="not the ART gateway's"):
            call(client)


def test_artgw_keys_says_what_went_wrong_in_one_line(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ARTGW_ADMIN_KEY", "a" * 20)
    port = stand_in.url.rsplit(":", 1)[1]
    stand_in.answer = lambda _: (200, {"data": "nope"})
    assert cli.main(["keys", "list", "--port", port]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith(f"artgw keys list: {stand_in.url} did not answer like an ART gateway") and err.count("\n") == 1
    )
    stand_in.answer = lambda _: (404, {"error": {"message": "no such key"}})
    assert cli.main(["keys", "revoke", "key_9", "--port", port]) == 1
    assert capsys.readouterr().err == f"artgw keys revoke: {stand_in.url} answered 404: no such key\n"
    assert stand_in.seen[-1].path == "/v1/art/keys/key_9" and stand_in.seen[-1].method == "DELETE"
