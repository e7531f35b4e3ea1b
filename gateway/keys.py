"""Client API keys over HTTP (admin): make one (its secret shown once), list them, revoke one.

The key ring of this replica (gateway/auth.py) learns of a new or revoked key at once; other replicas on
the same store within a second.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.adapters import AdapterRegistry
from gateway.auth import KeyRing
from gateway.errors import invalid_request
from store.api import KeyCreate, KeyCreated, KeyList
from store.keys import ApiKey, create_key, list_keys, revoke_key, secret_hash


class KeyService:
    """`/v1/art/keys`: the store's key table and this replica's key ring, changed together."""

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
            # A grant names keys that exist (revoked ones too: what they made is still there to read).
            known = {key.id for key in await list_keys(conn, include_revoked=True)}
            for i, key_id in enumerate(spec.read_keys):
                if key_id not in known:
                    raise invalid_request(
                        f"No API key `{key_id}` to grant reading of (ids from GET /v1/art/keys).",
                        param=f"read_keys[{i}]",
                        code="key_not_found",
                    )
            key, secret = await create_key(
                conn,
                name=spec.name,
                models=sorted(set(spec.models)) if spec.models is not None else None,
                scopes=sorted(set(spec.scopes)),
                rpm=spec.rpm,
                tpm=spec.tpm,
                read_keys=spec.read_keys,
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
            read_keys=key.read_keys,
        )

    async def list_all(self, include_revoked: bool = False) -> KeyList:
        async with self.store.connect() as conn:
            return KeyList(await list_keys(conn, include_revoked=include_revoked))

    async def revoke(self, key_id: str) -> ApiKey:
        async with self.store.begin() as conn:
            key = await revoke_key(conn, key_id)
        self.ring.forget(key_id)
        return key
