"""Gated promotion end to end, every decision known in advance: `artgw serve --promotion gated` and `artgw train`
as processes, in front of the stand-in engine (tests/stub_engine.py) whose `--answers` script what each step's
adapter answers. The steps are real (LoRA steps of the tiny model, trained from recorded groups and loaded as
the trainer loads them); what they answer the eval set is the script's, so the gate's verdict on each is fixed:

- step 1 answers "yes" where the base answered "no": better, the gate promotes it;
- step 2 answers "no": clearly worse than step 1, held back; `my-agent` keeps serving step 1 while
  `my-agent@latest` serves step 2, and calls made all along are answered;
- step 3 answers "yes": as good as step 1, not worse, promoted;
- step 4 answers "no": held back again;
- an admin's rollback and promote move `my-agent` by hand; every move is in the history with its reason, and
  in the Prometheus counters.

What a real training run learns is the business of tests/integration/test_trainer_e2e.py (and the gate's interval
rule of tests/unit/test_gate.py); the real engine serving gated steps, of the canary's test.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ARTGW, Background, GatewayProcess, gateway_on_stub, poll, start_trainer, stop_group

MODEL = "my-agent"
RIGHT = "yes"
# What each step's adapter answers (the base, step 0, answers "no" like any model not named).
ANSWERS = {f"{MODEL}@1": RIGHT, f"{MODEL}@2": "no", f"{MODEL}@3": RIGHT, f"{MODEL}@4": "no", "*": "no"}
STEPS = 4
EVAL_SCENARIOS = 4
SAMPLES = 2
MARGIN = 0.0  # not worse at all: equal answers pass (the interval of identical scores is [0, 0])


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with gateway_on_stub(
        tmp_path_factory.mktemp("gated"),
        *("--promotion", "gated", "--gate-margin", str(MARGIN)),
        stub_args=("--answers", json.dumps(ANSWERS)),
    ) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def trainer(gated: GatewayProcess, tiny_model: Path) -> Iterator[subprocess.Popen[bytes]]:
    """One group a step: each round's group trains the next step."""
    proc, log_path = start_trainer(
        gated, tiny_model, *("--groups-per-step", "1", "--min-groups-per-step", "1", "--max-wait", "1", "--seed", "0")
    )
    yield proc
    stop_group(proc)
    print(f"--- trainer log (tail) ---\n{log_path.read_text(errors='replace')[-3000:]}")


def status(gateway: GatewayProcess) -> dict[str, Any]:
    answer = httpx.get(f"{gateway.base_url}/art/models/{MODEL}", timeout=10, headers=gateway.admin)
    answer.raise_for_status()
    return answer.json()


