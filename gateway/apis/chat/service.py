"""`/v1/chat/completions`: parse, route, and hand the call to the engine (gateway/proxy.py records it)."""

from __future__ import annotations

from gateway.adapters import Route
from gateway.apis.chat.schema import parse_chat_request
from gateway.apis.chat.translate import ChatWire, offered_tools, strict_forced_calls, upstream_request
from gateway.asgi import EventStream, HangUp, JSONBody
from gateway.proxy import CHAT_PATH, CallOrigin, EngineCalls, EngineRequest


class ChatService:
    """Chat completions: parse, route, and hand the call to the engine (gateway/proxy.py)."""

    def __init__(self, calls: EngineCalls) -> None:
        self.calls = calls
        self.registry = calls.registry

    async def complete(self, body: bytes, origin: CallOrigin, hang_up: HangUp | None = None) -> JSONBody | EventStream:
        head, request = parse_chat_request(body)
        request = strict_forced_calls(offered_tools(request))

        def build(route: Route) -> EngineRequest:
            upstream_body, asked = upstream_request(request, route)
            wire = ChatWire(asked, head.model)
            return EngineRequest("chat", CHAT_PATH, upstream_body, request, route, bool(head.stream), wire)

        return await self.calls.answer(head.model, origin, build, hang_up)
