"""Who may see which recorded data: the one visibility rule.

A reader's `Grant` names the models whose data it may see. Every store read of recorded data (rollouts, their
calls and exports, groups, stored Responses) takes the grant as a required argument and filters by it here,
in SQL where the read is a query; what a grant does not cover reads as if it did not exist. Deny by default:
`NOTHING` sees nothing, and every-model access (`EVERYTHING`) is granted explicitly (the admin key, the local
CLI that holds the store itself).

A grant also names whose own things it may use: a rollout it may add calls to, read, group or reward and a
stored Response it may read, continue or delete are its key's (`owner`), whatever models it covers; another
key of the same model is someone else. Rollout ids are a namespace per owner (`namespace`): two keys' rollout
`r1` are two rollouts, and neither can tell that the other's exists. Every key's (`every_owner`) only where
granted explicitly (the admin, the store's holders), which names another owner's rollout with `owner_of`.

A key may also read named other keys' things (`reads`: granted by the admin when it makes the key, none by
default): their rollouts, groups and stored Responses it reads (and lists), and a stored Response or thread of
theirs it may continue (a follow-up is its own), where it covers the model; it never adds to, groups, rewards
or deletes them.
"""

from __future__ import annotations

import msgspec
import sqlalchemy as sa


class Grant(msgspec.Struct, frozen=True):
    """The models whose data a reader may see; `models=None` is every model, base-model calls included."""

    models: frozenset[str] | None
    owner: str | None = None  # the key whose rollouts and stored Responses it may use (None: made without a key)
    every_owner: bool = False  # every key's (the admin; explicit only)
    reads: frozenset[str] = frozenset()  # other keys whose things it may read, never change (explicit only)

    def owns(self, key_id: str | None) -> bool:
        """May it use (add calls to, read, continue, delete) what key `key_id` made, where it covers the model?"""
        return self.every_owner or key_id == self.owner

    def may_read(self, key_id: str | None) -> bool:
        """May it read (and continue: a follow-up is its own) what key `key_id` made, where it covers the model?"""
        return self.owns(key_id) or key_id in self.reads

    @property
    def namespace(self) -> str:
        """The owner whose rollout ids its calls name: its key ("" without one: the admin, --auth off)."""
        return self.owner or ""

    def owner_of(self, requested: str | None) -> str | None:
        """Whose rollout and group ids it reads where it asks for `requested`'s (None: its own): another owner's
        only with every owner's or a grant to read theirs (else None: nothing, as if unknown)."""
        if requested is None or requested == self.namespace:
            return self.namespace
        return requested if self.every_owner or requested in self.reads else None

    def where_owner(self, owner: sa.ColumnElement[str]) -> sa.ColumnElement[bool]:
        """The SQL condition on a table's rollout owner column, for reading: its own rows and those of the keys
        it reads (every owner's: all)."""
        if self.every_owner:
            return sa.true()
        return owner.in_([self.namespace, *sorted(self.reads)]) if self.reads else owner == self.namespace

    def covers(self, model: str | None) -> bool:
        """May it see (or use) `model`? Base-model data (`None`) only with every model."""
        return self.models is None or (model is not None and model in self.models)

    def covers_id(self, model_id: str) -> bool:
        """`covers` for a model id as clients write it: `NAME` or a pinned step `NAME@K`."""
        return self.covers(model_id) or ("@" in model_id and self.covers(model_id.rpartition("@")[0]))

    def where(self, model: sa.ColumnElement[str | None]) -> sa.ColumnElement[bool]:
        """The SQL condition on a table's model column: rows of covered models only."""
        if self.models is None:
            return sa.true()
        return model.in_(sorted(self.models))


NOTHING = Grant(frozenset())
EVERYTHING = Grant(None, every_owner=True)
