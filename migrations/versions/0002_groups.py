"""groups, group members, judge cache

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "groups",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("failure_reason", sa.Text(), nullable=True),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("ruler", sa.JSON(), nullable=True),
        sa.Column("judge_usage", sa.JSON(), nullable=True),
        sa.Column("no_signal", sa.Boolean(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("lease_owner", sa.String(128), nullable=True),
        sa.Column("lease_expires_at", sa.Float(), nullable=True),
        sa.Column("trained_step", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_groups"),
    )
    op.create_index("ix_groups_model", "groups", ["model"])
    op.create_index("ix_groups_state", "groups", ["state"])
    op.create_index("ix_groups_created_at", "groups", ["created_at"])
    op.create_table(
        "group_members",
        sa.Column("group_id", sa.String(128), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("rollout_ref", sa.String(140), nullable=False),
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("choice", sa.Integer(), nullable=True),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("caller_reward", sa.Float(), nullable=True),
        sa.Column("ruler_score", sa.Float(), nullable=True),
        sa.Column("ruler_explanation", sa.Text(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(
            ["group_id"], ["groups.id"], name="fk_group_members_group_id_groups", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("group_id", "position", name="pk_group_members"),
        sa.UniqueConstraint("rollout_ref", name="uq_group_members_rollout_ref"),
    )
    op.create_index("ix_group_members_rollout_id", "group_members", ["rollout_id"])
    op.create_table(
        "judge_cache",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_judge_cache"),
    )


def downgrade() -> None:
    op.drop_table("judge_cache")
    op.drop_index("ix_group_members_rollout_id", table_name="group_members")
    op.drop_table("group_members")
    op.drop_index("ix_groups_created_at", table_name="groups")
    op.drop_index("ix_groups_state", table_name="groups")
    op.drop_index("ix_groups_model", table_name="groups")
    op.drop_table("groups")
