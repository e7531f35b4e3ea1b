"""`/v1/art/groups`: validation errors, idempotent retries, life cycle, n > 1 groups, RULER end to end.

Validation and life-cycle tests record their rollouts through a stand-in engine (tests/stub_engine.py): they
exercise the groups API, not generation. RULER and n > 1 groups run against the real vLLM.
"""

from __future__ import annotations

import json
import subprocess
import threading
import uuid

import httpx
import pytest

from tests.conftest import ARTGW, metric, poll, start_stub, stop_group
from tests.stand_in_judge import StandInJudge, write_judges

CHAT = {"model": "my-agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def panel_judges():
    """The stub gateway's judges, as its operator names them (--judges-file): stand-ins whose `answer` a test
    sets (tests/stand_in_judge.py: no paid judge runs here)."""
    judges = {name: StandInJudge(lambda blocks, _: {"scores": {}}) for name in ("a", "b", "contrary")}
    yield judges
    for judge in judges.values():
        judge.close()


@pytest.fixture(scope="module")
def stub_gateway(tmp_path_factory, panel_judges):
    from tests.conftest import start_gateway

    where = tmp_path_factory.mktemp("groups")
    url, proc = start_stub()
    gateway = start_gateway(
        where, "--upstream", url, "--judges-file", str(write_judges(where / "judges.json", panel_judges))
    )
    yield gateway
    gateway.stop()
    stop_group(proc)


def record(gateway, n: int = 1, **extra) -> str:
    rid = f"r-{uuid.uuid4().hex[:10]}"
    r = httpx.post(
        f"{gateway.base_url}/chat/completions",
        json={**CHAT, "n": n, **extra},
        headers={"X-ART-Rollout-Id": rid},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return rid


def post_group(gateway, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}/art/groups", json=body, headers={**gateway.admin, **headers}, timeout=30)


def scored(gateway, group_id: str, seconds: float) -> dict:
    """The group once RULER is done with it (ready or failed)."""

    def done() -> dict | None:
        group = httpx.get(f"{gateway.base_url}/art/groups/{group_id}", headers=gateway.admin).json()
        return None if group["state"] == "scoring" else group

    return poll(done, seconds, f"RULER to score group {group_id}", every=0.25)


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_caller_rewards_make_a_ready_group(stub_gateway) -> None:
    a, b, c = (record(stub_gateway) for _ in range(3))
    body = {
        "model": "my-agent",
        "rollouts": [
            {"rollout_id": a, "reward": 1.0, "metrics": {"len": 3}},
            {"rollout_id": b, "reward": 0.0},
            {"rollout_id": c, "reward": 0.5},
        ],
        "metadata": {"task": "t1"},
    }
    r = post_group(stub_gateway, body)
    assert r.status_code == 201
    group = r.json()
    assert group["state"] == "ready" and group["no_signal"] is False
    assert [x["reward"] for x in group["rollouts"]] == [1.0, 0.0, 0.5]
    assert group["reward_mean"] == pytest.approx(0.5)
    assert group["rollouts"][0]["metrics"] == {"len": 3.0}
    assert group["metadata"] == {"task": "t1"}
    fetched = httpx.get(f"{stub_gateway.base_url}/art/groups/{group['id']}", headers=stub_gateway.admin).json()
    assert fetched == group
    listed = httpx.get(
        f"{stub_gateway.base_url}/art/groups", params={"state": "ready", "limit": 1000}, headers=stub_gateway.admin
    ).json()
    assert group["id"] in [g["id"] for g in listed["data"]]


def test_equal_rewards_are_kept_but_flagged_no_signal(stub_gateway) -> None:
    a, b = record(stub_gateway), record(stub_gateway)
    r = post_group(
        stub_gateway,
        {"model": "my-agent", "rollouts": [{"rollout_id": a, "reward": 1}, {"rollout_id": b, "reward": 1}]},
    )
    assert r.status_code == 201 and r.json()["no_signal"] is True and r.json()["state"] == "ready"


def test_same_request_twice_creates_one_group_by_group_id_and_by_idempotency_key(stub_gateway) -> None:
    a, b = record(stub_gateway), record(stub_gateway)
    body = {
        "model": "my-agent",
        "group_id": f"g-{a}",
        "rollouts": [{"rollout_id": a, "reward": 1}, {"rollout_id": b, "reward": 0}],
    }
    first, again = post_group(stub_gateway, body), post_group(stub_gateway, body)
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json() == again.json()
    assert first.json()["group_id"] == first.json()["id"] == f"g-{a}"  # the request's name, answered back
    changed = {**body, "rollouts": [{"rollout_id": a, "reward": 0}, {"rollout_id": b, "reward": 1}]}
    assert error(post_group(stub_gateway, changed), 409)["code"] == "group_id_conflict"

    c, d = record(stub_gateway), record(stub_gateway)
    body = {"model": "my-agent", "rollouts": [{"rollout_id": c, "reward": 1}, {"rollout_id": d, "reward": 0}]}
    key = f"key-{c}"
    first, again = (
        post_group(stub_gateway, body, **{"Idempotency-Key": key}),
        post_group(stub_gateway, body, **{"Idempotency-Key": key}),
    )
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"] == key


@pytest.mark.parametrize(
    ("case", "status", "code", "param"),
    [
        ("one rollout", 400, "too_few_rollouts", "rollouts"),
        ("unknown rollout", 400, "unknown_rollout", "rollouts[1].rollout_id"),
        ("duplicate", 400, "duplicate_rollout", "rollouts[1].rollout_id"),
        ("infinite reward", 400, None, "rollouts[0].reward"),
        ("missing reward", 400, "missing_reward", "rollouts[1].reward"),
        ("unknown model", 404, "model_not_found", "model"),
        ("unknown judge", 400, "unknown_judge", "ruler.judge_model"),
        ("bad choice ref", 400, None, "rollouts[0].rollout_id"),
        ("unknown field", 400, None, None),
        ("reward not a number", 400, None, "rollouts[0].reward"),
    ],
)
def test_validation_errors_say_what_to_fix(stub_gateway, case: str, status: int, code: str | None, param) -> None:
    a, b = record(stub_gateway), record(stub_gateway)
    rollouts = [{"rollout_id": a, "reward": 1.0}, {"rollout_id": b, "reward": 0.0}]
    body: dict = {"model": "my-agent", "rollouts": rollouts}
    match case:
        case "one rollout":
            body["rollouts"] = rollouts[:1]
        case "unknown rollout":
            rollouts[1]["rollout_id"] = "never-recorded"
        case "duplicate":
            rollouts[1]["rollout_id"] = a
        case "infinite reward":
            body = None  # JSON has no infinity literal; 1e999 overflows to it
        case "missing reward":
            del rollouts[1]["reward"]
        case "unknown model":
            body["model"] = "other-agent"
        case "unknown judge":
            body["ruler"] = {"judge_model": "no-such-provider-xyz"}
        case "bad choice ref":
            rollouts[0]["rollout_id"] = f"{a}/x"
        case "unknown field":
            body["colour"] = "blue"
        case "reward not a number":
            rollouts[0]["reward"] = "high"
    if body is None:
        members = f'{{"rollout_id": "{a}", "reward": 1e999}}, {{"rollout_id": "{b}", "reward": 0}}'
        raw = f'{{"model": "my-agent", "rollouts": [{members}]}}'
        r = httpx.post(
            f"{stub_gateway.base_url}/art/groups",
            content=raw,
            headers={**stub_gateway.admin, "content-type": "application/json"},
        )
    else:
        r = post_group(stub_gateway, body)
    err = error(r, status)
    if code is not None:
        assert err["code"] == code
    assert err["param"] == param
    assert err["message"]


def test_rollout_already_in_another_group_is_409(stub_gateway) -> None:
    a, b, c = (record(stub_gateway) for _ in range(3))
    assert (
        post_group(
            stub_gateway,
            {"model": "my-agent", "rollouts": [{"rollout_id": a, "reward": 1}, {"rollout_id": b, "reward": 0}]},
        ).status_code
        == 201
    )
    r = post_group(
        stub_gateway,
        {"model": "my-agent", "rollouts": [{"rollout_id": c, "reward": 1}, {"rollout_id": a, "reward": 0}]},
    )
    err = error(r, 409)
    assert err["code"] == "rollout_in_group" and err["param"] == "rollouts[1].rollout_id"


def test_rollouts_of_another_model_are_rejected(stub_gateway) -> None:
    a = record(stub_gateway)
    b = record(stub_gateway, model="stub")  # the base model by name: not the trainable model
    err = error(
        post_group(
            stub_gateway,
            {"model": "my-agent", "rollouts": [{"rollout_id": a, "reward": 1}, {"rollout_id": b, "reward": 0}]},
        ),
        400,
    )
    assert err["code"] == "model_mismatch"


# In three fresh clones of session 27 it ran beside test_engine_restart (then vLLM's multiprocess layout, spinning on
# both cores while it generated 60,000 tokens) and took 47, 197 and 179 s (15 s alone), twice never seeing its call
# in flight within 120 s; why is not known (issue 39's note). A failure prints what the busy call got.
def test_rollout_with_a_call_in_flight_is_409(tmp_path) -> None:
    from tests.conftest import hold_stub, start_gateway

    # The engine holds the busy call until the test has seen it in flight and been refused: no window to miss
    url, proc = start_stub()
    gateway = start_gateway(tmp_path, "--upstream", url)
    try:
        done = record(gateway)
        hold_stub(url, True)
        busy = f"busy-{uuid.uuid4().hex[:6]}"
        answered: list[object] = []  # the busy call's answer or exception: what a failure below prints

        def call() -> None:
            try:
                answered.append(
                    httpx.post(
                        f"{gateway.base_url}/chat/completions",
                        json=CHAT,
                        headers={"X-ART-Rollout-Id": busy},
                        timeout=300,
                    )
                )
            except httpx.HTTPError as exc:
                answered.append(exc)

        thread = threading.Thread(target=call)
        thread.start()
        # While the gateway counts the call in flight, its rollout cannot be grouped.
        in_flight = lambda: metric(gateway.url, "artgw_requests_in_flight", model="my-agent") >= 1  # noqa: E731
        try:
            poll(in_flight, 120, "the call in flight")
        except AssertionError as exc:
            hold_stub(url, False)
            thread.join(60)
            raise AssertionError(f"never seen in flight; the busy call got {answered!r}\n{gateway.log()}") from exc
        err = error(
            post_group(
                gateway,
                {
                    "model": "my-agent",
                    "rollouts": [{"rollout_id": done, "reward": 1}, {"rollout_id": busy, "reward": 0}],
                },
            ),
            409,
        )
        assert err["code"] == "rollout_in_flight" and busy in err["message"]
        hold_stub(url, False)
        thread.join()
        assert isinstance(answered[0], httpx.Response) and answered[0].status_code == 200, answered
        r = post_group(
            gateway,
            {"model": "my-agent", "rollouts": [{"rollout_id": done, "reward": 1}, {"rollout_id": busy, "reward": 0}]},
        )
        assert r.status_code == 201
    finally:
        gateway.stop()
        stop_group(proc)


@pytest.mark.engine
def test_one_call_with_n_choices_is_a_group(engine_gateway) -> None:
    rid = record(engine_gateway, n=3)
    refs = [f"{rid}/{k}" for k in range(3)]
    r = post_group(
        engine_gateway,
        {"model": "my-agent", "rollouts": [{"rollout_id": ref, "reward": k} for k, ref in enumerate(refs)]},
    )
    assert r.status_code == 201, r.text
    assert [x["rollout_id"] for x in r.json()["rollouts"]] == refs
    # Each choice is addressable, with its own sampled tokens.
    seqs = [
        httpx.get(f"{engine_gateway.base_url}/art/rollouts/{rid}/{k}", headers=engine_gateway.admin).json()[
            "sequences"
        ][0]
        for k in range(3)
    ]
    second = httpx.get(f"{engine_gateway.base_url}/art/rollouts/{rid}/2", headers=engine_gateway.admin).json()
    calls = second["calls"]
    assert calls[0]["choice"] == 2 and calls[0]["n"] == 3
    assert second["rollout_id"] == f"{rid}/2"  # the name a group gives it
    prompt_len = seqs[0]["sampled_mask"].index(1)
    assert all(s["token_ids"][:prompt_len] == seqs[0]["token_ids"][:prompt_len] for s in seqs)
    # The whole rollout now overlaps its choices.
    other = record(engine_gateway)
    err = error(
        post_group(
            engine_gateway,
            {"model": "my-agent", "rollouts": [{"rollout_id": rid, "reward": 1}, {"rollout_id": other, "reward": 0}]},
        ),
        409,
    )
    assert err["code"] == "rollout_in_group"


@pytest.mark.engine
def test_ruler_scores_a_group_with_the_real_vllm_as_judge(engine_gateway) -> None:
    """The plumbing is real end to end: litellm → vLLM's OpenAI server with JSON-schema structured output.
    The tiny random judge's scores mean nothing; that they are valid, stored and become rewards does."""
    rollouts = [record(engine_gateway) for _ in range(3)]
    body = {
        "model": "my-agent",
        "rollouts": [{"rollout_id": r, "reward": float(i)} for i, r in enumerate(rollouts)],
        # The engine gateway's judges file names it (tests/conftest.py): endpoint, key and logit bias are its.
        "ruler": {
            "judge_model": "hosted_vllm/tiny",
            "rubric": "Prefer short answers.",
            "litellm_params": {"temperature": 1.0},
        },
    }
    r = post_group(engine_gateway, body)
    assert r.status_code == 201, r.text
    assert r.json()["state"] == "scoring"
    assert "sk-secret" not in r.text
    group_id = r.json()["id"]

    group = scored(engine_gateway, group_id, 120)
    # A random judge may fail validation on every retry; then the group says so and why.
    assert group["state"] in ("ready", "failed"), group
    if group["state"] == "failed":
        assert group["failure_reason"].startswith("RULER failed")
        pytest.fail(f"the tiny judge never produced valid scores: {group['failure_reason']}")
    scores = [x["ruler_score"] for x in group["rollouts"]]
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert [x["reward"] for x in group["rollouts"]] == scores
    assert [x["caller_reward"] for x in group["rollouts"]] == [0.0, 1.0, 2.0]
    assert all(x["ruler_explanation"] is not None for x in group["rollouts"])
    assert group["judge_usage"]["judge_calls"] >= 1 and group["judge_usage"]["prompt_tokens"] > 0
    assert group["ruler"]["litellm_params"] == {"temperature": 1.0}  # the caller's, never the operator's
    assert (
        "sk-secret"
        not in httpx.get(f"{engine_gateway.base_url}/art/groups/{group_id}", headers=engine_gateway.admin).text
    )


def by_length(longer_is_better: bool):
    """A stand-in judge's answer: each trajectory scored by the length of what it is shown."""

    def answer(blocks, _request):
        scores = {}
        for tid, text in blocks:
            share = min(1.0, len(text) / 400)
            scores[tid] = {"explanation": f"{len(text)} characters", "score": share if longer_is_better else 1 - share}
        return {"scores": scores}

    return answer


def test_a_panel_on_the_stub_engine_scores_spreads_and_drops_a_split_group(stub_gateway, panel_judges) -> None:
    """Two stand-in judges of the operator's (tests/stand_in_judge.py: no paid judge runs here) through litellm:
    when they agree the group is ready with each rollout's spread and the panel's agreement; when they disagree
    past `max_spread` the group fails, says why, and keeps its scores to look at."""
    agree_a, agree_b, contrary = (panel_judges[name] for name in ("a", "b", "contrary"))
    agree_a.answer, agree_b.answer, contrary.answer = by_length(True), by_length(True), by_length(False)
    calls = agree_a.calls, agree_b.calls
    rollouts = [
        record(stub_gateway, messages=[{"role": "user", "content": "say hi" + " please" * (8 * i)}]) for i in range(3)
    ]

    def panel(judges, **extra) -> dict:
        body = {
            "model": "my-agent",
            "rollouts": [{"rollout_id": r, "reward": float(i)} for i, r in enumerate(rollouts)],
            "ruler": {"judges": judges, "samples": 3, **extra},
        }
        r = post_group(stub_gateway, body)
        assert r.status_code == 201, r.text
        return scored(stub_gateway, r.json()["id"], 60)

    judges = [{"judge_model": "a"}, {"judge_model": "b", "litellm_params": {"temperature": 0}}]
    group = panel(judges, max_spread=0.1)
    assert group["state"] == "ready", group["failure_reason"]
    scores = [m["ruler_score"] for m in group["rollouts"]]
    assert scores == sorted(scores) and scores[0] < scores[-1]  # longer histories score higher, by both
    assert [m["ruler_spread"] for m in group["rollouts"]] == pytest.approx([0.0, 0.0, 0.0], abs=1e-12)
    assert group["judge_spread"] == pytest.approx(0.0, abs=1e-12) and group["judge_agreement"] == pytest.approx(1.0)
    assert group["judge_usage"]["judge_calls"] == 6  # 2 judges x 3 orders
    assert (agree_a.calls - calls[0], agree_b.calls - calls[1]) == (3, 3)

    rollouts = [record(stub_gateway, messages=[{"role": "user", "content": "hi" + "!" * (40 * i)}]) for i in range(3)]
    judges[1] = {"judge_model": "contrary"}
    split = panel(judges, max_spread=0.1)
    assert split["state"] == "failed"
    assert split["failure_reason"].startswith("the judges disagree: spread ")
    assert split["judge_spread"] > 0.1 and split["judge_agreement"] == pytest.approx(-0.2)  # 9 pairs opposed, 6 alike
    assert all(m["ruler_score"] is not None and m["ruler_spread"] > 0 for m in split["rollouts"])
    # `artgw export`: each rollout's line carries the groups it is in, with what it was rewarded and how.
    exported = subprocess.run(
        [ARTGW, "export", "--data-dir", str(stub_gateway.data_dir)], capture_output=True, text=True, check=True
    )
    lines = {line["rollout_id"]: line for line in map(json.loads, exported.stdout.splitlines())}
    (membership,) = lines[rollouts[0]]["groups"]
    assert membership["group_id"] == split["id"] and membership["rollout_ref"] == rollouts[0]
    assert membership["ruler_score"] == split["rollouts"][0]["ruler_score"]
    assert membership["ruler_spread"] == split["rollouts"][0]["ruler_spread"] > 0


@pytest.mark.parametrize(
    ("ruler", "param", "says"),
    [
        ({}, "ruler.judge_model", "one of the two"),
        ({"judge_model": "a", "judges": [{"judge_model": "b"}]}, "ruler.judges", "one of the two"),
        ({"judges": [{"judge_model": "openai/gpt-4o-mini"}]}, "ruler.judges[0].judge_model", "Unknown judge"),
        ({"judge_model": "a", "litellm_params": {"api_base": "http://127.0.0.1:1"}}, "ruler.litellm_params.api_base",
         "a judge's endpoint, keys and headers are its operator's"),
        ({"judge_model": "a", "criteria": [{"name": "a", "description": "x", "weight": 0}]}, "ruler.criteria",
         "weight > 0"),
        ({"judge_model": "a", "checks": [{"grader": {"type": "ruler"}}]}, "ruler.checks[0]", "Invalid value 'ruler'"),
        (
            {"judge_model": "a", "checks": [{"grader": {"type": "exact", "value": "x"}, "on_fail": "subtract"}]},
            "ruler.checks[0]",
            "needs a `weight` above 0",
        ),
        (
            {"judge_model": "a", "checks": [{"grader": {"type": "webhook", "url": "http://127.0.0.1:1/reward"}}]},
            "ruler.checks[0].grader.url",
            "only to an endpoint this gateway's operator allows",
        ),
    ],
)  # fmt: skip
def test_a_panel_that_cannot_run_is_a_400(stub_gateway, ruler: dict, param: str, says: str) -> None:
    body = {"model": "my-agent", "rollouts": [{"rollout_id": "r-a"}, {"rollout_id": "r-b"}], "ruler": ruler}
    err = error(post_group(stub_gateway, body), 400)
    assert err["param"] == param and says in err["message"], err


@pytest.mark.engine
def test_a_panel_of_two_judges_two_samples_two_criteria_and_a_hard_check(engine_gateway) -> None:
    """#29 end to end with the gateway's own tiny model as both judges (litellm → vLLM, schema-enforced): every
    rollout gets both criteria's scores and a spread, the reward is their weighted mean unless the hard
    `json_schema` check failed (then 0), and the usage counts every judgement. Only one rollout answered a JSON
    object (its call asked for one); the others' free text fails the check."""
    as_json = {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object", "properties": {},
               "additionalProperties": False}}}  # fmt: skip
    rollouts = [record(engine_gateway, max_tokens=24, response_format=as_json)]
    rollouts += [record(engine_gateway) for _ in range(2)]
    body = {
        "model": "my-agent",
        "rollouts": [{"rollout_id": r, "reward": float(i)} for i, r in enumerate(rollouts)],
        "ruler": {
            "judges": [  # both the engine gateway's judges file names (tests/conftest.py)
                {"judge_model": "hosted_vllm/tiny", "litellm_params": {"temperature": 1.0}},
                {"judge_model": "openai/tiny", "litellm_params": {"temperature": 0.7}},
            ],
            "samples": 2,
            "criteria": [
                {"name": "correct", "description": "Does it answer the greeting?", "weight": 3},
                {"name": "brief", "description": "Is it short?", "weight": 1},
            ],
            "checks": [{"grader": {"type": "json_schema", "schema": {"type": "object"}}}],
        },
    }
    r = post_group(engine_gateway, body)
    assert r.status_code == 201, r.text
    assert "sk-secret" not in r.text
    group_id = r.json()["id"]

    group = scored(engine_gateway, group_id, 300)
    assert group["state"] == "ready", group.get("failure_reason")
    members = group["rollouts"]
    for member in members:
        criteria = member["ruler_criteria"]
        assert set(criteria) == {"correct", "brief"} and all(0 <= v <= 1 for v in criteria.values())
        assert member["ruler_score"] == pytest.approx((3 * criteria["correct"] + criteria["brief"]) / 4)
        assert member["ruler_spread"] is not None and member["ruler_spread"] >= 0
        assert [c["check"] for c in member["checks"]] == ["json_schema"]
    assert [c["checks"][0]["passed"] for c in members] == [True, False, False]
    assert members[0]["reward"] == pytest.approx(members[0]["ruler_score"])
    assert [m["reward"] for m in members[1:]] == [0.0, 0.0]  # the judges never override a failed hard check
    assert group["judge_spread"] is not None and group["judge_spread"] >= 0
    # Four judgements (2 judges x 2 orders), each one call unless a random judge's answer had to be asked again.
    usage = group["judge_usage"]
    assert usage["judgements"] == 4 and usage["judge_calls"] + usage["cache_hits"] >= 4 and usage["prompt_tokens"] > 0
    assert group["ruler"]["samples"] == 2 and [j["judge_model"] for j in group["ruler"]["judges"]] == [
        "hosted_vllm/tiny",
        "openai/tiny",
    ]
    assert (
        "sk-secret"
        not in httpx.get(f"{engine_gateway.base_url}/art/groups/{group_id}", headers=engine_gateway.admin).text
    )


