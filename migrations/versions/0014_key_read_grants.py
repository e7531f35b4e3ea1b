"""A key may be granted to read other keys' rollouts, groups and stored Responses

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28

`api_keys.read_keys`: the ids of the keys whose things it may read (store.access.Grant.reads), given by the
admin when the key is made; NULL (every key made before): none, its own only.
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("read_keys", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("read_keys")
