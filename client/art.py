"""`ArtClient`: the gateway's `/v1/art` API over one synchronous httpx client (the trainer's loop is synchronous)."""

from __future__ import annotations

from typing import Self
from urllib.parse import quote

import httpx
import msgspec

from store.types import AdapterLoad

COMMIT_TIMEOUT = 300.0  # loading an adapter into the engine can take a while on a busy CPU


class GatewayRefused(RuntimeError):
    """The gateway answered with an error: its status and (the start of) its body."""

    def __init__(self, what: str, status: int, body: str) -> None:
        super().__init__(f"gateway refused {what} ({status}): {body[:500]}")
        self.status = status


class ArtClient:
    """One gateway, one key (the admin key for a trainer's commits)."""

    def __init__(self, base_url: str, key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def load_adapter(self, model: str, load: AdapterLoad) -> None:
        """Have the gateway serve `load.path` as `model`@`load.step`; it marks `load.group_ids` trained in the same
        store transaction. GatewayRefused when it does not; httpx's errors when it cannot be reached."""
        answer = self.http.post(
            f"/v1/art/models/{quote(model, safe='')}/adapters",
            content=msgspec.json.encode(load),
            headers={"content-type": "application/json"},
            timeout=COMMIT_TIMEOUT,
        )
        if not answer.is_success:
            raise GatewayRefused(f"{model} step {load.step}", answer.status_code, answer.text)
