"""Scale-out: two gateway replicas on one PostgreSQL store in front of one real vLLM, and a trainer.

What a load-balanced deployment relies on, with real processes: replicas started together migrate the
store once (the others wait on an advisory lock); a call recorded by one replica is visible to the other
(groups are made from rollouts either one recorded); a rollout whose calls alternate between the replicas is
one sequence (each continuing call spliced onto its rollout's last call, read from the store when the other
replica answered it); the trainer claims on PostgreSQL and commits through
one replica while the other follows; and Prometheus, scraping each replica, reads one consistent picture:
live counters add up across replicas, store-derived gauges (groups, trainer steps, adapter step) agree.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import GatewayProcess, metric, poll, start_gateway, start_trainer, started_together, stop_group
from tests.recorded import ROME_PARIS_TOOLS, first_run, forced_tool_call, one_sequence, recorded_calls

pytestmark = [pytest.mark.engine, pytest.mark.postgres]

MODEL = "my-agent"
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture
def replicas(pg_database_url: str, vllm_url: str, tmp_path: Path) -> Iterator[list[GatewayProcess]]:
    starting = [start_gateway(tmp_path, "--upstream", vllm_url, "--db", pg_database_url, wait=False) for _ in range(2)]
    with started_together(starting) as both:
        yield both


def test_replicas_share_the_store_and_report_one_picture(
    replicas: list[GatewayProcess], pg_database_url: str, tiny_model: Path
) -> None:
    a, b = replicas
    assert all(g.proc.poll() is None for g in replicas)
    _alternating_rollout_is_one_sequence(a, b)
    ok_before = [metric(g.url, "artgw_requests_total", model=MODEL, status="ok") for g in replicas]

    # Calls through both replicas; one group made of rollouts recorded by either, created on B.
    rollouts: list[str] = []
    for gateway, calls in ((a, 3), (b, 2)):
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        for _ in range(calls):
            rollouts.append(f"rep-{uuid.uuid4().hex[:8]}")
            client.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=4, extra_headers={"X-ART-Rollout-Id": rollouts[-1]}
            )
    for rid in rollouts[:3]:  # recorded by A, read back through B
        poll(
            lambda rid=rid: httpx.get(f"{b.base_url}/art/rollouts/{rid}", headers=b.admin).status_code == 200,
            10,
            f"{rid} on B",
        )
    group = httpx.post(
        f"{b.base_url}/art/groups",
        json={"model": MODEL, "rollouts": [{"rollout_id": r, "reward": float(i % 2)} for i, r in enumerate(rollouts)]},
        timeout=30,
        headers=b.admin,
    )
    assert group.status_code == 201, group.text
    group_id = group.json()["id"]

    # Live counters are per replica and add up; the store's gauges are the same on both.
    ok_after = [metric(g.url, "artgw_requests_total", model=MODEL, status="ok") for g in replicas]
    assert [after - before for after, before in zip(ok_after, ok_before, strict=True)] == [3, 2]
    for gateway in replicas:
        assert metric(gateway.url, "artgw_groups", model=MODEL, state="ready") == 1
        assert metric(gateway.url, "artgw_adapter_step", model=MODEL) == 0

    # The trainer claims on PostgreSQL and commits its step through A; B follows it.
    trainer, log_path = start_trainer(
        a, tiny_model, "--db", pg_database_url, "--groups-per-step", "1", "--max-steps", "1"
    )
    try:
        assert trainer.wait(300) == 0, log_path.read_text(errors="replace")[-3000:]
    finally:
        stop_group(trainer)
    assert httpx.get(f"{a.base_url}/art/groups/{group_id}", headers=a.admin).json()["state"] == "trained"
    poll(lambda: metric(b.url, "artgw_adapter_step", model=MODEL) == 1, 60, "B to follow step 1")
    for gateway in replicas:
        assert metric(gateway.url, "artgw_adapter_step", model=MODEL) == 1
        assert metric(gateway.url, "artgw_trainer_steps_total", model=MODEL) == 1
        assert metric(gateway.url, "artgw_groups", model=MODEL, state="trained") == 1
        assert metric(gateway.url, "artgw_groups", model=MODEL, state="ready") == 0
        ids = [m["id"] for m in httpx.get(f"{gateway.base_url}/models").json()["data"]]
        assert f"{MODEL}@1" in ids

    # A call through B now reaches the adapter A loaded, and its record says so.
    rid = f"rep-after-{uuid.uuid4().hex[:8]}"
    answer = openai.OpenAI(base_url=b.base_url, api_key="unused", max_retries=0).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, extra_headers={"X-ART-Rollout-Id": rid}
    )
    assert answer.model == MODEL
    rollout = poll(
        lambda: httpx.get(f"{a.base_url}/art/rollouts/{rid}", headers=a.admin).json().get("calls"), 10, "the record"
    )
    assert [call["step"] for call in rollout] == [1]


def _alternating_rollout_is_one_sequence(a: GatewayProcess, b: GatewayProcess) -> None:
    """A forced tool call on A (rendered anew, the template would re-serialize it: a split), then its rollout's
    calls alternate B, A, B, each once the replica before has written its call: every one is spliced onto the
    call before it, which the replica serving it does not hold (or holds an older one of): it reads the store."""
    rid = f"rep-alt-{uuid.uuid4().hex[:8]}"
    seed, messages = first_run(lambda seed: forced_tool_call(a, f"{rid}-{seed}", seed))
    rid = f"{rid}-{seed}"
    poll(lambda: recorded_calls(a, rid, 1), 60, "A's call")
    for turn, gateway in enumerate((b, a, b), start=2):
        client = openai.OpenAI(
            base_url=gateway.base_url, api_key="unused", max_retries=0, default_headers={"X-ART-Rollout-Id": rid}
        )
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, tools=ROME_PARIS_TOOLS, max_tokens=6, seed=turn
        )
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        poll(lambda gateway=gateway, turn=turn: recorded_calls(gateway, rid, turn), 60, f"call {turn}")
    one_sequence(a, rid, 4)
    assert [metric(g.url, "artgw_continuation_reads_total", found="found") for g in (a, b)] == [1, 2]
    assert [metric(g.url, "artgw_continued_calls_total", how="spliced") for g in (a, b)] == [1, 2]
