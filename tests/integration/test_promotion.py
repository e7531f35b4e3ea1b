"""Gated promotion end to end: a real vLLM, `artgw serve --promotion gated` and `artgw train` as processes.

The task is the demo's `report(passed)` call (artgw/demo_task.py) on scenarios whose answer is always `yes`, asked
in one call with the ballots already looked up. An eval set of such scenarios with a `tool_call` grader is
registered; the random-weight base model answers it at about chance. Then:

- rounds of groups rewarded for `yes` train steps that the gate evaluates against the promoted step and promotes;
- rounds rewarded for `no` (inverted rewards) train steps that do worse: the gate holds them back, so `my-agent`
  keeps serving the good step while `my-agent@latest` serves the newest, and calls made all along are answered;
- an admin's rollback and promote move `my-agent` by hand; every move is in the history with its reason, and
  in the Prometheus counters.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from artgw import demo_task
from tests.conftest import ARTGW, Background, GatewayProcess, poll, start_gateway, start_trainer, stop_group

pytestmark = pytest.mark.engine

MODEL = "my-agent"
GROUPS = 8  # scenarios per training step
ATTEMPTS = 8  # attempts per scenario
LEARNING_RATE = 5e-2  # large: each step moves the answer clearly, so the gate has something to see
GOOD_ROUNDS = 1  # one step rewarded for `yes`: about 0.3 -> 0.8 on the eval set (seed 0: 0.30 -> 0.78)
BAD_ROUNDS = 3  # then three rewarded for `no`
EVAL_SCENARIOS = 16
SAMPLES = 8
# No step may look worse at all: a margin of 0.1 would (rightly) let the first inverted step through, as its
# eval reward falls by only ~0.07.
MARGIN = 0.0


def yes_scenarios(split: demo_task.Split, n: int) -> list[demo_task.Scenario]:
    """`n` scenarios whose correct answer is `yes`."""
    return [s for s in demo_task.scenarios(split, 8 * n, seed=3) if s.verdict == "yes"][:n]


def report_messages(scenario: demo_task.Scenario) -> list[dict[str, Any]]:
    """The conversation up to the `report` call: the question, the get_ballots call and its result."""
    call_id = "call_ballots"
    return [
        *demo_task.first_turn(scenario),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": demo_task.BALLOTS_TOOL, "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": scenario.tool_result()},
    ]


def report_params(bias: dict[str, dict[str, int]]) -> dict[str, Any]:
    return {
        "tool_choice": {"type": "function", "function": {"name": demo_task.REPORT_TOOL}},
        "max_tokens": demo_task.TOOL_CALL_MAX_TOKENS,
        "logit_bias": bias[demo_task.REPORT_TOOL],
        "temperature": 1.0,
    }


@pytest.fixture(scope="module")
def gated(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    gateway = start_gateway(
        tmp_path_factory.mktemp("gated"),
        *("--upstream", vllm_url, "--promotion", "gated", "--gate-margin", str(MARGIN)),
    )
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def trainer(gated: GatewayProcess, tiny_model: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc, log_path = start_trainer(
        gated,
        tiny_model,
        *("--groups-per-step", str(GROUPS), "--min-groups-per-step", str(GROUPS), "--max-wait", "600"),
        *("--learning-rate", str(LEARNING_RATE), "--seed", "0"),
    )
    yield proc
    stop_group(proc)
    print(f"--- trainer log (tail) ---\n{log_path.read_text(errors='replace')[-3000:]}")


def status(gateway: GatewayProcess) -> dict[str, Any]:
    answer = httpx.get(f"{gateway.base_url}/art/models/{MODEL}", timeout=10)
    answer.raise_for_status()
    return answer.json()


async def answers(
    gateway: GatewayProcess, model: str, jobs: list[tuple[demo_task.Scenario, str]], bias
) -> list[str | None]:
    """The `passed` value of one report call per (scenario, rollout id)."""
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=120)
    slots = asyncio.Semaphore(16)

    async def one(scenario: demo_task.Scenario, rollout_id: str) -> str | None:
        async with slots:
            completion = await client.chat.completions.create(
                model=model,
                messages=report_messages(scenario),
                tools=demo_task.TOOLS,
                extra_headers={"X-ART-Rollout-Id": rollout_id},
                **report_params(bias),
            )
        calls = completion.choices[0].message.tool_calls or []
        return demo_task.parse_argument(calls[0].function.arguments) if calls else None

    try:
        return list(await asyncio.gather(*(one(s, r) for s, r in jobs)))
    finally:
        await client.close()


def train_round(gateway: GatewayProcess, round_: int, rewarded: str, bias) -> int:
    """One step's groups, rewarded for answering `rewarded`; returns the step once the gate has judged it."""
    pool = yes_scenarios("train", GROUPS * (GOOD_ROUNDS + BAD_ROUNDS))
    chosen = pool[(round_ - 1) * GROUPS : round_ * GROUPS]
    jobs = [(s, f"p{round_}-{s.id}-{k}") for s in chosen for k in range(ATTEMPTS)]
    got = asyncio.run(answers(gateway, MODEL + "@latest", jobs, bias))
    group_ids = []
    for scenario in chosen:
        rollouts = [
            {"rollout_id": rid, "reward": 1.0 if answer == rewarded else 0.0}
            for (s, rid), answer in zip(jobs, got, strict=True)
            if s.id == scenario.id
        ]
        group_ids.append(f"pg-{round_}-{scenario.id}")
        body = {"model": MODEL, "group_id": group_ids[-1], "rollouts": rollouts}
        httpx.post(f"{gateway.base_url}/art/groups", json=body, timeout=30).raise_for_status()

    def judged() -> int | None:
        groups = [httpx.get(f"{gateway.base_url}/art/groups/{g}", timeout=10).json() for g in group_ids]
        if not all(g["state"] == "trained" for g in groups):
            return None
        step = max(g["trained_step"] for g in groups)
        now = status(gateway)
        done = [e for e in now["evaluations"] if e["step"] == step and e["status"] != "running"]
        if not done:
            return None
        # A step that passed is promoted just after its evaluation is written (the promotion row, then the
        # served step): wait for the move to show, so that what follows reads the gate's decision applied.
        if all(e["status"] == "passed" for e in done) and now["served_step"] != step:
            return None
        return step

    return int(poll(judged, 600, f"round {round_}'s step to be trained and judged", every=0.5))


