"""Whether the gateway that served a call held its rollout's last call

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-30

NULL for calls recorded before: not known. A call whose gateway had lost the rollout's last call (a restart,
another replica) starts a sequence whose split says so (`state_lost`) rather than `rerendered`.
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("rollout_known", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("rollout_known")
