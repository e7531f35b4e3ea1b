"""Which engine served each call

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27

`calls.engine`: the base URL of the engine that served the call, now that one gateway sends calls to several
(engine/pool.py); NULL for calls recorded before.
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("engine", sa.String(512), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("engine")
