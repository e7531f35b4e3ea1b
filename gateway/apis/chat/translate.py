"""Chat completions to and from the engine: the client's request plus what the recorder needs, and the answer
shaped exactly as if the client had called vLLM with its own request.

The gateway always asks vLLM for the sampled token ids, the prompt token ids and the sampling logprobs (the
recorder needs them), then hands the client a response with the fields it did not ask for set back to null, as
vLLM does. The Responses and Messages translations send their chat requests through `upstream_request` too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.adapters import Route
from gateway.errors import OpenAIError

_encode = msgspec.json.encode


@dataclass(frozen=True, slots=True)
class Asked:
    """What the client asked for among the fields the gateway always requests."""

    logprobs: bool
    token_ids: bool


def offered_tools(request: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's `tool_choice: {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}` (checked by the
    schema) as the engine takes it: only the allowed tools offered to the model (and rendered in its prompt),
    `mode` (`auto` or `required`) as the tool_choice. vLLM 0.32 refuses the form itself. The request is recorded
    as changed: the trainer rebuilds the grammar from the tools the engine was given."""
    choice = request.get("tool_choice")
    if not (isinstance(choice, dict) and choice.get("type") == "allowed_tools"):
        return request
    allowed = choice["allowed_tools"]
    names = {tool["function"]["name"] for tool in allowed["tools"]}
    tools = [tool for tool in request.get("tools") or () if tool["function"]["name"] in names]
    return {**request, "tools": tools, "tool_choice": allowed["mode"]}


def strict_forced_calls(request: dict[str, Any]) -> dict[str, Any]:
    """The request with the tools a named or `required` tool_choice forces made `strict`: their arguments are
    then sampled under the tool's schema. Without it vLLM 0.32 constrains only the `<tool_call>` envelope and the
    arguments may be any JSON (a model still learning writes a number), which most clients send by default.
    The request is recorded as changed (the trainer rebuilds the grammar the engine sampled under from it)."""
    tools = request.get("tools")
    choice = request.get("tool_choice")
    if not tools or not (choice == "required" or isinstance(choice, dict)):
        return request
    forced = None if choice == "required" else (choice.get("function") or {}).get("name")
    strict = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and forced in (None, function.get("name")) and function.get("strict") is not True:
            tool = {**tool, "function": {**function, "strict": True}}
        strict.append(tool)
    return {**request, "tools": strict}


def upstream_request(request: dict[str, Any], route: Route, **extra: Any) -> tuple[bytes, Asked]:
    """The engine's request: the client's, for the routed model, asking for what the recorder needs."""
    asked = Asked(bool(request.get("logprobs")), bool(request.get("return_token_ids")))
    upstream = dict(request)
    if upstream.get("tools") == []:  # no tools (strands' and fast-agent's default): vLLM refuses an empty list
        del upstream["tools"]
        if upstream.get("tool_choice") in ("auto", "none"):  # what no tools means anyway; refused without tools
            del upstream["tool_choice"]
    upstream["model"] = route.upstream_model
    upstream["logprobs"] = True
    upstream["return_token_ids"] = True
    upstream.update(extra)
    return _encode(upstream), asked


def hide_unasked(payload: dict[str, Any], asked: Asked, model: str) -> None:
    """Undo what the gateway added, in place: null, as vLLM sends fields nobody asked for."""
    payload["model"] = model
    if not asked.token_ids:
        if "prompt_token_ids" in payload:
            payload["prompt_token_ids"] = None
        for choice in payload.get("choices") or ():
            if "token_ids" in choice:
                choice["token_ids"] = None
    if not asked.logprobs:
        for choice in payload.get("choices") or ():
            choice["logprobs"] = None


class ChatWire:
    """Chat's own format, minus what the client did not ask for."""

    __slots__ = ("asked", "model")

    def __init__(self, asked: Asked, model: str) -> None:
        self.asked = asked
        self.model = model

    async def answer(self, payload: dict[str, Any]) -> bytes:
        hide_unasked(payload, self.asked, self.model)
        return _encode(payload)

    def event(self, event: dict[str, Any]) -> bytes:
        hide_unasked(event, self.asked, self.model)
        return b"data: " + _encode(event) + b"\n\n"

    async def done(self) -> bytes:
        return b"data: [DONE]\n\n"

    def broken(self, error: OpenAIError) -> bytes:
        """OpenAI's error body as the last event (code `upstream_error` when the engine is at fault)."""
        return b"data: " + _encode(error.body()) + b"\n\n"
