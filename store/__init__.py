"""The store: SQLAlchemy async over SQLite (default) or PostgreSQL; schema by Alembic only."""

from store.db import create_engine, downgrade, migrate

__all__ = ["create_engine", "downgrade", "migrate"]
