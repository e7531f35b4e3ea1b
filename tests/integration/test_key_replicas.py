"""A key made or revoked on one replica counts on every replica of the same PostgreSQL store (each re-reads the
live keys every REFRESH_SECONDS, gateway/auth.py: within 2 s).

Two gateways on one PostgreSQL store in front of the stand-in engine (tests/stub_engine.py), sharing the admin
key the way a deployment does: from the environment (ARTGW_ADMIN_KEY), never on a command line. Each replica
re-reads the live keys from the store (gateway/auth.py), so this is the one guarantee replicas add.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from gateway.auth import REFRESH_SECONDS
from tests.conftest import GatewayProcess, holds, poll, start_stub, started_together, stop_group
from tests.key_helpers import CHAT_A, sent, serve

pytestmark = [pytest.mark.postgres]

ADMIN_KEY = "admin-" + secrets.token_urlsafe(24)


@pytest.fixture
def replicas(pg_database_url: str, tmp_path: Path) -> Iterator[list[GatewayProcess]]:
    stub, stub_proc = start_stub()
    env = {"ARTGW_ADMIN_KEY": ADMIN_KEY, "ARTGW_DB": pg_database_url}
    try:
        with started_together(
            [serve(tmp_path, stub, "--auth", "required", env=env, wait=False) for _ in range(2)]
        ) as both:
            yield both
    finally:
        stop_group(stub_proc)


def chat(gateway: GatewayProcess, secret: str) -> int:
    return httpx.post(f"{gateway.url}/v1/chat/completions", json=CHAT_A, headers=sent(secret), timeout=30).status_code


def until(check_status: int, gateway: GatewayProcess, secret: str, what: str) -> None:
    """Poll a chat call with `secret` through `gateway` until it answers `check_status`. The 2 s the README
    promises is the refresh interval (gateway/auth.py REFRESH_SECONDS); what this shows is that the
    other replica does learn of it, and how long that took here."""
    started = time.monotonic()
    poll(lambda: chat(gateway, secret) == check_status, 60, what, every=0.02)
    print(f"{what}: {(time.monotonic() - started) * 1000:.0f} ms")


def test_a_key_revoked_on_one_replica_is_refused_by_the_other_within_2_s(replicas: list[GatewayProcess]) -> None:
    one, two = replicas
    admin = sent(ADMIN_KEY)
    made = httpx.post(f"{one.url}/v1/art/keys", json={"name": "shared", "models": ["a"]}, headers=admin, timeout=30)
    assert made.status_code == 201, made.text
    key = made.json()
    assert chat(one, key["key"]) == 200  # the replica that made it knows it at once

    # The other replica learns of it from the store.
    until(200, two, key["key"], "made on replica 1, accepted by replica 2")
    assert httpx.get(f"{two.url}/v1/art/keys", headers=admin, timeout=30).json()["data"][0]["id"] == key["id"]

    revoked = httpx.delete(f"{one.url}/v1/art/keys/{key['id']}", headers=admin, timeout=30)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None, revoked.text
    assert chat(one, key["key"]) == 401  # at once where it was revoked
    until(401, two, key["key"], "revoked on replica 1, refused by replica 2")
    # And it stays refused (a later re-read of the store does not bring it back).
    holds(lambda: chat(two, key["key"]) == 401 == chat(one, key["key"]), 3 * REFRESH_SECONDS, "the refusal")

    # The admin key came from the environment: not in any replica's arguments, log or data dir.
    for gateway in replicas:
        assert ADMIN_KEY not in " ".join(psutil.Process(gateway.proc.pid).cmdline())
        assert ADMIN_KEY not in gateway.log()
        assert not (gateway.data_dir / "admin_key").exists()