def test_grouped_rollouts_count_their_calls_sequences_and_split_causes(stub_gateway) -> None:
    """#25's figures on /metrics, counted when a group is made (the rollouts training reads): two rollouts of two
    calls each, the second call sending back the first one's reply. The stand-in engine's prompt ids never
    extend a sequence, so each call is a sequence of its own, split because it was served as sent: the stand-in
    has no scale-out endpoints to continue a rollout with (the cause the continuing call recorded)."""
    url = stub_gateway.url
    before = {
        name: metric(url, name, model="my-agent")
        for name in ("artgw_grouped_rollout_calls_total", "artgw_grouped_rollout_sequences_total")
    }
    served_as_sent = metric(url, "artgw_sequence_splits_total", model="my-agent", cause="no_scale_out")
    rollouts = []
    for _ in range(2):
        rid = f"two-turns-{uuid.uuid4().hex[:8]}"
        first = httpx.post(
            f"{stub_gateway.base_url}/chat/completions", json=CHAT, headers={"X-ART-Rollout-Id": rid}, timeout=30
        )
        assert first.status_code == 200, first.text
        history = [*CHAT["messages"], first.json()["choices"][0]["message"], {"role": "user", "content": "and?"}]
        second = httpx.post(
            f"{stub_gateway.base_url}/chat/completions",
            json={**CHAT, "messages": history},
            headers={"X-ART-Rollout-Id": rid},
            timeout=30,
        )
        assert second.status_code == 200, second.text
        rollouts.append({"rollout_id": rid, "reward": float(len(rollouts))})
    made = post_group(stub_gateway, {"model": "my-agent", "rollouts": rollouts})
    assert made.status_code == 201, made.text
    assert (
        metric(url, "artgw_grouped_rollout_calls_total", model="my-agent") - before["artgw_grouped_rollout_calls_total"]
        == 4
    )
    assert (
        metric(url, "artgw_grouped_rollout_sequences_total", model="my-agent")
        - before["artgw_grouped_rollout_sequences_total"]
        == 4
    )
    assert metric(url, "artgw_sequence_splits_total", model="my-agent", cause="no_scale_out") - served_as_sent == 2
    again = post_group(stub_gateway, {"model": "my-agent", "group_id": made.json()["id"], "rollouts": rollouts})
    assert again.status_code == 200  # the same group: counted once
    assert metric(url, "artgw_sequence_splits_total", model="my-agent", cause="no_scale_out") - served_as_sent == 2
