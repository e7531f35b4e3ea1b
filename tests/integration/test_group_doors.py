"""#40, items 1 and 2: a `reward` key names neither where RULER's judge calls go (litellm adds the gateway's own
provider key to them) nor where a group check's webhook posts, and a check's error tells it nothing about the
addresses behind the gateway.

A real gateway (`--auth required`, a stand-in engine) with real listeners on 127.0.0.1: the operator's judge is
a stand-in (tests/stand_in_judge.py: no paid judge runs here), and so is the listener a caller would like the
gateway's key sent to. The operator's settings travel as ARTGW_JUDGES_FILE and ARTGW_GROUP_WEBHOOK, which a
gateway without them ignores: there these tests show the doors open instead of failing to start.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from store import create_engine
from store.groups import NewGroup, NewMember, insert_group
from tests.conftest import GatewayProcess, poll, start_gateway, start_stub, stop_group
from tests.stand_in_judge import StandInJudge, write_judges

PROVIDER_KEY = "sk-the-gateways-own-provider-key"  # what litellm would add to a call to an `openai/...` model
HOUSE = "openai/house"  # the operator's judge: a name litellm knows, so a gateway without a judges file finds it too
WEBHOOK_FAILED = "webhook failed (the gateway's log says why)"


class Listener:
    """An HTTP server on 127.0.0.1 that keeps every request it gets (path, headers) and answers by its path:
    `.../401` a 401, `.../bad` a 200 that is no reward, anything else `{"reward": 1}`."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                listener.requests.append((self.path, dict(self.headers)))
                status, body = (401, b"no") if self.path.endswith("/401") else (200, b'{"reward": 1}')
                if self.path.endswith("/bad"):
                    body = b"not json"
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def by_length(blocks: list[tuple[str, str]], _request: dict[str, Any]) -> dict[str, Any]:
    return {"scores": {tid: {"explanation": "measured", "score": min(1.0, len(text) / 400)} for tid, text in blocks}}


@dataclass
class Site:
    gateway: GatewayProcess
    tenant: dict[str, str]  # the headers of a key with `infer`, `reward` and `read` on my-agent
    house: StandInJudge  # the operator's judge, in the judges file
    intruder: StandInJudge  # where a caller would like judge calls (and the gateway's key) to go
    hook: Listener  # the operator's webhook endpoint: {hook.url}/reward
    closed: int  # a port nothing listens on, also allowed: http://127.0.0.1:{closed}/reward


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    house, intruder, hook = StandInJudge(by_length), StandInJudge(by_length), Listener()
    held = socket.socket()  # bound, never listening: connections to it are refused
    held.bind(("127.0.0.1", 0))
    closed = held.getsockname()[1]
    where = tmp_path_factory.mktemp("doors")
    env = {
        "OPENAI_API_KEY": PROVIDER_KEY,  # as the README tells operators to set it for RULER
        "OPENAI_API_BASE": house.params["api_base"],  # where a gateway without a judges file finds HOUSE
        "ARTGW_JUDGES_FILE": str(write_judges(where / "judges.json", {HOUSE: house})),
        "ARTGW_GROUP_WEBHOOK": f"{hook.url}/reward,http://127.0.0.1:{closed}/reward",
    }
    url, stub = start_stub()
    try:
        gateway = start_gateway(where, "--upstream", url, "--auth", "required", env=env, isolated=True)
        try:
            made = httpx.post(
                f"{gateway.base_url}/art/keys",
                headers=gateway.admin,
                json={"name": "tenant", "models": ["my-agent"], "scopes": ["infer", "reward", "read"]},
                timeout=30,
            )
            assert made.status_code == 201, made.text
            tenant = {"Authorization": f"Bearer {made.json()['key']}"}
            yield Site(gateway, tenant, house, intruder, hook, closed)
        finally:
            gateway.stop()
    finally:
        stop_group(stub)
        held.close()
        for server in (house, intruder, hook):
            server.close()


