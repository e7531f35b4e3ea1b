"""the API each call was made with; stored Responses API objects

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23

Calls made before this revision were all chat completions: the new column says so by default.
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("api", sa.String(16), nullable=False, server_default="chat"))
    op.create_table(
        "responses",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_responses"),
    )


def downgrade() -> None:
    op.drop_table("responses")
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("api")
