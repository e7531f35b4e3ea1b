"""promotion of trained steps: their history, offline eval sets, the gate's evaluations, single rewards;
the adapters' load and unload history

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23

`NAME` now serves the promoted step, `NAME@latest` the newest. A store from before served the newest
committed step as `NAME`: that step is recorded as promoted, so an upgraded gateway serves what it did.
"""

import time

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    promotions = op.create_table(
        "promotions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("previous_step", sa.Integer(), nullable=True),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_promotions"),
    )
    op.create_index("ix_promotions_model", "promotions", ["model"])
    op.create_table(
        "adapter_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("event", sa.String(16), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_adapter_events"),
    )
    op.create_index("ix_adapter_events_model", "adapter_events", ["model"])
    op.create_table(
        "rewards",
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("reward", sa.Float(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("rollout_id", name="pk_rewards"),
    )
    op.create_index("ix_rewards_model", "rewards", ["model"])
    op.create_table(
        "eval_sets",
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("model", "name", name="pk_eval_sets"),
    )
    op.create_table(
        "evaluations",
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("eval_set", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("scores", sa.JSON(), nullable=True),
        sa.Column("mean", sa.Float(), nullable=True),
        sa.Column("baseline_step", sa.Integer(), nullable=True),
        sa.Column("baseline_mean", sa.Float(), nullable=True),
        sa.Column("ci_low", sa.Float(), nullable=True),
        sa.Column("ci_high", sa.Float(), nullable=True),
        sa.Column("margin", sa.Float(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("model", "step", "eval_set", name="pk_evaluations"),
    )
    # What each model served before: its newest committed step, recorded as promoted.
    conn = op.get_bind()
    newest = conn.execute(
        sa.text("SELECT model, MAX(step) FROM adapters WHERE status IN ('loaded', 'unloaded') GROUP BY model")
    ).all()
    if newest:
        now = time.time()
        op.bulk_insert(
            promotions,
            [
                {
                    "model": model,
                    "step": step,
                    "previous_step": None,
                    "action": "promote",
                    "actor": "migration",
                    "reason": "served before promotion gates existed",
                    "created_at": now,
                }
                for model, step in newest
            ],
        )


def downgrade() -> None:
    op.drop_table("evaluations")
    op.drop_table("eval_sets")
    op.drop_index("ix_rewards_model", table_name="rewards")
    op.drop_index("ix_adapter_events_model", table_name="adapter_events")
    op.drop_table("adapter_events")
    op.drop_table("rewards")
    op.drop_index("ix_promotions_model", table_name="promotions")
    op.drop_table("promotions")
