"""compact calls: each call stored as what it adds to an earlier call of its rollout; binary ids and logprobs

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23

Until 0003 every call stored its whole prompt token ids and request (all messages) as JSON: a rollout of N
calls that re-sends its growing conversation cost O(N²). From 0004 a call refers to an earlier call of its
rollout and keeps only the rest (store/codec.py has the format). Existing rows are converted rollout by
rollout, each call against the ones before it (by start time, then id); the downgrade expands them back.

The conversion uses store/codec.py: its formats are the stored format from this revision on, so changing
them means a new revision.
"""

from collections.abc import Iterator
from itertools import groupby
from typing import Any

import msgspec
import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

from store.codec import Head, compact, expand
from store.records import CallRecord

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

PAGE = 1000  # rollouts counted per query
CALLS_PER_QUERY = 256  # calls loaded (and converted) at a time, fewer than a page: bounded memory
KEEP = 4  # earlier calls of a rollout each call may be stored against, as the recorder's cache keeps

# Both layouts' columns, for the data passes (the real table is whatever the batch operations left).
_calls = sa.table(
    "calls",
    sa.column("id", sa.String()),
    sa.column("rollout_id", sa.String()),
    sa.column("model", sa.String()),
    sa.column("step", sa.Integer()),
    sa.column("upstream_model", sa.String()),
    sa.column("stream", sa.Boolean()),
    sa.column("status", sa.String()),
    sa.column("http_status", sa.Integer()),
    sa.column("error", sa.Text()),
    sa.column("request", sa.JSON(none_as_null=True)),
    sa.column("prompt_token_ids", sa.JSON()),
    sa.column("choices", sa.JSON()),
    sa.column("usage", sa.JSON()),
    sa.column("started_at", sa.Float()),
    sa.column("first_token_at", sa.Float()),
    sa.column("ended_at", sa.Float()),
    sa.column("base_call_id", sa.String()),
    sa.column("messages_base_choice", sa.Integer()),
    sa.column("messages_prefix_len", sa.Integer()),
    sa.column("messages_suffix", sa.JSON(none_as_null=True)),
    sa.column("prompt_base_choice", sa.Integer()),
    sa.column("prompt_prefix_len", sa.Integer()),
    sa.column("prompt_suffix", sa.LargeBinary()),
    sa.column("completion_ids", sa.LargeBinary()),
    sa.column("completion_logprobs", sa.LargeBinary()),
)
_COMMON = (
    "id",
    "rollout_id",
    "model",
    "step",
    "upstream_model",
    "stream",
    "status",
    "http_status",
    "error",
    "usage",
    "started_at",
    "first_token_at",
    "ended_at",
)
_OLD = (*_COMMON, "request", "prompt_token_ids", "choices")
_NEW = (
    *_COMMON,
    "request",
    "choices",
    "base_call_id",
    "messages_base_choice",
    "messages_prefix_len",
    "messages_suffix",
    "prompt_base_choice",
    "prompt_prefix_len",
    "prompt_suffix",
    "completion_ids",
    "completion_logprobs",
)
_NEW_ONLY = [name for name in _NEW if name not in _OLD]


def _rollouts(conn: Connection, columns: tuple[str, ...]) -> Iterator[list[dict[str, Any]]]:
    """Each rollout's rows (those columns), oldest call first; a few hundred calls in memory at a time (a
    rollout with more: that one rollout)."""
    last: str | None = None
    while True:
        query = (
            sa.select(_calls.c.rollout_id, sa.func.count())
            .group_by(_calls.c.rollout_id)
            .order_by(_calls.c.rollout_id)
            .limit(PAGE)
        )
        if last is not None:
            query = query.where(_calls.c.rollout_id > last)
        page = [(rollout_id, count) for rollout_id, count in conn.execute(query)]
        if not page:
            return
        last = page[-1][0]
        chunk: list[str] = []
        calls = 0
        for rollout_id, count in page:
            if chunk and calls + count > CALLS_PER_QUERY:
                yield from _load(conn, columns, chunk)
                chunk, calls = [], 0
            chunk.append(rollout_id)
            calls += count
        yield from _load(conn, columns, chunk)


def _load(conn: Connection, columns: tuple[str, ...], rollout_ids: list[str]) -> Iterator[list[dict[str, Any]]]:
    rows = conn.execute(
        sa.select(*(_calls.c[name] for name in columns))
        .where(_calls.c.rollout_id.in_(rollout_ids))
        .order_by(_calls.c.rollout_id, _calls.c.started_at, _calls.c.id)
    )
    # Materialized before any update: no cursor is open on the table while it changes.
    plain = [{str(k): v for k, v in row._mapping.items()} for row in rows]
    for _, group in groupby(plain, key=lambda row: row["rollout_id"]):
        yield list(group)


def _update(conn: Connection, rows: list[dict[str, Any]]) -> None:
    if rows:
        # executemany: the SET clause is the keys of the parameter sets, `_id` picks the row.
        conn.execute(sa.update(_calls).where(_calls.c.id == sa.bindparam("_id")), rows)


def _compact_existing(conn: Connection) -> None:
    updates: list[dict[str, Any]] = []
    for rows in _rollouts(conn, _OLD):
        heads: list[Head] = []
        for row in rows:
            record = msgspec.convert({**row, "call_id": row["id"], "rollout_explicit": True}, CallRecord)
            compacted, head = compact(record, heads)
            heads = [*heads, head][-KEEP:]
            updates.append({"_id": row["id"], **{k: compacted[k] for k in ("request", "choices", *_NEW_ONLY)}})
        if len(updates) >= CALLS_PER_QUERY:
            _update(conn, updates)
            updates = []
    _update(conn, updates)


def _expand_existing(conn: Connection) -> None:
    updates: list[dict[str, Any]] = []
    for rows in _rollouts(conn, _NEW):
        for record in expand(rows, explicit=True):
            updates.append(
                {
                    "_id": record.call_id,
                    "request": record.request,
                    "prompt_token_ids": record.prompt_token_ids,
                    "choices": msgspec.to_builtins(record.choices),
                }
            )
        if len(updates) >= CALLS_PER_QUERY:
            _update(conn, updates)
            updates = []
    _update(conn, updates)


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("base_call_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("messages_base_choice", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("messages_prefix_len", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("messages_suffix", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("prompt_base_choice", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("prompt_prefix_len", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("prompt_suffix", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("completion_ids", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("completion_logprobs", sa.LargeBinary(), nullable=True))
        batch.alter_column("request", existing_type=sa.JSON(), nullable=True)  # NULL: the base call's
    _compact_existing(op.get_bind())
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("prompt_token_ids")
        batch.alter_column("prompt_prefix_len", existing_type=sa.Integer(), nullable=False)
        batch.alter_column("prompt_suffix", existing_type=sa.LargeBinary(), nullable=False)
        batch.alter_column("completion_ids", existing_type=sa.LargeBinary(), nullable=False)
        batch.alter_column("completion_logprobs", existing_type=sa.LargeBinary(), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("prompt_token_ids", sa.JSON(), nullable=True))
    _expand_existing(op.get_bind())
    with op.batch_alter_table("calls") as batch:
        batch.alter_column("prompt_token_ids", existing_type=sa.JSON(), nullable=False)
        batch.alter_column("request", existing_type=sa.JSON(), nullable=False)
        for name in reversed(_NEW_ONLY):
            batch.drop_column(name)
