"""Anthropic's message threads kept beside stored Responses

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30

Every row before this revision is a Response: the new `api` column says so by default. `carried` holds what a
thread's every turn takes from it (`system`, `tools`); NULL for a Response.
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("responses") as batch:
        batch.add_column(sa.Column("api", sa.String(16), nullable=False, server_default="responses"))
        batch.add_column(sa.Column("carried", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("responses") as batch:
        batch.drop_column("carried")
        batch.drop_column("api")
