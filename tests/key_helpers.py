"""The key tests' gateways and requests (test_keys, test_key_replicas): two models `a` and `b`, and the headers
that carry a key as each SDK sends it."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import GatewayProcess, start_gateway

MODELS = ("a", "b")
USER = [{"role": "user", "content": "hi"}]
CHAT_A = {"model": "a", "messages": USER, "max_tokens": 4}


def serve(
    where: Path, upstream: str, *args: str, env: dict[str, str] | None = None, wait: bool = True
) -> GatewayProcess:
    """`artgw serve` for models `a` and `b` in front of `upstream`, the shell's ARTGW_* variables left out."""
    return start_gateway(where, "--upstream", upstream, *args, env=env, wait=wait, models=MODELS, isolated=True)


def sent(secret: str | None, how: str = "bearer") -> dict[str, str]:
    """The headers that carry `secret`: `Authorization: Bearer` (the OpenAI SDK) or `x-api-key` (Anthropic's)."""
    if secret is None:
        return {}
    return {"Authorization": f"Bearer {secret}"} if how == "bearer" else {"x-api-key": secret}