def rollouts(site: Site, n: int = 2) -> list[dict[str, Any]]:
    """`n` rollouts of the tenant's, of different lengths (so the stand-in judge tells them apart)."""
    made = []
    for i in range(n):
        rid = f"door-{uuid.uuid4().hex[:10]}"
        r = httpx.post(
            f"{site.gateway.base_url}/chat/completions",
            json={"model": "my-agent", "messages": [{"role": "user", "content": "hi" + "!" * 40 * i}]},
            headers={**site.tenant, "X-ART-Rollout-Id": rid},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        made.append({"rollout_id": rid})
    return made


def post_group(site: Site, members: list[dict[str, Any]], ruler: dict[str, Any]) -> httpx.Response:
    body = {"model": "my-agent", "rollouts": members, "ruler": ruler}
    return httpx.post(f"{site.gateway.base_url}/art/groups", json=body, headers=site.tenant, timeout=30)


def scored(site: Site, group_id: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        group = httpx.get(f"{site.gateway.base_url}/art/groups/{group_id}", headers=site.tenant, timeout=10).json()
        return None if group["state"] == "scoring" else group

    return poll(done, 60, f"RULER to score group {group_id}", every=0.25)


def test_a_reward_key_cannot_send_the_gateways_provider_key_to_an_address_it_names(site: Site) -> None:
    """Before #40 the first request was a 201, and the listener it named got `Authorization: Bearer
    <OPENAI_API_KEY>` from litellm. Now a group names the operator's judges, and a caller's litellm_params never
    carry an endpoint, a key or headers: each attempt is a 400 naming the parameter, and nothing reaches the
    listener, while the operator's judge scores a group that picks it by name."""
    members = rollouts(site)
    elsewhere = site.intruder.params["api_base"]
    attempts = [
        ({"judge_model": "openai/gpt-4o-mini", "litellm_params": {"api_base": elsewhere}}, "judge_model",
         "unknown_judge"),
        ({"judge_model": HOUSE, "litellm_params": {"api_base": elsewhere}}, "litellm_params.api_base", None),
        ({"judge_model": HOUSE, "litellm_params": {"base_url": elsewhere}}, "litellm_params.base_url", None),
        ({"judge_model": HOUSE, "litellm_params": {"api_key": "sk-mine"}}, "litellm_params.api_key", None),
        (
            {"judge_model": HOUSE, "litellm_params": {"extra_headers": {"x-forward-to": elsewhere}}},
            "litellm_params.extra_headers",
            None,
        ),
        (
            {"judges": [{"judge_model": HOUSE}, {"judge_model": HOUSE, "litellm_params": {"api_base": elsewhere}}]},
            "judges[1].litellm_params.api_base",
            None,
        ),
        ({"judges": [{"judge_model": "hosted_vllm/mine"}]}, "judges[0].judge_model", "unknown_judge"),
    ]  # fmt: skip
    for ruler, field, code in attempts:
        r = post_group(site, members, ruler)
        assert r.status_code == 400, (ruler, r.status_code, r.text)
        error = r.json()["error"]
        assert error["param"] == f"ruler.{field}" and error["code"] == (code or "judge_param_not_allowed"), error
        assert elsewhere not in error["message"]

    # The operator's judge, with a sampling parameter a caller may choose: scored by the judge of the file.
    made = post_group(site, members, {"judge_model": HOUSE, "litellm_params": {"temperature": 0}})
    assert made.status_code == 201, made.text
    group = scored(site, made.json()["id"])
    assert group["state"] == "ready", group["failure_reason"]
    assert group["ruler"]["judge_model"] == HOUSE and group["ruler"]["litellm_params"] == {"temperature": 0}
    assert site.house.calls >= 1 and set(site.house.authorizations) == {"Bearer unused"}  # the operator's key
    assert (site.intruder.calls, site.intruder.authorizations) == (0, [])


def test_a_reward_key_cannot_make_the_gateway_post_where_it_says(site: Site) -> None:
    """Before #40 a check's webhook posted to any http(s) URL a caller gave. Now only at or under an endpoint the
    operator allows, refused at the POST otherwise (however the URL is dressed up), with one answer whatever
    is at the address."""
    members = rollouts(site)
    other = Listener()
    posted = len(site.hook.requests)
    try:
        hook, port = site.hook, site.hook.port
        urls = [
            f"{other.url}/reward",  # another port of the same host
            f"https://127.0.0.1:{port}/reward",  # another scheme
            f"{hook.url}/admin",
            f"{hook.url}/rewards",  # not under `/reward`: whole path segments
            f"{hook.url}/reward/../admin",
            f"{hook.url}/reward/%2e%2e/admin",
            f"http://127.0.0.1:{port}@127.0.0.1:{other.port}/reward",  # user info, then the host it goes to
        ]
        for url in urls:
            check = {"grader": {"type": "webhook", "url": url, "retries": 0}}
            r = post_group(site, members, {"judge_model": HOUSE, "checks": [check]})
            assert r.status_code == 400, (url, r.status_code, r.text)
            error = r.json()["error"]
            assert (error["code"], error["param"]) == ("webhook_not_allowed", "ruler.checks[0].grader.url"), error
        assert (other.requests, hook.requests[posted:]) == ([], [])
    finally:
        other.close()


def test_a_checks_error_tells_a_reader_nothing_about_the_address(site: Site) -> None:
    """Before #40 `checks[].error` (any `read` key sees it) told a refused connection, an HTTP 401 and a bad reply
    apart: a port scanner. Now each failed webhook says the same; the why is in the gateway's log."""
    members = rollouts(site)
    checks = [
        {"grader": {"type": "webhook", "url": url, "retries": 0, "timeout_seconds": 5}}
        for url in (
            f"{site.hook.url}/reward/ok",
            f"{site.hook.url}/reward/401",
            f"{site.hook.url}/reward/bad",
            f"http://127.0.0.1:{site.closed}/reward",
        )
    ]
    made = post_group(site, members, {"judge_model": HOUSE, "checks": checks})
    assert made.status_code == 201, made.text
    group = scored(site, made.json()["id"])
    assert group["state"] == "ready", group["failure_reason"]
    for member in group["rollouts"]:
        outcomes = [(c["passed"], c["error"]) for c in member["checks"]]
        assert outcomes == [(True, None)] + [(False, WEBHOOK_FAILED)] * 3, json.dumps(member["checks"])
        assert member["reward"] == 0.0  # a failed hard check zeroes it
    log = site.gateway.log()
    assert "HTTP 401" in log and "ConnectError" in log  # the operator still learns why


async def leave_scoring(db_path: Path, group_id: str, rollout_ids: list[str], ruler: dict[str, Any]) -> None:
    """A group left `scoring` in the store with this `ruler`, as a gateway before #40 stored what a caller sent."""
    engine = create_engine(f"sqlite+aiosqlite:///{db_path}")
    try:
        async with engine.begin() as conn:
            members = [NewMember(i, rid, rid, None, None, None, None) for i, rid in enumerate(rollout_ids)]
            await insert_group(conn, NewGroup(group_id, "my-agent", "scoring", "h", None, ruler, None, members, ""))
    finally:
        await engine.dispose()


def test_a_stored_group_is_not_judged_where_its_caller_said_after_a_restart(tmp_path: Path) -> None:
    """A group a gateway before #40 accepted with a caller's `api_base`, left `scoring` by a stop: the restarted
    gateway judges it only with what its operator allows now, so it fails, says why, and the listener it names
    gets nothing (before: judged there, with the gateway's provider key)."""
    house, intruder = StandInJudge(by_length), StandInJudge(by_length)
    env = {
        "OPENAI_API_KEY": PROVIDER_KEY,
        "ARTGW_JUDGES_FILE": str(write_judges(tmp_path / "judges.json", {HOUSE: house})),
    }
    url, stub = start_stub()
    try:
        first = start_gateway(tmp_path, "--upstream", url, env=env, isolated=True)
        try:
            made = []
            for i in range(2):
                rid = f"stored-{i}-{uuid.uuid4().hex[:8]}"
                chat = {"model": "my-agent", "messages": [{"role": "user", "content": "hi" + "!" * 40 * i}]}
                r = httpx.post(f"{first.base_url}/chat/completions", json=chat, headers=rid_header(rid), timeout=30)
                assert r.status_code == 200, r.text
                made.append(rid)
            poll(lambda: all(recorded(first, rid) for rid in made), 30, "the calls in the store")
        finally:
            first.stop()
        ruler = {"judge_model": "openai/gpt-4o-mini", "litellm_params": {"api_base": intruder.params["api_base"]}}
        asyncio.run(leave_scoring(first.db_path, "g-stored", made, ruler))
        again = start_gateway(tmp_path, "--upstream", url, "--data-dir", str(first.data_dir), env=env, isolated=True)

        def judged() -> dict[str, Any] | None:
            group = httpx.get(f"{again.base_url}/art/groups/g-stored", headers=first.admin, timeout=10).json()
            return None if group["state"] == "scoring" else group

        try:
            group = poll(judged, 60, "the restarted gateway to judge the stored group", every=0.25)
        finally:
            again.stop()
    finally:
        stop_group(stub)
        house.close()
        intruder.close()
    assert group["state"] == "failed" and "Unknown judge `openai/gpt-4o-mini`" in group["failure_reason"], group
    assert (intruder.calls, intruder.authorizations) == (0, [])


def rid_header(rollout_id: str) -> dict[str, str]:
    return {"X-ART-Rollout-Id": rollout_id}


def recorded(gateway: GatewayProcess, rollout_id: str) -> bool:
    return httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", headers=gateway.admin).status_code == 200
