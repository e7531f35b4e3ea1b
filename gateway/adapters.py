"""The adapter registry: which LoRA step each trainable model serves.

A trainable model `NAME` is served by vLLM either as the base model (step 0,
before any training) or as the LoRA adapter `NAME@<step>`. A request for
`NAME` goes to the newest step, `NAME@K` pins step K, and the base model's own
name reaches the base weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gateway.errors import OpenAIError, model_not_found

_PINNED = re.compile(r"^(?P<name>.+)@(?P<step>\d+)$")


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes and what it records."""

    upstream_model: str  # the name vLLM serves (base model or LoRA adapter)
    model: str | None  # the trainable model name, None for the base model
    step: int | None  # adapter step that serves it; 0 = base weights; None for the base model


@dataclass
class TrainableModel:
    name: str
    served_step: int = 0  # 0 = the base weights, no adapter yet
    loaded_steps: set[int] = field(default_factory=set)  # adapters vLLM has loaded, by step


def adapter_name(model: str, step: int) -> str:
    return f"{model}@{step}"


class AdapterRegistry:
    """In-memory view of the served adapters; the store keeps the history."""

    def __init__(self, base_model: str | None, trainable: list[str]) -> None:
        self.base_model = base_model  # None until a running engine has told us
        self.models = {name: TrainableModel(name) for name in trainable}

    def resolve(self, requested: str) -> Route:
        """Map the `model` field of a request to the engine's model name."""
        if self.base_model is None:
            raise OpenAIError(503, "The engine is starting; retry shortly.", code="engine_unavailable")
        model = self.models.get(requested)
        if model is not None:
            return self._route(model, model.served_step)
        pinned = _PINNED.match(requested)
        if pinned is not None and (model := self.models.get(pinned["name"])) is not None:
            step = int(pinned["step"])
            if step == 0 or step in model.loaded_steps:
                return self._route(model, step)
        if requested == self.base_model:
            return Route(self.base_model, None, None)
        raise model_not_found(requested)

    def _route(self, model: TrainableModel, step: int) -> Route:
        assert self.base_model is not None
        upstream = self.base_model if step == 0 else adapter_name(model.name, step)
        return Route(upstream, model.name, step)

    def model_ids(self) -> list[tuple[str, str]]:
        """(id, root) pairs for `GET /v1/models`: trainable names, their loaded steps, the base."""
        if self.base_model is None:
            return []
        out: list[tuple[str, str]] = []
        for model in self.models.values():
            out.append((model.name, self.base_model))
            out.extend((adapter_name(model.name, s), self.base_model) for s in sorted(model.loaded_steps))
        out.append((self.base_model, self.base_model))
        return out
