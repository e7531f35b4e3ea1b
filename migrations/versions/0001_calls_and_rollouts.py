"""calls and rollouts

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("explicit", sa.Boolean(), nullable=False),
        sa.Column("call_count", sa.Integer(), nullable=False),
        sa.Column("first_call_at", sa.Float(), nullable=False),
        sa.Column("last_call_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_rollouts"),
    )
    op.create_index("ix_rollouts_model", "rollouts", ["model"])
    op.create_index("ix_rollouts_last_call_at", "rollouts", ["last_call_at"])
    op.create_table(
        "calls",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=True),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("upstream_model", sa.String(512), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("prompt_token_ids", sa.JSON(), nullable=False),
        sa.Column("choices", sa.JSON(), nullable=False),
        sa.Column("usage", sa.JSON(), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("first_token_at", sa.Float(), nullable=True),
        sa.Column("ended_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_calls"),
    )
    op.create_index("ix_calls_rollout_id", "calls", ["rollout_id"])


def downgrade() -> None:
    op.drop_index("ix_calls_rollout_id", table_name="calls")
    op.drop_table("calls")
    op.drop_index("ix_rollouts_last_call_at", table_name="rollouts")
    op.drop_index("ix_rollouts_model", table_name="rollouts")
    op.drop_table("rollouts")
