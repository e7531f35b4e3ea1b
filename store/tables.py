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

# Rollout ids are a namespace per owner: the key that made the rollout ("" for none: the admin's, --auth off's).
# Every table that names a rollout names it by (owner, id) (store.records.RolloutKey).
OWNER = sa.String(64)
# Group ids too (store.groups.group_key): a group's key is `<owner>/<id>`, or its id for the owner "".
GROUP_KEY = sa.String(64 + 1 + 128)

# One row per rollout: the unit a group's reward attaches to.
rollouts = sa.Table(
    "rollouts",
    metadata,
    sa.Column("owner", OWNER, primary_key=True, server_default=""),
    sa.Column("id", sa.String(128), primary_key=True),
    sa.Column("model", sa.String(256), nullable=True, index=True),  # trainable model, NULL for base calls
    sa.Column("explicit", sa.Boolean, nullable=False),  # False: one-call rollout, id made by the gateway
    sa.Column("call_count", sa.Integer, nullable=False),
    sa.Column("first_call_at", sa.Float, nullable=False),
    sa.Column("last_call_at", sa.Float, nullable=False, index=True),
    sa.Column("key_id", sa.String(64), nullable=True, index=True),  # the API key of its first call (not secret)
)

# One row per call that reached the gateway, exactly once, in the compact form of store/codec.py: stored
# against an earlier call of its rollout (`base_call_id`), a call keeps only what it adds to it, and token ids
# and logprobs are binary. A rollout's storage grows linearly with its length.
calls = sa.Table(
    "calls",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("rollout_owner", OWNER, nullable=False, server_default=""),
    sa.Column("rollout_id", sa.String(128), nullable=False),
    sa.Column("model", sa.String(256), nullable=True),
    sa.Column("step", sa.Integer, nullable=True),  # adapter step that served it; 0 = base weights
    sa.Column("upstream_model", sa.String(512), nullable=False),
    sa.Column("stream", sa.Boolean, nullable=False),
    sa.Column("api", sa.String(16), nullable=False, server_default="chat"),  # store.records.Api
    sa.Column("key_id", sa.String(64), nullable=True),  # the API key that made it (its id; NULL: no key)
    sa.Column("rollout_known", sa.Boolean, nullable=True),  # store.records.CallRecord.rollout_known
    sa.Column("engine", sa.String(512), nullable=True),  # store.records.CallRecord.engine
    sa.Column("continued", sa.String(32), nullable=True),  # store.records.CallRecord.continued
    sa.Column("status", sa.String(32), nullable=False),  # store.records.CallStatus
    sa.Column("http_status", sa.Integer, nullable=False),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("base_call_id", sa.String(64), nullable=True),  # an earlier call of the same rollout; NULL: whole
    # The client's request body without its messages; NULL: the same as the base call's.
    sa.Column("request", sa.JSON(none_as_null=True), nullable=True),
    # The request's messages: the first `messages_prefix_len` of the base's messages followed by its choice
    # `messages_base_choice`'s message (NULL: no choice), then `messages_suffix`. NULL: no messages list.
    sa.Column("messages_base_choice", sa.Integer, nullable=True),
    sa.Column("messages_prefix_len", sa.Integer, nullable=True),
    sa.Column("messages_suffix", sa.JSON(none_as_null=True), nullable=True),
    # The prompt token ids, the same way: a prefix of the base's prompt + sampled ids of `prompt_base_choice`.
    sa.Column("prompt_base_choice", sa.Integer, nullable=True),
    sa.Column("prompt_prefix_len", sa.Integer, nullable=False),
    sa.Column("prompt_suffix", sa.LargeBinary, nullable=False),  # format byte + int32 little-endian ids
    # Each choice's index, message, finish_reason and its counts of `tokens` and `logprobs`; the sampled ids
    # and logprobs of all choices, concatenated, are in the two blobs.
    sa.Column("choices", sa.JSON, nullable=False),
    sa.Column("completion_ids", sa.LargeBinary, nullable=False),
    sa.Column("completion_logprobs", sa.LargeBinary, nullable=False),  # format byte + float32 (or float64)
    sa.Column("usage", sa.JSON, nullable=True),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("first_token_at", sa.Float, nullable=True),
    sa.Column("ended_at", sa.Float, nullable=False),
    sa.Index("ix_calls_rollout_owner", "rollout_owner", "rollout_id"),
)

