"""The store: SQLAlchemy async over SQLite (default) or PostgreSQL; schema by Alembic only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from store.db import create_engine, downgrade, migrate

__all__ = ["create_engine", "downgrade", "migrate"]


def __getattr__(name: str) -> Any:
    """`store.db`'s entry points, imported on first use: whoever needs only the store's types (`store.records`,
    `store.types`: every `artgw` command that opens no database) does not load SQLAlchemy and Alembic (~0.4 s of
    CPU)."""
    if name in __all__:
        from store import db

        return getattr(db, name)
    raise AttributeError(f"module 'store' has no attribute {name!r}")
