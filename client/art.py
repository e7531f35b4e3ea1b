"""`ArtClient`: the gateway's `/v1/art` API over one synchronous httpx client, reading and sending the server's own
structs (store/api.py). Errors: GatewayRefused for an answer that is not 2xx, NotAnArtGateway for one that does
not decode as the API's, httpx's TransportError (TimeoutException among them) when nothing answers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Self, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from store.api import (
    AdapterLoad,
    GroupCreate,
    GroupOut,
    GroupPage,
    KeyCreate,
    KeyCreated,
    KeyList,
    ModelList,
    ModelStatus,
)
from store.judge_report import JudgeReport
from store.keys import ApiKey
from store.types import GroupState

T = TypeVar("T")
TIMEOUT = 30.0
COMMIT_TIMEOUT = 300.0  # loading an adapter into the engine can take a while on a busy CPU
PAGE = 100  # groups per page when reading them all (the server takes up to store.rollouts.MAX_PAGE)


class GatewayRefused(RuntimeError):
    """The gateway answered with an error: its status and the message of its (OpenAI-shaped) error body."""

    def __init__(self, what: str, status: int, message: str) -> None:
        super().__init__(f"gateway refused {what} ({status}): {message[:500]}")
        self.status = status
        self.message = message


class NotAnArtGateway(RuntimeError):
    """What answered is not this API (another server listens there, or a gateway of another version)."""


class ArtClient:
    """One gateway, one key: the admin key for a trainer's commits, `artgw status` and `artgw keys`; a client key
    with the `reward` and `read` scopes for an app posting and reading its groups (the demo's agent)."""

    def __init__(self, base_url: str, key: str | None = None, *, timeout: float = TIMEOUT) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # -- models
    def models(self) -> list[str]:
        """The trainable models the key covers."""
        return self._send("GET", "/v1/art/models", ModelList).data

    def model_status(self, model: str) -> ModelStatus:
        """What `model` serves, its groups by state, its steps (newest first), promotions and evaluations."""
        return self._send("GET", f"/v1/art/models/{_segment(model)}", ModelStatus)

    def readiness(self) -> dict[str, Any]:
        """`GET /readyz`'s body, ready or not: the engine's state, each engine's health with several, the store's."""
        answer = self.http.get("/readyz")
        try:
            body = msgspec.json.decode(answer.content, type=dict[str, Any])
        except msgspec.DecodeError as exc:
            raise NotAnArtGateway(f"GET /readyz: the answer is not the ART gateway's ({exc})") from None
        return body

    def judge_report(self, model: str) -> JudgeReport:
        """How RULER's rankings agree with the callers' rewards in `model`'s groups that have both."""
        return self._send("GET", f"/v1/art/models/{_segment(model)}/judge-report", JudgeReport)

    def load_adapter(self, model: str, load: AdapterLoad) -> ModelStatus:
        """Have the gateway serve `load.path` as `model`@`load.step`; it marks `load.group_ids` trained in the same
        store transaction."""
        path, what = f"/v1/art/models/{_segment(model)}/adapters", f"{model} step {load.step}"
        return self._send("POST", path, ModelStatus, body=load, timeout=COMMIT_TIMEOUT, what=what)

    # -- keys (the admin key only)
    def create_key(self, spec: KeyCreate) -> KeyCreated:
        """A client key; its secret is in the answer only (the store keeps a hash)."""
        return self._send("POST", "/v1/art/keys", KeyCreated, body=spec)

    def keys(self, *, include_revoked: bool = False) -> list[ApiKey]:
        """Every key, secrets left out; revoked ones too when `include_revoked`."""
        params = {"include_revoked": "true"} if include_revoked else None
        return self._send("GET", "/v1/art/keys", KeyList, params=params).data

    def revoke_key(self, key_id: str) -> ApiKey:
        """Revoke a key (at once on the gateway asked, on its other replicas within about a second): the key as
        revoked."""
        return self._send("DELETE", f"/v1/art/keys/{_segment(key_id)}", ApiKey)

    # -- groups
    def post_group(self, spec: GroupCreate, *, idempotency_key: str | None = None) -> GroupOut:
        """Post the attempts at one task (a key with the `reward` scope): the group as made, or as made before by
        the same request (same `group_id` or `idempotency_key`)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else None
        return self._send("POST", "/v1/art/groups", GroupOut, body=spec, headers=headers)

    def group(self, group_id: str) -> GroupOut:
        """One group and where it stands (scoring, ready, trained, failed)."""
        return self._send("GET", f"/v1/art/groups/{_segment(group_id)}", GroupOut)

    def group_page(
        self,
        *,
        model: str | None = None,
        state: GroupState | None = None,
        limit: int = PAGE,
        cursor: str | None = None,
    ) -> GroupPage:
        """One page of the key's groups, oldest first: of `model` and in `state` when given; `cursor` is the last
        page's `next_cursor`."""
        query = {"model": model, "state": state, "limit": limit, "cursor": cursor}
        params = {name: value for name, value in query.items() if value is not None}
        return self._send("GET", "/v1/art/groups", GroupPage, params=params)

    def groups(
        self, *, model: str | None = None, state: GroupState | None = None, page: int = PAGE
    ) -> Iterator[GroupOut]:
        """Every group of the key's (of `model`, in `state` when given), oldest first, read `page` at a time."""
        cursor: str | None = None
        while True:
            answer = self.group_page(model=model, state=state, limit=page, cursor=cursor)
            yield from answer.data
            if answer.next_cursor is None:
                return
            cursor = answer.next_cursor

    # -- plumbing
    def _send(
        self,
        method: str,
        path: str,
        type_: type[T],
        *,
        body: msgspec.Struct | None = None,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
        what: str | None = None,
    ) -> T:
        """`method path` with `body` encoded as the server decodes it, the answer decoded as `type_`."""
        if body is not None:
            headers = {**(headers or {}), "content-type": "application/json"}
        answer = self.http.request(
            method,
            path,
            content=msgspec.json.encode(body) if body is not None else None,
            params=params,
            headers=headers,
            timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
        )
        return self._read(answer, what or f"{method} {path}", type_)

    @staticmethod
    def _read(answer: httpx.Response, what: str, type_: type[T]) -> T:
        try:
            return msgspec.json.decode(_checked(answer, what).content, type=type_)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise NotAnArtGateway(f"{what}: the answer is not the ART gateway's ({exc})") from None


def _segment(value: str) -> str:
    """`value` as one path segment (a name or id with `/` or `@` stays one)."""
    return quote(value, safe="")


def _checked(answer: httpx.Response, what: str) -> httpx.Response:
    """`answer` when 2xx, else GatewayRefused."""
    if not answer.is_success:
        raise GatewayRefused(what, answer.status_code, error_message(answer))
    return answer


def error_message(answer: httpx.Response) -> str:
    """The message of an OpenAI-shaped error body, else the start of the body."""
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return answer.text[:200] or answer.reason_phrase
