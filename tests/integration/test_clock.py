"""Rate limits, the key ring's refresh and the canary watcher go by the clock they are given (store/clock.py).

Each gateway runs in this process (tests/inprocess.py) on a `ManualClock` that stands still until the test
moves it, in front of the stand-in engine: what these tests show happens when the clock says so, and nothing
waits for real time to pass. (test_keys and test_key_replicas show the same on the real clock, end to end;
the leases' clock is the `now` the trainer gives the store, tests/integration/test_store.py.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.auth import REFRESH_SECONDS
from gateway.settings import Settings
from tests.conftest import holds, poll, start_stub, stop_group
from tests.inprocess import InProcessGateway, ManualClock, serve_in_process

MODEL = "my-agent"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    url, proc = start_stub()
    yield url
    stop_group(proc)


def settings(tmp_path: Path, stub_url: str, **fields: object) -> Settings:
    return Settings(**{"upstream": (stub_url,), "data_dir": tmp_path, "auth": "required", **fields})  # type: ignore[arg-type]


def chat(gateway: InProcessGateway, secret: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.base_url}/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {secret}"}, timeout=30
    )


def make_key(gateway: InProcessGateway, **limits: int) -> dict[str, str]:
    body = {"name": "clocked", "models": [MODEL], "scopes": ["infer"], **limits}
    made = httpx.post(f"{gateway.base_url}/art/keys", json=body, headers=gateway.admin, timeout=30)
    assert made.status_code == 201, made.text
    return made.json()


def retry_after(r: httpx.Response) -> int:
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
    return int(r.headers["Retry-After"])


@pytest.mark.parametrize(("limit", "calls"), [({"rpm": 2}, 2), ({"tpm": 8}, 2)], ids=["rpm", "tpm"])
def test_a_limited_key_is_admitted_again_when_its_retry_after_has_passed(
    tmp_path: Path, stub_url: str, limit: dict[str, int], calls: int
) -> None:
    """rpm 2: a request back every 30 s. tpm 8: each stand-in call spends 4 tokens (3 prompt, 1 sampled),
    so two calls empty the bucket and one token comes back every 7.5 s."""
    clock = ManualClock()
    with serve_in_process(settings(tmp_path, stub_url), clock) as gateway:
        secret = make_key(gateway, **limit)["key"]
        assert [chat(gateway, secret).status_code for _ in range(calls)] == [200] * calls
        wait = retry_after(chat(gateway, secret))
        assert wait == (30 if "rpm" in limit else 8)
        # Any number of refused calls while the clock stands still: still refused, the wait unchanged.
        assert [retry_after(chat(gateway, secret)) for _ in range(3)] == [wait] * 3
        clock.advance(wait - 1)
        assert retry_after(chat(gateway, secret)) == 1
        clock.advance(1.001)
        assert chat(gateway, secret).status_code == 200


def test_a_replica_learns_of_keys_made_and_revoked_elsewhere_on_its_refresh(tmp_path: Path, stub_url: str) -> None:
    """Two gateways on one store, each on its own clock: the second sees the first's key changes when its own
    refresh comes round (REFRESH_SECONDS on its clock), and not before."""
    one_clock, two_clock = ManualClock(), ManualClock()
    shared = {"db": f"sqlite+aiosqlite:///{tmp_path / 'shared.sqlite'}", "admin_key": "sk-admin-" + "x" * 32}
    with (
        serve_in_process(settings(tmp_path / "one", stub_url, **shared), one_clock) as one,
        serve_in_process(settings(tmp_path / "two", stub_url, **shared), two_clock) as two,
    ):
        key = make_key(one)
        assert chat(one, key["key"]).status_code == 200  # known at once where it was made
        # The other has not refreshed, for longer than its refresh takes on the real clock: its clock stood still.
        holds(lambda: chat(two, key["key"]).status_code == 401, 1.5 * REFRESH_SECONDS, "replica two's refusal")
        two_clock.advance(REFRESH_SECONDS)
        poll(lambda: chat(two, key["key"]).status_code == 200, 30, "replica two to learn of the new key")

        revoked = httpx.delete(f"{one.base_url}/art/keys/{key['id']}", headers=one.admin, timeout=30)
        assert revoked.status_code == 200, revoked.text
        assert chat(one, key["key"]).status_code == 401
        assert chat(two, key["key"]).status_code == 200  # until its next refresh
        two_clock.advance(REFRESH_SECONDS)
        poll(lambda: chat(two, key["key"]).status_code == 401, 30, "replica two to learn of the revocation")


def test_the_canary_is_decided_on_the_watchers_clock(tmp_path: Path, stub_url: str) -> None:
    """A canary with every reward in is decided on the live-reward watcher's next round (every 1 s of its
    clock), and not before: the clock standing still, the canary keeps running."""
    clock = ManualClock()
    fields = {"auth": "off", "promotion": "gated", "canary": 0.5, "canary_min_rewards": 2}
    with serve_in_process(settings(tmp_path, stub_url, **fields), clock) as gateway:
        adapter = tmp_path / "step-1"
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
        loaded = httpx.post(
            f"{gateway.base_url}/art/models/{MODEL}/adapters",
            json={"step": 1, "path": str(adapter)},
            headers=gateway.admin,
            timeout=60,
        )
        assert loaded.status_code == 200, loaded.text
        poll(lambda: status(gateway)["canary_step"] == 1, 30, "step 1's canary to start")
        arms: dict[int, list[str]] = {0: [], 1: []}
        n = 0
        while min(len(a) for a in arms.values()) < 2:
            rollout_id = f"canary-{n}"
            n += 1
            r = httpx.post(
                f"{gateway.base_url}/chat/completions", json=CHAT, headers={"X-ART-Rollout-Id": rollout_id}, timeout=30
            )
            assert r.status_code == 200, r.text
            step = poll(lambda rid=rollout_id: rollout_step(gateway, rid), 30, f"{rollout_id} to be recorded")
            arms[step - 1].append(rollout_id)
        for step, ids in arms.items():
            for rollout_id in ids:
                value = 1.0 if step == 1 else 0.0
                body = {"rollout_id": rollout_id, "reward": value}
                given = httpx.post(f"{gateway.base_url}/art/rewards", json=body, timeout=30, headers=gateway.admin)
                assert given.status_code == 201, given.text
        # Every reward is in, but the watcher's clock stands still: undecided for longer than a real round.
        holds(lambda: status(gateway)["canary_step"] == 1, 1.5, "the canary to run on")
        clock.advance(1.0)
        decided = poll(lambda: (s := status(gateway))["served_step"] == 1 and s, 30, "the canary to be decided")
        assert decided["canary_step"] is None
        assert (decided["promotions"][0]["actor"], decided["promotions"][0]["action"]) == ("canary", "promote")


def status(gateway: InProcessGateway) -> dict[str, object]:
    answer = httpx.get(f"{gateway.base_url}/art/models/{MODEL}", timeout=10, headers=gateway.admin)
    answer.raise_for_status()
    return answer.json()


def rollout_step(gateway: InProcessGateway, rollout_id: str) -> int | None:
    """1 + the step that served the rollout's call, once it is recorded (so step 0 is truthy too)."""
    answer = httpx.get(f"{gateway.base_url}/art/rollouts/{rollout_id}", timeout=10, headers=gateway.admin)
    if answer.status_code != 200:
        return None
    return int(answer.json()["calls"][0]["step"]) + 1
