"""Who is calling: the admin key, client API keys, and each key's rate limits.

Every request names its key as `Authorization: Bearer <key>` (what the OpenAI SDK's `api_key` sends) or
`x-api-key` (Anthropic's SDK). `KeyRing.caller` turns that into a `Caller`: the admin (everything), a
client key (its models and scopes), or, with `--auth off`, a keyless caller that may infer and nothing more:
reading or changing recorded data (rollouts, rewards, groups, the UI) always takes a key with the scope. The
live keys sit in memory, by the SHA-256 of their secret, and are re-read from the store every second (with the
hashes of revoked keys, which are refused everywhere, `--auth off` too): a key revoked on any replica stops
working on every replica within about a second. Guards (gateway/guards.py) and the inference
handlers (gateway/apis/routes.py) ask it; handlers never look at keys themselves.

Rate limits are token buckets per key and per replica: `rpm` requests and `tpm` tokens a minute, both
refilled continuously, so a key is back to its full minute 60 s after it stopped.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.errors import OpenAIError, model_not_found
from store.access import EVERYTHING, Grant
from store.clock import SYSTEM_CLOCK, Clock
from store.keys import SCOPES, ApiKey, Scope, live_keys, revoked_key_hashes, secret_hash

log = logging.getLogger("artgw.auth")

REFRESH_SECONDS = 1.0  # how often the live keys are re-read: revocation reaches every replica within ~1 s


@dataclass(frozen=True, slots=True)
class Caller:
    """Who made a request, and what it may do."""

    key_id: str | None  # the client key's id (recorded with each call); None: the admin, or anonymous
    grant: Grant  # the models it may use and whose data it may see (store/access.py)
    scopes: frozenset[Scope]
    admin: bool = False
    keyless: bool = False  # --auth off, no key (or one the gateway never made): a scope it lacks is a 401
    rpm: int | None = None
    tpm: int | None = None

    def covers(self, model: str | None) -> bool:
        """May it use (or see the data of) `model`? The store's one rule (store/access.py)."""
        return self.grant.covers(model)

    def check_model(self, model: str, shown: str | None = None) -> None:
        """404 `model_not_found`, worded as for a model that does not exist: a key learns nothing of others'."""
        if not self.covers(model):
            raise model_not_found(shown or model)

    def check_scope(self, scope: Scope) -> None:
        if scope not in self.scopes and self.keyless:
            raise keyless_refused(scope)
        if scope not in self.scopes:
            has = ", ".join(sorted(self.scopes)) or "none"
            raise OpenAIError(
                403, f"This API key lacks the `{scope}` scope needed here (it has: {has}).", code="missing_scope"
            )


def keyless_refused(scope: Scope) -> OpenAIError:
    """What --auth off tells a keyless caller where it needs a key."""
    return OpenAIError(
        401,
        f"This endpoint needs an API key with the `{scope}` scope (or the admin key): without a key, "
        "--auth off lets in inference only.",
        code="invalid_api_key",
    )


ADMIN = Caller(key_id=None, grant=EVERYTHING, scopes=frozenset(SCOPES), admin=True)
# --auth off, a request without a key: inference on every model, and nothing recorded to read or change; it
# continues only rollouts and Responses made without a key, never a key's.
KEYLESS = Caller(key_id=None, grant=Grant(None), scopes=frozenset({"infer"}), keyless=True)


def client_caller(key: ApiKey) -> Caller:
    return Caller(
        key_id=key.id,
        grant=Grant(
            frozenset(key.models) if key.models is not None else None, owner=key.id, reads=frozenset(key.read_keys)
        ),
        scopes=frozenset(key.scopes),
        rpm=key.rpm,
        tpm=key.tpm,
    )


def bearer(headers: Mapping[str, str]) -> str | None:
    """The key a request carries: `Authorization: Bearer <key>`, else `x-api-key: <key>`."""
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return authorization.strip()  # a malformed header is a wrong key, not no key
    return headers.get("x-api-key") or None


