"""Client API keys: made, listed, revoked. The secret is shown once, when made, and kept only as its SHA-256.

The gateway holds the live keys in memory (gateway/auth.py) and re-reads them here every second, so a
revocation on one replica reaches every replica of the same store within about a second.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from store.errors import NotFound
from store.tables import api_keys

# infer: every inference endpoint; reward: creating groups (RULER included); read: rollouts, groups, status.
Scope = Literal["infer", "reward", "read"]
SCOPES: tuple[Scope, ...] = ("infer", "reward", "read")
KEY_PREFIX = "sk-art-"  # a client key; the admin key has none, so the two are never confused


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)  # 256 random bits


class ApiKey(msgspec.Struct, frozen=True):
    """A key as listed: everything but the secret."""

    id: str
    name: str
    prefix: str  # the secret's first characters, to tell keys apart
    models: list[str] | None  # None: every model
    scopes: list[Scope]
    rpm: int | None  # requests per minute; None: no limit
    tpm: int | None  # tokens (prompt + completion) per minute; None: no limit
    created_at: float
    revoked_at: float | None = None
    object: str = "art.api_key"
    read_keys: list[str] = []  # other keys whose rollouts, groups and stored Responses it may read (none: its own)


class LiveKey(msgspec.Struct, frozen=True):
    """A key that works, with the hash its secret is checked against."""

    secret_sha256: str
    key: ApiKey


def _key(row: sa.Row[Any]) -> ApiKey:
    values = {str(k): v for k, v in row._asdict().items()}
    values.pop("secret_sha256", None)
    values["read_keys"] = values.get("read_keys") or []  # NULL: none
    return msgspec.convert(values, ApiKey)


async def create_key(
    conn: AsyncConnection,
    *,
    name: str,
    models: list[str] | None,
    scopes: list[Scope],
    rpm: int | None,
    tpm: int | None,
    read_keys: Sequence[str] = (),
) -> tuple[ApiKey, str]:
    """A new key; returns it and its secret (the only time the secret exists outside the client). `read_keys`:
    other keys whose things it may read (checked by the caller: keys that exist)."""
    secret = new_secret()
    values = {
        "id": "key_" + secrets.token_hex(8),
        "name": name,
        "secret_sha256": secret_hash(secret),
        "prefix": secret[: len(KEY_PREFIX) + 4],
        "models": models,
        "scopes": scopes,
        "rpm": rpm,
        "tpm": tpm,
        "created_at": time.time(),
        "revoked_at": None,
        "read_keys": sorted(set(read_keys)) or None,
    }
    await conn.execute(sa.insert(api_keys).values(**values))
    values.pop("secret_sha256")
    return msgspec.convert({**values, "read_keys": values["read_keys"] or []}, ApiKey), secret


async def list_keys(conn: AsyncConnection, *, include_revoked: bool = False) -> list[ApiKey]:
    query = sa.select(api_keys).order_by(api_keys.c.created_at, api_keys.c.id)
    if not include_revoked:
        query = query.where(api_keys.c.revoked_at.is_(None))
    return [_key(row) for row in await conn.execute(query)]


async def live_keys(conn: AsyncConnection) -> list[LiveKey]:
    """Every key not revoked, with its hash: what the gateway checks keys against."""
    rows = await conn.execute(sa.select(api_keys).where(api_keys.c.revoked_at.is_(None)))
    return [LiveKey(row.secret_sha256, _key(row)) for row in rows]


async def revoked_key_hashes(conn: AsyncConnection) -> frozenset[str]:
    """The hashes of revoked keys: refused everywhere, even where a request needs no key."""
    rows = await conn.execute(sa.select(api_keys.c.secret_sha256).where(api_keys.c.revoked_at.is_not(None)))
    return frozenset(rows.scalars())


async def revoke_key(conn: AsyncConnection, key_id: str) -> ApiKey:
    """Revoke at once (idempotent: a revoked key stays revoked, its first revocation time kept)."""
    await conn.execute(
        sa.update(api_keys)
        .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
        .values(revoked_at=time.time())
    )
    row = (await conn.execute(sa.select(api_keys).where(api_keys.c.id == key_id))).first()
    if row is None:
        raise NotFound(f"No API key `{key_id}`.", code="key_not_found")
    return _key(row)
