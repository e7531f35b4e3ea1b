"""Fixtures of the store tests: an empty database of each kind, and an engine on it migrated to head."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from store import create_engine, migrate
from tests.conftest import fresh_pg_database


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """An empty database of the test's own, SQLite or PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'store.sqlite'}"
        return
    async with fresh_pg_database(request.getfixturevalue("pg_server_url")) as url:
        yield url


@pytest.fixture
async def engine(store_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine on a database migrated to head."""
    engine = create_engine(store_url)
    try:
        await migrate(engine, "head")
        yield engine
    finally:
        await engine.dispose()