def evaluation(model_status: dict[str, Any], step: int) -> dict[str, Any]:
    (found,) = [e for e in model_status["evaluations"] if e["step"] == step]
    return found


def metric_samples(gateway: GatewayProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_gate_promotes_a_better_step_and_holds_back_a_worse_one(
    gated: GatewayProcess, trainer: subprocess.Popen[bytes], tiny_model: Path
) -> None:
    bias = demo_task.call_logit_bias(tiny_model)
    eval_set = {
        "name": "always-yes",
        "samples": SAMPLES,
        "scenarios": [
            {
                "messages": report_messages(s),
                "tools": demo_task.TOOLS,
                "params": report_params(bias),
                "grader": {"type": "tool_call", "name": demo_task.REPORT_TOOL, "arguments": {"passed": "yes"}},
            }
            for s in yes_scenarios("heldout", EVAL_SCENARIOS)
        ],
    }
    created = httpx.post(f"{gated.base_url}/art/models/{MODEL}/evals", json=eval_set, headers=gated.admin, timeout=30)
    assert created.status_code == 201, created.text
    listed = httpx.get(f"{gated.base_url}/art/models/{MODEL}/evals", timeout=10).json()["data"]
    assert [s["name"] for s in listed] == ["always-yes"]
    first = status(gated)
    assert (first["promotion"], first["served_step"], first["latest_step"]) == ("gated", 0, 0)

    with Background(gated.base_url, MODEL) as background:
        good = [train_round(gated, r, "yes", bias) for r in range(1, GOOD_ROUNDS + 1)]
        after_good = status(gated)
        bad_started = time.time()
        bad = [train_round(gated, r, "no", bias) for r in range(GOOD_ROUNDS + 1, GOOD_ROUNDS + BAD_ROUNDS + 1)]
        after_bad = status(gated)
    assert background.calls > 0 and not background.failures, background.failures[:5]
    print(f"good steps {good}, bad steps {bad}; evaluations:")
    for e in reversed(after_bad["evaluations"]):
        print(
            f"  step {e['step']}: {e['status']} mean {e['mean']} vs {e['baseline_mean']} (step {e['baseline_step']}),"
            f" CI [{e['ci_low']}, {e['ci_high']}]"
        )

    # The steps rewarded for the right answer: the gate judged them better than the base and promoted them.
    promoted = after_good["served_step"]
    assert promoted == good[-1] == after_good["latest_step"], after_good["promotions"]
    assert evaluation(after_good, promoted)["status"] == "passed"
    firsts = evaluation(after_good, good[0])
    assert firsts["baseline_step"] == 0 and firsts["mean"] > firsts["baseline_mean"] + 0.2, firsts
    assert all(p["actor"] == "gate" and p["action"] == "promote" for p in after_good["promotions"])

    # The steps trained on inverted rewards, judged by the gate's rule: one not clearly worse than the step
    # serving (CI low >= -MARGIN) is promoted, one clearly worse is held back. A single inverted step moves little
    # and its evaluation can land either side (CI runs: the first, right after the good step, measured 0.84
    # against 0.73 and was promoted; yes-rates 0.48, 0.34, then 0.77 against 0.80). So: each judged by the rule,
    # `my-agent` serves the newest one promoted, and at least one is clearly worse and held back.
    assert after_bad["latest_step"] == bad[-1] > promoted
    judged_bad = [evaluation(after_bad, step) for step in bad]
    for judged in judged_bad:
        assert judged["status"] == ("passed" if judged["ci_low"] >= -MARGIN else "failed"), judged
    served = after_bad["served_step"]
    assert served == max([promoted] + [j["step"] for j in judged_bad if j["status"] == "passed"]), judged_bad
    held_back = [j for j in judged_bad if j["status"] == "failed"]
    assert held_back and min(j["ci_high"] for j in held_back) < 0, judged_bad

    # `artgw status` says so too.
    port = gated.url.rsplit(":", 1)[1]
    shown = subprocess.run(
        [ARTGW, "status", "--model", MODEL, "--port", port], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert f"serves step {served}" in shown and f"newest step {bad[-1]} ({MODEL}@latest)" in shown, shown

    # What each alias serves, as recorded with the calls.
    for alias, step in ((MODEL, served), (f"{MODEL}@latest", bad[-1])):
        answer = httpx.post(
            f"{gated.base_url}/chat/completions",
            json={"model": alias, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"X-ART-Rollout-Id": f"alias-{step}"},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        calls = httpx.get(f"{gated.base_url}/art/rollouts/alias-{step}", timeout=10).json()["calls"]
        assert calls[0]["step"] == step, calls[0]

    # The gate's own calls were recorded, and no group may take them.
    page = httpx.get(
        f"{gated.base_url}/art/rollouts", params={"model": MODEL, "since": bad_started, "limit": 1000}, timeout=10
    ).json()
    eval_ids = [r["id"] for r in page["data"] if r["id"].startswith("artgw-eval:")]
    assert eval_ids
    refused = httpx.post(
        f"{gated.base_url}/art/groups",
        json={"model": MODEL, "rollouts": [{"rollout_id": i, "reward": 1.0} for i in eval_ids[:2]]},
        timeout=10,
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "eval_rollout", refused.text

    # By hand: roll back to the step promoted before, then promote the newest; both in the history.
    back = httpx.post(
        f"{gated.base_url}/art/models/{MODEL}/rollback", json={"reason": "test"}, headers=gated.admin, timeout=60
    )
    assert back.status_code == 200, back.text
    previous = after_bad["promotions"][0]["previous_step"]  # what the newest promotion replaced
    assert back.json()["served_step"] == previous
    forward = httpx.post(
        f"{gated.base_url}/art/models/{MODEL}/promote", json={"step": bad[-1]}, headers=gated.admin, timeout=60
    )
    assert forward.status_code == 200 and forward.json()["served_step"] == bad[-1], forward.text
    history = forward.json()["promotions"]
    assert [(p["action"], p["actor"], p["step"]) for p in history[:2]] == [
        ("promote", "admin", bad[-1]),
        ("rollback", "admin", previous),
    ]
    missing = httpx.post(
        f"{gated.base_url}/art/models/{MODEL}/promote", json={"step": 999}, headers=gated.admin, timeout=30
    )
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "step_not_found", missing.text
    keyless = httpx.post(f"{gated.base_url}/art/models/{MODEL}/promote", json={"step": 0}, timeout=30)
    assert keyless.status_code == 401, keyless.text

    samples = metric_samples(gated)
    model = (("model", MODEL),)
    assert samples[("artgw_adapter_step", model)] == bad[-1]
    assert samples[("artgw_adapter_latest_step", model)] == bad[-1]
    gate_promotions = (("action", "promote"), ("actor", "gate"), ("model", MODEL))
    by_gate = [p for p in after_bad["promotions"] if p["actor"] == "gate" and p["action"] == "promote"]
    assert samples[("artgw_promotions_total", gate_promotions)] == len(by_gate) >= len(good)
    assert samples[("artgw_promotions_total", (("action", "rollback"), ("actor", "admin"), ("model", MODEL)))] == 1
    failed = samples[("artgw_gate_evaluations_total", (("model", MODEL), ("status", "failed")))]
    assert failed == len([e for e in after_bad["evaluations"] if e["status"] == "failed"]) >= len(held_back)
