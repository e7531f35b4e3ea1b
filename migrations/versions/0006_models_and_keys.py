"""trainable models kept in the store; client API keys; the key each call was made with

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23

The set of trainable models moves from each gateway's command line into the store, so replicas and
restarts agree; the models of earlier calls, groups and adapters are registered as they are found.
"""

import time

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    models = op.create_table(
        "models",
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("retired_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("name", name="pk_models"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("secret_sha256", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("models", sa.JSON(), nullable=True),
        sa.Column("scopes", sa.JSON(), nullable=False),
        sa.Column("rpm", sa.Integer(), nullable=True),
        sa.Column("tpm", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.UniqueConstraint("secret_sha256", name="uq_api_keys_secret_sha256"),
    )
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("key_id", sa.String(64), nullable=True))
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("key_id", sa.String(64), nullable=True))
        batch.create_index("ix_rollouts_key_id", ["key_id"])
    # Models a store already knows (from its groups and adapters) stay known.
    conn = op.get_bind()
    known = {
        row[0]
        for table in ("groups", "adapters")
        for row in conn.execute(sa.text(f"SELECT DISTINCT model FROM {table}"))
        if row[0]
    }
    if known:
        op.bulk_insert(models, [{"name": name, "created_at": time.time(), "retired_at": None} for name in known])


def downgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_index("ix_rollouts_key_id")
        batch.drop_column("key_id")
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("key_id")
    op.drop_table("api_keys")
    op.drop_table("models")
