"""What the gateway records of each call: small immutable structs.

A `CallRecord` is built once per call when it ends (served, cancelled or failed)
and handed to the recorder; it carries exactly the token ids and logprobs vLLM
returned, so training never re-tokenizes text.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, get_args

import msgspec

# client_error: the engine answered 4xx (a request it refused: passed through to the client, never trained).
# internal_error: the gateway's own bug (a 500 with a logged traceback), never the engine's fault.
CallStatus = Literal["ok", "cancelled", "upstream_error", "client_error", "internal_error"]
# The API the client spoke. Responses and Messages calls reach the engine as chat completions (their
# `request` is that chat request, so they assemble with chat calls); completions calls as completions.
Api = Literal["chat", "completions", "responses", "messages"]
CALL_STATUSES: tuple[str, ...] = get_args(CallStatus)
APIS: tuple[str, ...] = get_args(Api)


class RolloutKey(NamedTuple):
    """What names a rollout in the store: a client's rollout id is one within its owner's namespace."""

    owner: str  # the key that made it ("" for none: the admin's, or --auth off's): store.access.Grant.namespace
    id: str  # the rollout id as the client sent it (or the gateway made up)


class ChoiceRecord(msgspec.Struct, frozen=True):
    index: int
    message: dict[str, Any]  # the assistant message as the client saw it (content, tool_calls, ...)
    finish_reason: str | None
    token_ids: list[int]  # sampled completion token ids, as vLLM returned them
    logprobs: list[float]  # the sampling logprob of each of token_ids


class CallRecord(msgspec.Struct, frozen=True):
    call_id: str
    rollout_id: str
    rollout_explicit: bool  # False: the gateway made up the id (a one-call rollout)
    model: str | None  # trainable model name; None when the base model was asked for by name
    step: int | None  # adapter step that served the call; 0 = base weights
    upstream_model: str  # the engine-side model name
    request: dict[str, Any]  # the client's request body as sent; a forced call's tools `strict`, as the engine got them
    stream: bool
    status: CallStatus
    http_status: int
    error: str | None
    prompt_token_ids: list[int]
    choices: list[ChoiceRecord]
    usage: dict[str, Any] | None
    started_at: float  # unix seconds
    first_token_at: float | None
    ended_at: float
    api: Api = "chat"
    key_id: str | None = None  # the API key that made the call (its id, never the secret); None: no key
    # Whether the gateway that served it had its rollout's last call, which a continuing call is spliced onto
    # (gateway/continuation.py: in memory, else read from the store). False: neither (the call that answered
    # it not yet in the store, the store failing). None: not asked (not a chat-path call of a named rollout).
    rollout_known: bool | None = None
    engine: str | None = None  # the base URL of the engine that served it (several behind one gateway); None: before
    # How the gateway served it where it continued its rollout (gateway/continuation.py `Served`: spliced, or why
    # it was served as sent); None: it did not continue (or was recorded before this was kept). A split says it.
    continued: str | None = None

    @property
    def rollout_key(self) -> RolloutKey:
        """Its rollout: a caller's calls join rollouts of its own namespace only (its key's; "" without one)."""
        return RolloutKey(self.key_id or "", self.rollout_id)
