"""Group ids are a namespace per owner, as rollout ids are: a keyed owner's group is stored as `<owner>/<id>`

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28

Two keys' `g1` are two groups (store.groups.group_key): the store's id of a key's group is `<key id>/<id>` (a
client's group id never holds a `/`), the owner "" (the admin's, --auth off's) keeps its ids. The id columns
widen to hold an owner, a `/` and a 128-character id. The members' foreign key is dropped while the ids move
(it has no ON UPDATE) and made again; on SQLite, whose foreign keys are on, the members' table is copied
without it first, so copying `groups` cascades nothing. Downgrading needs every group id to be one owner's
again: it fails where two owners use one id.
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

FK = "fk_group_members_group_id_groups"
OLD = sa.String(128)
NEW = sa.String(64 + 1 + 128)
# A member's group is its group's owner's (0012: `rollout_owner` is its group's owner).
OWNER_OF_GROUP = "(SELECT g.owner FROM groups g WHERE g.id = group_members.group_id)"


def _drop_foreign_key() -> None:
    with op.batch_alter_table("group_members") as batch:
        batch.drop_constraint(FK, type_="foreignkey")


def _make_foreign_key() -> None:
    with op.batch_alter_table("group_members") as batch:
        batch.create_foreign_key(FK, "groups", ["group_id"], ["id"], ondelete="CASCADE")


def _retype(old: sa.String, new: sa.String) -> None:
    with op.batch_alter_table("group_members") as batch:
        batch.alter_column("group_id", type_=new, existing_type=old, existing_nullable=False)
    with op.batch_alter_table("groups") as batch:
        batch.alter_column("id", type_=new, existing_type=old, existing_nullable=False)


def _rename(members_key: str, groups_key: str) -> None:
    # Members first: they find their group's owner by its id as it still is.
    op.execute(f"UPDATE group_members SET group_id = {members_key} WHERE {OWNER_OF_GROUP} <> ''")
    op.execute(f"UPDATE groups SET id = {groups_key} WHERE owner <> ''")


def upgrade() -> None:
    _drop_foreign_key()
    _retype(OLD, NEW)
    _rename(f"{OWNER_OF_GROUP} || '/' || group_id", "owner || '/' || id")
    _make_foreign_key()


def downgrade() -> None:
    _drop_foreign_key()
    # `<owner>/<id>` -> `<id>`: what follows the owner and its `/`.
    _rename(f"SUBSTR(group_id, LENGTH({OWNER_OF_GROUP}) + 2)", "SUBSTR(id, LENGTH(owner) + 2)")
    _retype(NEW, OLD)
    _make_foreign_key()
