"""The pure parts of gateway/auth.py: what a key covers, the token buckets, the admin key file."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gateway.auth import ADMIN, KEYLESS, Caller, RateLimits, bearer, load_admin_key, read_admin_key
from gateway.errors import OpenAIError
from gateway.local_only import host_name, is_json, origin_name
from store.access import Grant
from store.clock import SystemClock


class Clock(SystemClock):
    """The buckets' clock, moved by the test (`now`)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def key(*, rpm: int | None = None, tpm: int | None = None, models: set[str] | None = None) -> Caller:
    grant = Grant(frozenset(models) if models else None, owner="key_1")  # as client_caller makes it
    return Caller(key_id="key_1", grant=grant, scopes=frozenset({"infer"}), rpm=rpm, tpm=tpm)


def retry_after(limits: RateLimits, caller: Caller) -> int:
    with pytest.raises(OpenAIError) as caught:
        limits.admit(caller)
    assert (caught.value.status, caught.value.code) == (429, "rate_limit_exceeded")
    assert caught.value.headers is not None
    return int(caught.value.headers["Retry-After"])


def test_a_key_covers_its_models_and_their_pinned_steps_only() -> None:
    caller = key(models={"a"})
    assert caller.covers("a") and not caller.covers("b") and not caller.covers(None)
    assert caller.grant.covers_id("a@3") and not caller.grant.covers_id("b@3")
    assert ADMIN.covers(None) and KEYLESS.covers("anything") and KEYLESS.scopes == {"infer"}
    with pytest.raises(OpenAIError) as caught:
        caller.check_model("b")
    assert (caught.value.status, caught.value.code) == (404, "model_not_found")


def test_a_missing_scope_is_a_403_naming_it() -> None:
    with pytest.raises(OpenAIError) as caught:
        key().check_scope("read")
    assert (caught.value.status, caught.value.code) == (403, "missing_scope")
    assert "`read`" in caught.value.message and "infer" in caught.value.message


def test_bearer_and_x_api_key_are_read_and_a_malformed_header_is_a_wrong_key() -> None:
    assert bearer({"authorization": "Bearer sk-1"}) == "sk-1"
    assert bearer({"authorization": "bearer  sk-1 "}) == "sk-1"
    assert bearer({"x-api-key": "sk-2"}) == "sk-2"
    assert bearer({"authorization": "Basic abc"}) == "Basic abc"  # never "no key": it is checked and refused
    assert bearer({}) is None


def test_requests_per_minute_refill_one_every_60_over_rpm_seconds(clock: Clock) -> None:
    limits, caller = RateLimits(clock), key(rpm=6)  # one request back every 10 s
    for _ in range(6):
        limits.admit(caller)
    assert retry_after(limits, caller) == 10
    clock.now += 9.0
    assert retry_after(limits, caller) == 1  # 0.9 of a request back: 1 s to go
    clock.now += 1.0
    limits.admit(caller)
    clock.now += 60.0  # a whole minute idle: the bucket is full again, never fuller
    for _ in range(6):
        limits.admit(caller)
    assert retry_after(limits, caller) == 10


def test_tokens_per_minute_are_charged_after_the_call_and_may_overdraw(clock: Clock) -> None:
    limits, caller = RateLimits(clock), key(tpm=600)  # 10 tokens a second
    limits.admit(caller)
    limits.charge(caller, 900)  # the call used more than the minute holds: 300 in debt
    assert retry_after(limits, caller) == 31  # (300 + 1) tokens / 10 per s, rounded up
    clock.now += 30.05  # 0.5 of a token back: still refused, as the Retry-After said
    assert retry_after(limits, caller) == 1
    clock.now += 0.95
    limits.admit(caller)


def test_keys_without_limits_and_the_admin_are_never_limited(clock: Clock) -> None:
    limits = RateLimits(clock)
    for _ in range(1000):
        limits.admit(key())
        limits.admit(ADMIN)


def test_the_admin_key_file_is_made_once_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "data" / "admin_key"
    made, created = load_admin_key(None, path)
    assert created and len(made) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_admin_key(None, path) == (made, False)  # the next start finds it
    assert read_admin_key(None, path) == made
    assert load_admin_key("k" * 20, tmp_path / "other") == ("k" * 20, False)
    assert not (tmp_path / "other").exists()  # a given key is never written anywhere
    assert read_admin_key(None, tmp_path / "missing") is None


def test_what_a_caller_owns_is_its_keys_not_its_models() -> None:
    """#40: a key covers its models' data to read, but owns (may join, read back, continue) only what it made;
    the admin owns everything, a keyless caller only what was made without a key."""
    mine = key(models={"a"})
    neighbour = Caller(key_id="key_n", grant=Grant(frozenset({"a"}), owner="key_n"), scopes=frozenset({"infer"}))
    assert mine.grant.owns(mine.key_id) and not neighbour.grant.owns(mine.key_id)
    assert ADMIN.grant.owns(mine.key_id) and ADMIN.grant.owns(None)
    assert KEYLESS.grant.owns(None) and not KEYLESS.grant.owns(mine.key_id)


@pytest.mark.parametrize(
    ("value", "name"),
    [
        ("127.0.0.1:8000", "127.0.0.1"),
        ("[::1]:8000", "::1"),
        ("LocalHost.:80", "localhost"),
        ("evil.example", "evil.example"),
    ],
)
def test_a_host_header_names_its_host(value: str, name: str) -> None:
    assert host_name(value) == name


def test_an_origin_names_its_host_and_null_names_none() -> None:
    assert origin_name("http://127.0.0.1:8000") == "127.0.0.1"
    assert origin_name("https://[::1]") == "::1"
    assert origin_name("null") == "" and origin_name("file:///x") == ""


def test_json_bodies_only() -> None:
    assert (
        is_json("application/json") and is_json("Application/JSON; charset=utf-8") and is_json("application/vnd.x+json")
    )
    assert not any(is_json(t) for t in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""))
