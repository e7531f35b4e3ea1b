import json
from tests.integration.test_families import _Loop, mistral, FORCED  # noqa: F401
from tests.recorded import ROME_PARIS_TOOLS, new_id
import pytest

pytestmark = pytest.mark.engine


def test_probe(mistral) -> None:
    rid = new_id("probe")
    for seed in range(8):
        loop = _Loop(mistral, f"{rid}-{seed}", "reasoning dropped", True, seed)
        out = []
        for i in range(2):
            try:
                choice = loop.call(tools=ROME_PARIS_TOOLS, tool_choice=FORCED, extra_body={"logit_bias": mistral.forced_bias}, max_tokens=mistral.forced_tokens)
            except Exception as exc:
                out.append(f"err {exc!r}")
                break
            calls = choice.message.tool_calls or []
            out.append((choice.finish_reason, [(c.id, c.function.arguments) for c in calls]))
            if choice.finish_reason == "length" or not calls:
                break
            loop.messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"})
        print(f"\nseed {seed}: {out}")
