"""Agent frameworks at the edges of #42, each as an app at its defaults (tests/clients/, tests/clients-js/), on the
toy and a real vLLM.

- A streamed continuing call cut at its token limit (item 1): Vercel's `streamText` and mirascope's stream (its
  forced calls are Responses' `allowed_tools`) ask it twice on one history, as the rollout's continuing call and as
  a new rollout's first call. Both must hear what the plain path says (`length`, `max_tokens`); before, the spliced
  stream ended `response.completed`: Vercel said `tool-calls`, mirascope no finish reason at all.
- A Responses stream cut before any call's name (noticed in session 26): mirascope gets an incomplete turn with
  nothing in it; before, the gateway sent an empty message, which mirascope 2.8 raised on.
- Forced calls at their edges (item 4), smolagents: a string argument holding `</tool_call>` is a call (before: no
  call, or broken arguments when streamed), and a reply cut after complete calls keeps them (before: none, the raw
  `<tool_call>` text as the content, which smolagents cannot parse).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import run_client
from tests.recorded import app_env, new_id, one_sequence, rollout, texts

pytestmark = pytest.mark.engine

CUT_AT = "16"  # tokens: the continuing forced call's name and part of its arguments (its head is 13), then the limit


def _spliced_and_plain(gateway: Any, app: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The app's run (its cut stream asked on the rollout and on a new one) and the rollout as recorded (one
    sequence: the stream was the first call's continuation)."""
    rid, env = app_env(gateway)
    _, plain = app_env(gateway)
    run = run_client(app, {**env, "PLAIN_BASE_URL": plain["OPENAI_BASE_URL"], "MAX_OUTPUT_TOKENS": CUT_AT})
    return run, one_sequence(gateway, rid, 2)


def test_vercel_stream_text_cut_at_its_limit_finishes_length(engine_gateway) -> None:
    run, recorded = _spliced_and_plain(engine_gateway, "vercel_stream_cut")
    assert run["plain"]["finishReason"] == "length", run
    assert run["spliced"] == run["plain"], run
    # The cut-off call: streamed as far as it went, and the SDK runs none (the plain path's, as OpenAI's).
    assert not run["spliced"]["ran"], run
    assert recorded["calls"][1]["finish_reasons"] == ["length"]


def test_mirascope_stream_cut_at_its_limit_finishes_max_tokens(engine_gateway, tokenizer) -> None:
    rid, env = app_env(engine_gateway)
    plain_id = new_id("plain")
    plain = f"{engine_gateway.url}/rollouts/{plain_id}"  # the app makes one rollout a limit it tries
    run = run_client("mirascope_stream_cut", {**env, "PLAIN_ROLLOUT": plain})
    recorded = one_sequence(engine_gateway, rid, 2)
    assert run["plain"]["finish_reason"] == "max_tokens", run
    assert recorded["calls"][1]["finish_reasons"] == ["length"]
    # The two prompts hold the same text, not the same ids: the first call's cut reply goes on as sampled in the
    # rollout and is tokenized anew on the plain path, so the random model may sample other tokens (a CI run: the
    # spliced stream reached `"arguments": {}` within the limit, the plain one stopped before its arguments).
    spliced_text = texts(recorded, tokenizer)[1]
    (plain_text,) = texts(rollout(engine_gateway, f"{plain_id}-{run['limit']}"), tokenizer)
    if spliced_text == plain_text:
        assert run["spliced"] == run["plain"], run
    else:  # its own tokens, told as the plain path tells a cut: the limit, and only arguments it sampled
        assert run["spliced"]["finish_reason"] == "max_tokens", (run, spliced_text)
        assert all(text in spliced_text for text in run["spliced"]["texts"]), (run, spliced_text)
        assert all(name in spliced_text for name, _ in run["spliced"]["tool_calls"]), (run, spliced_text)
    # Cut before any call's name: an incomplete turn with nothing in it (before: an empty message, which mirascope
    # raised on).
    assert run["early"] == {"finish_reason": "max_tokens", "tool_calls": [], "texts": []}, run
    # mirascope asks for the forced call as Responses' `allowed_tools` (#42 item 5): recorded as `required`.
    assert recorded["calls"][1]["grammar_request"]["tool_choice"] == "required"


def test_smolagents_forced_calls_at_their_edges(engine_gateway, tokenizer) -> None:
    rid, env = app_env(engine_gateway)
    run = run_client("smolagents_edges", {**env, "CALL_TOKEN": str(tokenizer.convert_tokens_to_ids("<tool_call>"))})
    marked = "a </tool_call> b <tool_call>"
    for said in (run["marked"], run["marked_streamed"]):
        assert said["calls"] == [{"name": "final_answer", "arguments": {"answer": marked}}], said
        assert (said["seen"], said["output"]) == ([marked], marked), said
    cut = run["cut"]
    # The complete calls of a reply cut in a later one: each run (smolagents refuses a final answer beside others
    # only once it has run them all).
    assert len(cut["calls"]) >= 2, cut
    assert sorted(cut["seen"]) == sorted(value for call in cut["calls"] for value in call["arguments"].values()), cut
    assert set(cut["seen"]) <= {"Paris", "Rome"}, cut
    assert ["length"] in [c["finish_reasons"] for c in rollout(engine_gateway, rid)["calls"]]  # the cut reply
