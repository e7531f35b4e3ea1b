"""RULER panels: each member's criterion scores, check results and the judges' spread; each group's spread
and agreement

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27

A group scored before has none of these: NULL, as for a group scored by one judge without criteria or checks.
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("group_members") as batch:
        batch.add_column(sa.Column("ruler_criteria", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("ruler_spread", sa.Float(), nullable=True))
        batch.add_column(sa.Column("checks", sa.JSON(), nullable=True))
    with op.batch_alter_table("groups") as batch:
        batch.add_column(sa.Column("judge_spread", sa.Float(), nullable=True))
        batch.add_column(sa.Column("judge_agreement", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("groups") as batch:
        batch.drop_column("judge_agreement")
        batch.drop_column("judge_spread")
    with op.batch_alter_table("group_members") as batch:
        batch.drop_column("checks")
        batch.drop_column("ruler_spread")
        batch.drop_column("ruler_criteria")