def invalid_key(given: str | None) -> OpenAIError:
    if given is None:
        message = (
            "You didn't provide an API key. Send it as `Authorization: Bearer <key>` (the OpenAI SDK's api_key) "
            "or `x-api-key`; an admin makes keys with POST /v1/art/keys or `artgw keys create`."
        )
    else:
        shown = f"{given[:7]}...{given[-4:]}" if len(given) > 14 else "(hidden)"
        message = f"Incorrect API key provided: {shown}."
    return OpenAIError(401, message, code="invalid_api_key")


def same_secret(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())  # constant time


class KeyRing:
    """The live keys of this replica, checked in memory; `follow()` keeps them in step with the store."""

    def __init__(self, store: AsyncEngine, *, admin_key: str, required: bool, clock: Clock = SYSTEM_CLOCK) -> None:
        self.store = store
        self.admin_key = admin_key
        self.required = required  # --auth required: no key, no call
        self.clock = clock  # the pace of `follow`, and the rate limits' minutes
        self._by_hash: dict[str, Caller] = {}
        self._revoked: frozenset[str] = frozenset()  # the hashes of revoked keys: refused, --auth off too
        # Bumped by each key made or revoked here: a store read that was under way meanwhile may predate it.
        self._changes = 0
        self.limits = RateLimits(clock)

    def caller(self, headers: Mapping[str, str]) -> Caller:
        """The caller a request's headers name; 401 `invalid_api_key` for a revoked key, and for a missing or
        unknown key when auth is required (with --auth off, an unknown key is keyless: SDKs insist on sending
        some key)."""
        given = bearer(headers)
        if given is not None:
            if same_secret(given, self.admin_key):
                return ADMIN
            # A dict lookup by the secret's hash: what is compared is a hash, which tells nothing of the secret.
            digest = secret_hash(given)
            found = self._by_hash.get(digest)
            if found is not None:
                return found
            if digest in self._revoked:
                raise invalid_key(given)  # as OpenAI words a revoked key
        if self.required:
            raise invalid_key(given)
        return KEYLESS

    def admin_key_matches(self, given: str) -> bool:
        return same_secret(given, self.admin_key)

    def admin(self, headers: Mapping[str, str]) -> Caller:
        """The admin, or 401 (no key or a wrong one) / 403 (a client key): admin endpoints, whatever --auth."""
        given = bearer(headers)
        if given is not None and same_secret(given, self.admin_key):
            return ADMIN
        if given is not None and secret_hash(given) in self._by_hash:
            raise OpenAIError(
                403, "This endpoint needs the admin key; a client API key cannot use it.", code="admin_only"
            )
        raise OpenAIError(
            401,
            "This endpoint needs the admin key: `Authorization: Bearer <admin key>` (its file is printed when "
            "`artgw serve` starts).",
            code="invalid_api_key",
        )

    def by_key_id(self, key_id: str) -> Caller | None:
        """The live key with this id (a UI session names its key by id), or None: unknown or revoked."""
        return next((c for c in self._by_hash.values() if c.key_id == key_id), None)

    def replace(self, keys: list[tuple[str, ApiKey]], revoked: frozenset[str]) -> None:
        self._by_hash = {digest: client_caller(key) for digest, key in keys}
        self._revoked = revoked

    def forget(self, key_id: str) -> None:
        """Revoked here: refused by this replica at once (by the others on their next refresh)."""
        gone = frozenset(d for d, c in self._by_hash.items() if c.key_id == key_id)
        self._by_hash = {d: c for d, c in self._by_hash.items() if d not in gone}
        self._revoked |= gone
        self._changes += 1

    def add(self, digest: str, key: ApiKey) -> None:
        self._by_hash = {**self._by_hash, digest: client_caller(key)}
        self._changes += 1

    async def refresh(self, attempts: int = 3) -> None:
        """Re-read the live keys. A read during which a key was made or revoked here may have begun before
        that commit: applied, it would drop the new key, or bring the revoked one back, until the next read.
        Such a read is discarded and made again; keys still changing after `attempts` reads stay as they are
        here (this replica's own changes are already in them) until the next refresh."""
        for _ in range(attempts):
            seen = self._changes
            async with self.store.connect() as conn:
                live = await live_keys(conn)
                revoked = await revoked_key_hashes(conn)
            if self._changes == seen:
                self.replace([(k.secret_sha256, k.key) for k in live], revoked)
                return

    async def follow(self, every: float = REFRESH_SECONDS) -> None:
        """Re-read the keys forever; a store hiccup keeps the last good set (and is logged)."""
        while True:
            await self.clock.sleep(every)
            try:
                await self.refresh()
            except Exception as exc:
                log.warning("could not re-read the API keys from the store: %s", exc)


