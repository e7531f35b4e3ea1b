"""Stored Responses belong to the key that made them

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27

A response stored before has NULL: made without a key (the admin, or --auth off), as far as anyone can tell now;
only the admin may read, continue or delete it with a key.
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("responses") as batch:
        batch.add_column(sa.Column("key_id", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("responses") as batch:
        batch.drop_column("key_id")
