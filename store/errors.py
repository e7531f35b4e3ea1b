"""What the store says when it cannot do what was asked: domain errors, no HTTP.

The gateway maps them to its wire errors (gateway/errors.py); the trainer and the CLI handle them as
they are. Each carries a stable `code` and, for bad input, the `param` it concerns.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of the store's domain errors."""

    code: str = "store_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class NotFound(StoreError):
    """The thing asked for does not exist (in this store)."""

    code = "not_found"


class Invalid(StoreError):
    """The input cannot be used as given (a bad cursor, a bad limit)."""

    code = "invalid_value"


class Conflict(StoreError):
    """The input clashes with what the store holds (a rollout in another group, a lost lease)."""

    code = "conflict"


class StoreMissing(StoreError):
    """There is no store at that place, or it was never migrated: nothing was created."""

    code = "store_missing"