# A group: several attempts at one task, the unit GRPO compares.
groups = sa.Table(
    "groups",
    metadata,
    sa.Column("id", GROUP_KEY, primary_key=True),
    sa.Column("model", sa.String(256), nullable=False, index=True),
    sa.Column("owner", OWNER, nullable=False, server_default="", index=True),  # whose rollouts it groups
    sa.Column("state", sa.String(16), nullable=False, index=True),  # scoring|ready|training|trained|failed
    sa.Column("failure_reason", sa.Text, nullable=True),
    sa.Column("request_hash", sa.String(64), nullable=False),  # same id + other content = a conflict
    sa.Column("metadata", sa.JSON, nullable=True),
    sa.Column("ruler", sa.JSON, nullable=True),  # judge model, rubric, non-secret litellm params
    sa.Column("judge_usage", sa.JSON, nullable=True),
    sa.Column("no_signal", sa.Boolean, nullable=True),  # every reward equal: nothing for GRPO to learn
    sa.Column("judge_spread", sa.Float, nullable=True),  # RULER panels: the judgements' mean disagreement
    sa.Column("judge_agreement", sa.Float, nullable=True),  # ... and their mean pairwise Spearman
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("updated_at", sa.Float, nullable=False),
    # The trainer's claim: a lease that returns the group to `ready` if the trainer dies.
    sa.Column("lease_owner", sa.String(128), nullable=True),
    sa.Column("lease_expires_at", sa.Float, nullable=True),
    sa.Column("trained_step", sa.Integer, nullable=True),
)

