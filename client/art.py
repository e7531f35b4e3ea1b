"""`ArtClient`: the gateway's `/v1/art` API over one synchronous httpx client, reading and sending the server's own
structs (store/api.py). Errors: GatewayRefused for an answer that is not 2xx, NotAnArtGateway for one that does
not decode as the API's, httpx's TransportError (TimeoutException among them) when nothing answers."""

from __future__ import annotations

from typing import Self, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from store.api import AdapterLoad, ModelList, ModelStatus
from store.judge_report import JudgeReport

T = TypeVar("T")
TIMEOUT = 30.0
COMMIT_TIMEOUT = 300.0  # loading an adapter into the engine can take a while on a busy CPU


class GatewayRefused(RuntimeError):
    """The gateway answered with an error: its status and the message of its (OpenAI-shaped) error body."""

    def __init__(self, what: str, status: int, message: str) -> None:
        super().__init__(f"gateway refused {what} ({status}): {message[:500]}")
        self.status = status
        self.message = message


class NotAnArtGateway(RuntimeError):
    """What answered is not this API (another server listens there, or a gateway of another version)."""


class ArtClient:
    """One gateway, one key (the admin key for a trainer's commits and `artgw status`)."""

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
        return self._get("/v1/art/models", ModelList).data

    def model_status(self, model: str) -> ModelStatus:
        """What `model` serves, its groups by state, its steps (newest first), promotions and evaluations."""
        return self._get(f"/v1/art/models/{quote(model, safe='')}", ModelStatus)

    def judge_report(self, model: str) -> JudgeReport:
        """How RULER's rankings agree with the callers' rewards in `model`'s groups that have both."""
        return self._get(f"/v1/art/models/{quote(model, safe='')}/judge-report", JudgeReport)

    def load_adapter(self, model: str, load: AdapterLoad) -> ModelStatus:
        """Have the gateway serve `load.path` as `model`@`load.step`; it marks `load.group_ids` trained in the same
        store transaction."""
        answer = self.http.post(
            f"/v1/art/models/{quote(model, safe='')}/adapters",
            content=msgspec.json.encode(load),
            headers={"content-type": "application/json"},
            timeout=COMMIT_TIMEOUT,
        )
        return self._read(answer, f"{model} step {load.step}", ModelStatus)

    def request(self, method: str, path: str, body: object = None) -> httpx.Response:
        """Any other `/v1/art` call, untyped (keys, groups: their structs are still the gateway's own); its answer
        when 2xx, else GatewayRefused."""
        return _checked(self.http.request(method, path, json=body), f"{method} {path}")

    # -- plumbing
    def _get(self, path: str, type_: type[T]) -> T:
        return self._read(self.http.get(path), f"GET {path}", type_)

    @staticmethod
    def _read(answer: httpx.Response, what: str, type_: type[T]) -> T:
        try:
            return msgspec.json.decode(_checked(answer, what).content, type=type_)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise NotAnArtGateway(f"{what}: the answer is not the ART gateway's ({exc})") from None


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
