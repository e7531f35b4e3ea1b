"""`/v1/completions`: parse, route, and hand the call to the engine (gateway/proxy.py records it)."""

from __future__ import annotations

from gateway.adapters import Route
from gateway.apis.completions.schema import parse_completion_request, prompt_count
from gateway.apis.completions.translate import CompletionsWire, upstream_request
from gateway.asgi import EventStream, HangUp, JSONBody
from gateway.proxy import CallOrigin, EngineCalls, EngineRequest


class CompletionsService:
    """Legacy completions: parse, route, and hand the call to the engine (gateway/proxy.py)."""

    def __init__(self, calls: EngineCalls) -> None:
        self.calls = calls

    async def complete(self, body: bytes, origin: CallOrigin, hang_up: HangUp | None = None) -> JSONBody | EventStream:
        head, request = parse_completion_request(body)
        several = prompt_count(head.prompt) > 1

        def build(route: Route) -> EngineRequest:
            return EngineRequest(
                "completions",
                "/v1/completions",
                upstream_request(head, request, route),
                request,
                route,
                bool(head.stream),
                CompletionsWire(request, head.model),
                choices_per_prompt=(head.n or 1) if several else 0,
            )

        return await self.calls.answer(head.model, origin, build, hang_up)
