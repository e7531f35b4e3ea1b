"""How a call that continued its rollout was served

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28

`calls.continued`: spliced, or why it was served as sent (gateway/continuation.py `Served`), the
`artgw_continued_calls_total{how}` the call counted; NULL for a call that did not continue, and for calls recorded
before. A sequence split at such a call names that cause (`render_failed`, `template_mismatch`, `no_scale_out`)
rather than `rerendered`.
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.add_column(sa.Column("continued", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.drop_column("continued")
