"""RULER's judge answers, cached in the store by a hash of (judge, rubric, trajectories): shared by every
gateway replica, so a retried group costs no judge call."""

from __future__ import annotations

import time

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from store.tables import judge_cache


class StoreJudgeCache:
    """RULER's `JudgeCache` protocol over the store."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def get(self, key: str) -> str | None:
        async with self.engine.connect() as conn:
            query = sa.select(judge_cache.c.value).where(judge_cache.c.key == key)
            return (await conn.execute(query)).scalar_one_or_none()

    async def put(self, key: str, value: str) -> None:
        # ON CONFLICT: two replicas judging the same group at once both put; the first answer stays.
        async with self.engine.begin() as conn:
            insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
            await conn.execute(
                insert(judge_cache)
                .values(key=key, value=value, created_at=time.time())
                .on_conflict_do_nothing(index_elements=["key"])
            )
