"""Client API keys over HTTP (admin): make one (its secret shown once), list them, revoke one.

The key ring of this replica (gateway/auth.py) learns of a new or revoked key at once; other replicas on
the same store within a second.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.adapters import AdapterRegistry
from gateway.auth import KeyRing
from gateway.errors import invalid_request
from store.keys import ApiKey, Scope, create_key, list_keys, revoke_key, secret_hash

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
PerMinute = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]


class KeyCreate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/art/keys`: who the key is for and what it may do."""

    name: Name
    models: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=1000)] | None = None  # None: every model
    scopes: Annotated[list[Scope], msgspec.Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["infer"])
    rpm: PerMinute | None = None  # requests per minute (per replica); None: no limit
    tpm: PerMinute | None = None  # prompt + completion tokens per minute (per replica); None: no limit


class KeyCreated(msgspec.Struct, frozen=True):
    """The new key, with its secret: shown this once, stored only as a hash."""

    id: str
    key: str
    name: str
    models: list[str] | None
    scopes: list[Scope]
    rpm: int | None
    tpm: int | None
    created_at: float
    object: str = "art.api_key"


class KeyList(msgspec.Struct, frozen=True):
    data: list[ApiKey]
    object: str = "list"


class KeyService:
    def __init__(self, store: AsyncEngine, ring: KeyRing, registry: AdapterRegistry) -> None:
        self.store = store
        self.ring = ring
        self.registry = registry

    async def create(self, spec: KeyCreate) -> KeyCreated:
        if spec.models is not None:
            known = {*self.registry.models, self.registry.base_model}
            for i, name in enumerate(spec.models):
                if name not in known:
                    raise invalid_request(
                        f"The model `{name}` does not exist (add it with POST /v1/art/models first).",
                        param=f"models[{i}]",
                        code="model_not_found",
                    )
        async with self.store.begin() as conn:
            key, secret = await create_key(
                conn,
                name=spec.name,
                models=sorted(set(spec.models)) if spec.models is not None else None,
                scopes=sorted(set(spec.scopes)),  # type: ignore[arg-type]
                rpm=spec.rpm,
                tpm=spec.tpm,
            )
        self.ring.add(secret_hash(secret), key)
        return KeyCreated(
            id=key.id,
            key=secret,
            name=key.name,
            models=key.models,
            scopes=key.scopes,
            rpm=key.rpm,
            tpm=key.tpm,
            created_at=key.created_at,
        )

    async def list_all(self, include_revoked: bool = False) -> KeyList:
        async with self.store.connect() as conn:
            return KeyList(await list_keys(conn, include_revoked=include_revoked))

    async def revoke(self, key_id: str) -> ApiKey:
        async with self.store.begin() as conn:
            key = await revoke_key(conn, key_id)
        self.ring.forget(key_id)
        return key
