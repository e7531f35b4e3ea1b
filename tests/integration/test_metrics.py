"""`GET /metrics` after real traffic, parsed with prometheus_client's own parser."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.engine

USER = [{"role": "user", "content": "hello"}]


def scrape(gateway) -> dict[str, list]:
    text = httpx.get(f"{gateway.url}/metrics").text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_after_real_traffic(engine_gateway) -> None:
    before = scrape(engine_gateway)
    client = openai.OpenAI(base_url=engine_gateway.base_url, api_key="unused", max_retries=0)
    rollouts = []
    for i in range(3):
        rid = f"m-{uuid.uuid4().hex[:8]}"
        rollouts.append(rid)
        client.chat.completions.create(
            model="my-agent", messages=USER, max_tokens=4, stream=i == 2, extra_headers={"X-ART-Rollout-Id": rid}
        )
    group = httpx.post(
        f"{engine_gateway.base_url}/art/groups",
        json={"model": "my-agent", "rollouts": [{"rollout_id": r, "reward": float(i)} for i, r in enumerate(rollouts)]},
        headers=engine_gateway.admin,
    )
    assert group.status_code == 201
    after = scrape(engine_gateway)

    ok = value(after["artgw_requests"], "artgw_requests_total", model="my-agent", status="ok")
    assert ok - value(before.get("artgw_requests", []), "artgw_requests_total", model="my-agent", status="ok") == 3
    hist = after["artgw_request_duration_seconds"]
    count = value(hist, "artgw_request_duration_seconds_count", model="my-agent")
    assert count >= 3
    assert value(hist, "artgw_request_duration_seconds_bucket", model="my-agent", le="+Inf") == count
    assert value(after["artgw_time_to_first_token_seconds"], "artgw_time_to_first_token_seconds_count") >= 3
    assert value(after["artgw_prompt_tokens"], "artgw_prompt_tokens_total", model="my-agent") > 0
    assert value(after["artgw_completion_tokens"], "artgw_completion_tokens_total", model="my-agent") >= 3
    assert value(after["artgw_requests_in_flight"], "artgw_requests_in_flight", model="my-agent") == 0
    assert value(after["artgw_records_written"], "artgw_records_written_total") >= ok - 3  # the last may queue
    assert "artgw_recorder_queue_depth" in after and "artgw_record_write_retries" in after
    assert value(after["artgw_groups"], "artgw_groups", model="my-agent", state="ready") >= 1
    assert value(after["artgw_adapter_step"], "artgw_adapter_step", model="my-agent") == 0
    # Bounded labels only: a rollout id never becomes a label value (an engine is one of --upstream's, a reason one
    # of a few).
    for samples in after.values():
        for sample in samples:
            assert not any(r in str(sample.labels) for r in rollouts), sample
            assert set(sample.labels) <= {"model", "status", "state", "kind", "le", "engine", "reason"}, sample
