"""Rollout ids are a namespace per owner: every table names a rollout by (owner, id)

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28

A rollout's owner is the key of its first call made with one (`rollouts.key_id`), "" where there was none (the
admin's, --auth off's). Its calls, its group membership and its single reward take that owner, so everything
recorded before reads back under the same ids, each by its owner (the admin reads any). A group's owner is
its members'. Downgrading needs every rollout id to be one owner's again: it fails where two owners use one id.
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

OWNER = sa.String(64)


def _owner_column(name: str) -> sa.Column[str]:
    return sa.Column(name, OWNER, nullable=False, server_default="")


def upgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(_owner_column("owner"))
    op.execute("UPDATE rollouts SET owner = COALESCE(key_id, '')")
    # While a rollout id is still one rollout, every row that names it takes its owner.
    of_rollout = "(SELECT r.owner FROM rollouts r WHERE r.id = {table}.rollout_id)"
    for table, column in (("calls", "rollout_owner"), ("group_members", "rollout_owner"), ("rewards", "owner")):
        with op.batch_alter_table(table) as batch:
            batch.add_column(_owner_column(column))
        op.execute(f"UPDATE {table} SET {column} = COALESCE({of_rollout.format(table=table)}, '')")
    with op.batch_alter_table("groups") as batch:
        batch.add_column(_owner_column("owner"))
    op.execute(
        "UPDATE groups SET owner = COALESCE((SELECT MIN(m.rollout_owner) FROM group_members m"
        " WHERE m.group_id = groups.id), '')"
    )

    with op.batch_alter_table("rollouts") as batch:
        batch.drop_constraint("pk_rollouts", type_="primary")
        batch.create_primary_key("pk_rollouts", ["owner", "id"])
    with op.batch_alter_table("calls") as batch:
        batch.drop_index("ix_calls_rollout_id")
        batch.create_index("ix_calls_rollout_owner", ["rollout_owner", "rollout_id"])
    with op.batch_alter_table("group_members") as batch:
        batch.drop_constraint("uq_group_members_rollout_ref", type_="unique")
        batch.create_unique_constraint("uq_group_members_rollout_owner", ["rollout_owner", "rollout_ref"])
        batch.drop_index("ix_group_members_rollout_id")
        batch.create_index("ix_group_members_rollout_owner", ["rollout_owner", "rollout_id"])
    with op.batch_alter_table("groups") as batch:
        batch.create_index("ix_groups_owner", ["owner"])
    with op.batch_alter_table("rewards") as batch:
        batch.drop_constraint("pk_rewards", type_="primary")
        batch.create_primary_key("pk_rewards", ["owner", "rollout_id"])


def downgrade() -> None:
    with op.batch_alter_table("rewards") as batch:
        batch.drop_constraint("pk_rewards", type_="primary")
        batch.create_primary_key("pk_rewards", ["rollout_id"])
        batch.drop_column("owner")
    with op.batch_alter_table("groups") as batch:
        batch.drop_index("ix_groups_owner")
        batch.drop_column("owner")
    with op.batch_alter_table("group_members") as batch:
        batch.drop_index("ix_group_members_rollout_owner")
        batch.create_index("ix_group_members_rollout_id", ["rollout_id"])
        batch.drop_constraint("uq_group_members_rollout_owner", type_="unique")
        batch.create_unique_constraint("uq_group_members_rollout_ref", ["rollout_ref"])
        batch.drop_column("rollout_owner")
    with op.batch_alter_table("calls") as batch:
        batch.drop_index("ix_calls_rollout_owner")
        batch.create_index("ix_calls_rollout_id", ["rollout_id"])
        batch.drop_column("rollout_owner")
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_constraint("pk_rollouts", type_="primary")
        batch.create_primary_key("pk_rollouts", ["id"])
        batch.drop_column("owner")