# The rollouts of a group; a rollout (or one choice of an n > 1 call) belongs to at most one group.
group_members = sa.Table(
    "group_members",
    metadata,
    sa.Column("group_id", GROUP_KEY, sa.ForeignKey("groups.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("position", sa.Integer, primary_key=True),
    sa.Column("rollout_owner", OWNER, nullable=False, server_default=""),  # its group's owner
    sa.Column("rollout_ref", sa.String(140), nullable=False),  # "rid" or "rid/<choice>"
    sa.Column("rollout_id", sa.String(128), nullable=False),
    sa.Column("choice", sa.Integer, nullable=True),
    sa.Column("reward", sa.Float, nullable=True),  # what GRPO uses; NULL while scoring
    sa.Column("caller_reward", sa.Float, nullable=True),
    sa.Column("ruler_score", sa.Float, nullable=True),
    sa.Column("ruler_explanation", sa.Text, nullable=True),
    sa.Column("ruler_criteria", sa.JSON, nullable=True),  # criterion -> score, with criteria
    sa.Column("ruler_spread", sa.Float, nullable=True),  # how much the judgements disagree on this rollout
    sa.Column("checks", sa.JSON, nullable=True),  # each rule check's outcome
    sa.Column("metrics", sa.JSON, nullable=True),
    sa.UniqueConstraint("rollout_owner", "rollout_ref", name="uq_group_members_rollout_owner"),
    sa.Index("ix_group_members_rollout_owner", "rollout_owner", "rollout_id"),
)

# RULER's judge answers by hash of (judge model, rubric, trajectories): a retried group costs nothing.
judge_cache = sa.Table(
    "judge_cache",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

# Every adapter step a trainer produced, and what became of it: the history of what served each model.
adapters = sa.Table(
    "adapters",
    metadata,
    sa.Column("model", sa.String(256), primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True),
    sa.Column("path", sa.Text, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),  # loaded | unloaded | failed | broken
    sa.Column("metrics", sa.JSON, nullable=True),  # the training step's metrics
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("group_count", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("served_at", sa.Float, nullable=True),  # when `model` started to mean this step
)

# Every load of an adapter into the engine, unload from it, and refused load: the adapters' history.
adapter_events = sa.Table(
    "adapter_events",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("model", sa.String(256), nullable=False, index=True),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("event", sa.String(16), nullable=False),  # loaded | unloaded | load_failed
    sa.Column("detail", sa.Text, nullable=True),
    sa.Column("at", sa.Float, nullable=False),
)

# What `NAME` serves: every promotion and rollback, newest last. The newest row of a model is its promoted step.
promotions = sa.Table(
    "promotions",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("model", sa.String(256), nullable=False, index=True),
    sa.Column("step", sa.Integer, nullable=False),  # what `NAME` serves from now on; 0 = the base weights
    sa.Column("previous_step", sa.Integer, nullable=True),
    sa.Column("action", sa.String(16), nullable=False),  # promote | rollback
    sa.Column("actor", sa.String(16), nullable=False),  # always | gate | admin | migration
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

# Rewards of single rollouts, posted after the fact (POST /v1/art/rewards): with the groups' rewards, what a
# canary's arms are judged by (each rollout counts for the step that served it).
rewards = sa.Table(
    "rewards",
    metadata,
    sa.Column("owner", OWNER, primary_key=True, server_default=""),
    sa.Column("rollout_id", sa.String(128), primary_key=True),
    sa.Column("model", sa.String(256), nullable=False, index=True),
    sa.Column("reward", sa.Float, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

# Offline eval sets that gate promotion: scenarios (a chat request and its grader) per model and name.
eval_sets = sa.Table(
    "eval_sets",
    metadata,
    sa.Column("model", sa.String(256), primary_key=True),
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("spec", sa.JSON, nullable=False),  # scenarios and samples, as posted
    sa.Column("created_at", sa.Float, nullable=False),
)

# One step evaluated on one eval set: its per-scenario rewards, and the gate's verdict against the promoted step.
evaluations = sa.Table(
    "evaluations",
    metadata,
    sa.Column("model", sa.String(256), primary_key=True),
    sa.Column("step", sa.Integer, primary_key=True),
    sa.Column("eval_set", sa.String(128), primary_key=True),
    sa.Column("status", sa.String(16), nullable=False),  # running | passed | failed | error
    sa.Column("scores", sa.JSON, nullable=True),  # mean reward per scenario, in the set's order
    sa.Column("mean", sa.Float, nullable=True),
    sa.Column("baseline_step", sa.Integer, nullable=True),
    sa.Column("baseline_mean", sa.Float, nullable=True),
    sa.Column("ci_low", sa.Float, nullable=True),  # of the mean paired difference candidate - baseline
    sa.Column("ci_high", sa.Float, nullable=True),
    sa.Column("margin", sa.Float, nullable=False),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float, nullable=True),
)

# Answers kept for a follow-up: Responses API objects (`previous_response_id`, `GET /v1/responses/{id}`;
# `store: true`, the default) and Anthropic's message threads (`thread`): the answer as the client got it, its
# input items, and the conversation a follow-up continues.
responses = sa.Table(
    "responses",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("rollout_id", sa.String(128), nullable=False),
    sa.Column("model", sa.String(256), nullable=False),
    sa.Column("response", sa.JSON, nullable=False),
    sa.Column("input_items", sa.JSON, nullable=False),
    sa.Column("messages", sa.JSON, nullable=False),  # the history, this input, this output (in the API's messages)
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("key_id", sa.String(64), nullable=True),  # the API key that made it (its id; NULL: no key)
    sa.Column("api", sa.String(16), nullable=False, server_default="responses"),  # "responses" or "messages"
    sa.Column("carried", sa.JSON, nullable=True),  # fields a follow-up takes from it (a thread's system, tools)
)

# The trainable models: the set every replica serves, added and retired at runtime (a retired model's data
# stays; it is no longer served or trained).
models = sa.Table(
    "models",
    metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("retired_at", sa.Float, nullable=True),
)

# Client API keys. The secret is never stored: its SHA-256 (keys are 256-bit random, so a fast hash is
# enough), and its first characters to tell keys apart in a listing.
api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(128), nullable=False),
    sa.Column("secret_sha256", sa.String(64), nullable=False, unique=True),
    sa.Column("prefix", sa.String(16), nullable=False),
    sa.Column("models", sa.JSON, nullable=True),  # the models it may use; NULL: every model
    sa.Column("scopes", sa.JSON, nullable=False),  # store.keys.Scope values
    sa.Column("rpm", sa.Integer, nullable=True),  # requests per minute; NULL: no limit
    sa.Column("tpm", sa.Integer, nullable=True),  # tokens per minute; NULL: no limit
    # Other keys (ids) whose rollouts, groups and stored Responses it may read (store.access.Grant.reads);
    # NULL: none. Set when the key is made, by the admin.
    sa.Column("read_keys", sa.JSON, nullable=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float, nullable=True),
)
