"""The store's tables (SQLAlchemy Core). The schema itself is only ever created by `migrations/`."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(column_0_label)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

# One row per rollout: the unit a group's reward attaches to.
rollouts = sa.Table(
    "rollouts",
    metadata,
    sa.Column("id", sa.String(128), primary_key=True),
    sa.Column("model", sa.String(256), nullable=True, index=True),  # trainable model, NULL for base calls
    sa.Column("explicit", sa.Boolean, nullable=False),  # False: one-call rollout, id made by the gateway
    sa.Column("call_count", sa.Integer, nullable=False),
    sa.Column("first_call_at", sa.Float, nullable=False),
    sa.Column("last_call_at", sa.Float, nullable=False, index=True),
)

# One row per call that reached the gateway, exactly once.
calls = sa.Table(
    "calls",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("rollout_id", sa.String(128), nullable=False, index=True),
    sa.Column("model", sa.String(256), nullable=True),
    sa.Column("step", sa.Integer, nullable=True),  # adapter step that served it; 0 = base weights
    sa.Column("upstream_model", sa.String(512), nullable=False),
    sa.Column("stream", sa.Boolean, nullable=False),
    sa.Column("status", sa.String(32), nullable=False),  # ok | cancelled | upstream_error
    sa.Column("http_status", sa.Integer, nullable=False),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("request", sa.JSON, nullable=False),  # the client's request body
    sa.Column("prompt_token_ids", sa.JSON, nullable=False),
    sa.Column("choices", sa.JSON, nullable=False),  # list of ChoiceRecord (message, token ids, logprobs)
    sa.Column("usage", sa.JSON, nullable=True),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("first_token_at", sa.Float, nullable=True),
    sa.Column("ended_at", sa.Float, nullable=False),
)