def train_round(gateway: GatewayProcess, round_: int) -> int:
    """One group of two recorded rollouts (rewards 1 and 0: a signal to train on), posted; returns its step once
    the gate has judged it and its decision shows in what `my-agent` serves."""
    rollouts = []
    for k, reward in enumerate((1.0, 0.0)):
        rollout_id = f"p{round_}-{k}"
        answer = httpx.post(
            f"{gateway.base_url}/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Did it pass?"}], "max_tokens": 4},
            headers={"X-ART-Rollout-Id": rollout_id},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        rollouts.append({"rollout_id": rollout_id, "reward": reward})
    group_id = f"pg-{round_}"
    body = {"model": MODEL, "group_id": group_id, "rollouts": rollouts}
    httpx.post(f"{gateway.base_url}/art/groups", json=body, timeout=30, headers=gateway.admin).raise_for_status()

    def judged() -> int | None:
        group = httpx.get(f"{gateway.base_url}/art/groups/{group_id}", timeout=10, headers=gateway.admin).json()
        if group["state"] != "trained":
            return None
        step, now = int(group["trained_step"]), status(gateway)
        done = [e for e in now["evaluations"] if e["step"] == step and e["status"] != "running"]
        if not done:
            return None
        # A step that passed is promoted just after its evaluation is written: wait for the move to show.
        if all(e["status"] == "passed" for e in done) and now["served_step"] != step:
            return None
        return step

    return int(poll(judged, 300, f"round {round_}'s step to be trained and judged", every=0.3))


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
    gated: GatewayProcess, trainer: subprocess.Popen[bytes]
) -> None:
    eval_set = {
        "name": "says-yes",
        "samples": SAMPLES,
        "scenarios": [
            {
                "messages": [{"role": "user", "content": f"Did motion {i} pass?"}],
                "params": {"max_tokens": 4},
                "grader": {"type": "exact", "value": RIGHT},
            }
            for i in range(EVAL_SCENARIOS)
        ],
    }
    created = httpx.post(f"{gated.base_url}/art/models/{MODEL}/evals", json=eval_set, headers=gated.admin, timeout=30)
    assert created.status_code == 201, created.text
    listed = httpx.get(f"{gated.base_url}/art/models/{MODEL}/evals", timeout=10, headers=gated.admin).json()["data"]
    assert [s["name"] for s in listed] == ["says-yes"]
    first = status(gated)
    assert (first["promotion"], first["served_step"], first["latest_step"]) == ("gated", 0, 0)

    verdicts: dict[int, dict[str, Any]] = {}
    started = time.time()
    with Background(gated.base_url, MODEL) as background:
        for round_ in range(1, STEPS + 1):
            assert train_round(gated, round_) == round_
            now = status(gated)
            verdicts[round_] = {"served": now["served_step"], **evaluation(now, round_)}
    assert background.calls > 0 and not background.failures, background.failures[:5]
    final = status(gated)

    # Each verdict as scripted: (served after it, status, the step judged against, its mean, the baseline's).
    got = {
        step: (v["served"], v["status"], v["baseline_step"], v["mean"], v["baseline_mean"])
        for step, v in verdicts.items()
    }
    assert got == {
        1: (1, "passed", 0, 1.0, 0.0),  # better than the base: promoted
        2: (1, "failed", 1, 0.0, 1.0),  # clearly worse than step 1: held back
        3: (3, "passed", 1, 1.0, 1.0),  # as good as step 1 (CI [0, 0] >= -margin): promoted
        4: (3, "failed", 3, 0.0, 1.0),  # held back again
    }, got
    assert all(v["ci_high"] < 0 for v in (verdicts[2], verdicts[4]))
    assert (final["served_step"], final["latest_step"]) == (3, 4)
    assert [(p["action"], p["actor"], p["step"]) for p in final["promotions"]] == [
        ("promote", "gate", 3),
        ("promote", "gate", 1),
    ]

    # `artgw status` says so too.
    port = gated.url.rsplit(":", 1)[1]
    shown = subprocess.run(
        [ARTGW, "status", "--model", MODEL, "--port", port, "--data-dir", str(gated.data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "serves step 3" in shown and f"newest step 4 ({MODEL}@latest)" in shown, shown

    # What each alias serves, as recorded with the calls, and answered by that step's adapter.
    for alias, step in ((MODEL, 3), (f"{MODEL}@latest", 4)):
        answer = httpx.post(
            f"{gated.base_url}/chat/completions",
            json={"model": alias, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"X-ART-Rollout-Id": f"alias-{step}"},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == ANSWERS[f"{MODEL}@{step}"]
        calls = httpx.get(f"{gated.base_url}/art/rollouts/alias-{step}", timeout=10, headers=gated.admin).json()[
            "calls"
        ]
        assert calls[0]["step"] == step, calls[0]

    # The gate's own calls were recorded, and no group may take them.
    page = httpx.get(
        f"{gated.base_url}/art/rollouts",
        params={"model": MODEL, "since": started, "limit": 1000},
        timeout=10,
        headers=gated.admin,
    ).json()
    eval_ids = [r["id"] for r in page["data"] if r["id"].startswith("artgw-eval:")]
    assert eval_ids
    refused = httpx.post(
        f"{gated.base_url}/art/groups",
        json={"model": MODEL, "rollouts": [{"rollout_id": i, "reward": 1.0} for i in eval_ids[:2]]},
        timeout=10,
        headers=gated.admin,
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "eval_rollout", refused.text

    # By hand: roll back to the step promoted before, then promote the newest; both in the history.
    back = httpx.post(
        f"{gated.base_url}/art/models/{MODEL}/rollback", json={"reason": "test"}, headers=gated.admin, timeout=60
    )
    assert back.status_code == 200, back.text
    assert back.json()["served_step"] == 1  # what the newest promotion (of step 3) replaced
    forward = httpx.post(
        f"{gated.base_url}/art/models/{MODEL}/promote", json={"step": 4}, headers=gated.admin, timeout=60
    )
    assert forward.status_code == 200 and forward.json()["served_step"] == 4, forward.text
    history = forward.json()["promotions"]
    assert [(p["action"], p["actor"], p["step"]) for p in history[:2]] == [
        ("promote", "admin", 4),
        ("rollback", "admin", 1),
    ]
    missing = httpx.post(
        f"{gated.base_url}/art/models/{MODEL}/promote", json={"step": 999}, headers=gated.admin, timeout=30
    )
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "step_not_found", missing.text
    keyless = httpx.post(f"{gated.base_url}/art/models/{MODEL}/promote", json={"step": 0}, timeout=30)
    assert keyless.status_code == 401, keyless.text

    samples = metric_samples(gated)
    model = (("model", MODEL),)
    assert samples[("artgw_adapter_step", model)] == 4
    assert samples[("artgw_adapter_latest_step", model)] == 4
    assert samples[("artgw_promotions_total", (("action", "promote"), ("actor", "gate"), ("model", MODEL)))] == 2
    assert samples[("artgw_promotions_total", (("action", "rollback"), ("actor", "admin"), ("model", MODEL)))] == 1
    assert samples[("artgw_gate_evaluations_total", (("model", MODEL), ("status", "failed")))] == 2
    assert samples[("artgw_gate_evaluations_total", (("model", MODEL), ("status", "passed")))] == 2
