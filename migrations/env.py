"""Alembic environment: runs on the connection the store hands over (see store/db.py)."""

from __future__ import annotations

from alembic import context

from store.tables import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise SystemExit("run migrations with `artgw migrate [--db URL]`")

context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