# ---------------------------------------------------------------- rate limits


@dataclass(slots=True)
class _Bucket:
    per_minute: int
    level: float  # what is left; the token bucket may go below 0 (a call's tokens are known only at its end)
    at: float  # when `level` was last refilled (the clock's monotonic seconds)

    def refill(self, now: float) -> None:
        self.level = min(float(self.per_minute), self.level + (now - self.at) * self.per_minute / 60.0)
        self.at = now

    def wait_for(self, need: float) -> float:
        """Seconds until the bucket holds `need`."""
        return (need - self.level) * 60.0 / self.per_minute


class RateLimits:
    """Requests and tokens per minute, per key, on this replica (N replicas: up to N times the limit)."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}

    @staticmethod
    def _bucket(buckets: dict[str, _Bucket], key_id: str, per_minute: int, now: float) -> _Bucket:
        bucket = buckets.get(key_id)
        if bucket is None or bucket.per_minute != per_minute:
            bucket = buckets[key_id] = _Bucket(per_minute, float(per_minute), now)
        else:
            bucket.refill(now)
        return bucket

    def admit(self, caller: Caller) -> None:
        """Take one request from the caller's minute, or 429 `rate_limit_exceeded` with Retry-After."""
        if caller.key_id is None or (caller.rpm is None and caller.tpm is None):
            return
        now = self.clock.monotonic()
        if caller.tpm is not None:
            tokens = self._bucket(self._tokens, caller.key_id, caller.tpm, now)
            if tokens.level < 1:  # a token at least: the Retry-After below counts to one
                raise _limited(f"{caller.tpm} tokens per minute", tokens.wait_for(1.0))
        if caller.rpm is not None:
            requests = self._bucket(self._requests, caller.key_id, caller.rpm, now)
            if requests.level < 1:
                raise _limited(f"{caller.rpm} requests per minute", requests.wait_for(1.0))
            requests.level -= 1

    def charge(self, caller: Caller, tokens: int) -> None:
        """A finished call's tokens (prompt + completion) count against the caller's tokens per minute."""
        if caller.key_id is None or caller.tpm is None or tokens <= 0:
            return
        self._bucket(self._tokens, caller.key_id, caller.tpm, self.clock.monotonic()).level -= tokens


def _limited(limit: str, seconds: float) -> OpenAIError:
    wait = max(1, math.ceil(seconds))
    error = OpenAIError(
        429, f"Rate limit reached for this API key: {limit}. Try again in {wait} s.", code="rate_limit_exceeded"
    )
    error.headers = {"Retry-After": str(wait)}
    return error


# ---------------------------------------------------------------- the admin key


def load_admin_key(given: str | None, path: Path) -> tuple[str, bool]:
    """The admin key: `given` (--admin-key / ARTGW_ADMIN_KEY), else the one in `path`, else a new one written
    there readable by its owner only (mode 0600). Returns (key, made). The key is never logged."""
    if given is not None:
        return given, False
    if path.exists():
        return _existing_admin_key(path), False
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    # O_EXCL: two replicas starting at once on one data dir don't overwrite each other's key.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # the other one made it first: its key, once written
        return _existing_admin_key(path), False
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    return key, True


def _existing_admin_key(path: Path, wait: float = 2.0) -> str:
    """The key in an existing key file. An empty file may be one another gateway has just created and is
    writing: it is read again for up to `wait` seconds; still empty, it is an error (an empty admin key would
    lock the admin out, every admin request a 401 with no word of why)."""
    deadline = time.monotonic() + wait
    while not (key := path.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not key:
        raise ValueError(
            f"the admin key file {path} is empty: delete it to have a new key made, or set ARTGW_ADMIN_KEY"
        )
    if path.stat().st_mode & 0o077:
        log.warning("the admin key file %s is readable by others: chmod 600 it", path)
    return key


def read_admin_key(given: str | None, path: Path) -> str | None:
    """For commands on the gateway's machine (train, status, keys): `given`, else the key file, else None."""
    if given:
        return given
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None
