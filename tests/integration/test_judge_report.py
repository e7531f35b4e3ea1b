"""Judge calibration end to end: `GET /v1/art/models/{name}/judge-report`, its gauges on `/metrics`, and
`artgw judge-report`, against a real gateway (in front of the stand-in engine: no generation is involved).

The judged groups are written into the gateway's SQLite store through the store's own functions, as RULER's
scorer leaves them (created `scoring` with the caller's rewards, then `scored`): posting them over the API
would need a real LLM judge. Every expected number is computed here from the raw values with the hand-written
reference of tests/unit/test_judge_report.py, never with the code under test.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from statistics import fmean
from typing import Any

import httpx
import pytest
from PIL import Image

from store import create_engine
from store.groups import MemberScore, NewGroup, NewMember, insert_group, scored
from tests.conftest import ARTGW, GatewayProcess, metric, start_gateway, start_stub, stop_group
from tests.rank_stats import reference_kendall_tau_b, reference_spearman

THRESHOLD = 0.3  # not the default (0.5): the MEDIUM rubric (mean rho 0.45) passes only if the setting reaches it
JUDGE = "openai/gpt-4o-mini"
OTHER_JUDGE = "hosted_vllm/judge"
GOOD = "Correct answers win; the shorter one wins a tie."
MEDIUM = "Be polite."
BAD = "The longest answer wins."

# group id -> (model, judge model, rubric, caller rewards, RULER scores)
GROUPS: dict[str, tuple[str, str, str, list[float], list[float]]] = {
    "good-1": ("my-agent", JUDGE, GOOD, [1, 0, 0.5, 0], [0.9, 0.2, 0.6, 0.1]),
    "good-2": ("my-agent", JUDGE, GOOD, [0, 1, 1], [0.3, 0.8, 0.7]),
    "good-constant": ("my-agent", JUDGE, GOOD, [1, 1, 1], [0.2, 0.4, 0.6]),  # no order on the caller's side
    "medium-1": ("my-agent", JUDGE, MEDIUM, [1, 2, 3], [0.1, 0.3, 0.2]),  # rho 0.5
    "medium-2": ("my-agent", JUDGE, MEDIUM, [0, 1, 2, 3], [0.3, 0.1, 0.2, 0.4]),  # rho 0.4
    "bad-1": ("my-agent", OTHER_JUDGE, BAD, [1, 0, 0], [0.1, 0.9, 0.5]),
    "bad-2": ("my-agent", OTHER_JUDGE, BAD, [0, 1], [0.7, 0.2]),
    "other-1": ("other", JUDGE, GOOD, [0, 1], [0.2, 0.8]),
}


def rid(rubric: str) -> str:
    return hashlib.sha256(rubric.encode()).hexdigest()[:12]


async def write_groups(db_path: Path) -> None:
    engine = create_engine(f"sqlite+aiosqlite:///{db_path}")
    try:
        async with engine.begin() as conn:  # one transaction: the gateway never sees them `scoring`
            for group_id, (model, judge, rubric, caller, judged) in GROUPS.items():
                members = [
                    NewMember(i, f"{group_id}-r{i}", f"{group_id}-r{i}", None, None, reward, None)
                    for i, reward in enumerate(caller)
                ]
                ruler = {"judge_model": judge, "rubric": rubric, "litellm_params": {}}
                await insert_group(conn, NewGroup(group_id, model, "scoring", "h", None, ruler, None, members, ""))
                scores = [MemberScore(i, score, score, "because") for i, score in enumerate(judged)]
                await scored(conn, group_id, scores, judge_usage={}, no_signal=False)
            # Caller rewards alone (no judge): nothing to calibrate against.
            plain = [NewMember(i, f"plain-r{i}", f"plain-r{i}", None, r, r, None) for i, r in enumerate([1.0, 0.0])]
            await insert_group(conn, NewGroup("plain", "my-agent", "ready", "h", None, None, False, plain, ""))
    finally:
        await engine.dispose()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    url, stub = start_stub()
    gateway = start_gateway(
        tmp_path_factory.mktemp("judge-report"),
        "--upstream",
        url,
        models=("my-agent", "other", "fresh"),  # fresh: no judged group at all
        env={"ARTGW_JUDGE_AGREEMENT_THRESHOLD": str(THRESHOLD)},
        isolated=True,
    )
    try:
        asyncio.run(write_groups(gateway.db_path))
        yield gateway
    finally:
        gateway.stop()
        stop_group(stub)


def expected_row(group_ids: Sequence[str]) -> dict[str, Any]:
    """What the report must say of these groups (one rubric and judge), from the raw values."""
    pairs = [(GROUPS[g][3], GROUPS[g][4]) for g in group_ids]
    ranked = [(g, c, j) for g, (c, j) in zip(group_ids, pairs, strict=True) if len(set(c)) > 1 and len(set(j)) > 1]
    pooled_caller = [r for c, _ in pairs for r in c]
    pooled_judge = [s for _, j in pairs for s in j]
    per_group = sorted((reference_spearman(c, j), reference_kendall_tau_b(c, j), g) for g, c, j in ranked)
    return {
        "groups": len(group_ids),
        "ranked_groups": len(ranked),
        "pairs": len(pooled_caller),
        "spearman_mean": fmean(s for s, _, _ in per_group),
        "kendall_mean": fmean(k for _, k, _ in per_group),
        "pooled_spearman": reference_spearman(pooled_caller, pooled_judge),
        "pooled_kendall": reference_kendall_tau_b(pooled_caller, pooled_judge),
        "worst": per_group[:5],
    }


def test_the_report_gives_the_rank_correlations_per_rubric_and_judge(gateway: GatewayProcess) -> None:
    r = httpx.get(f"{gateway.base_url}/art/models/my-agent/judge-report", timeout=120, headers=gateway.admin)
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["model"] == "my-agent" and report["threshold"] == THRESHOLD
    rows = {(row["judge_model"], row["rubric"]): row for row in report["rubrics"]}
    assert set(rows) == {(JUDGE, GOOD), (JUDGE, MEDIUM), (OTHER_JUDGE, BAD)}  # `plain` has no judge
    expected_states = {GOOD: "agrees", MEDIUM: "agrees", BAD: "flagged"}
    for (judge, rubric), row in rows.items():
        ids = [g for g, (model, j, rb, _, _) in GROUPS.items() if model == "my-agent" and (j, rb) == (judge, rubric)]
        want = expected_row(ids)
        assert row["rubric_id"] == rid(rubric)
        assert (row["groups"], row["ranked_groups"], row["pairs"]) == (
            want["groups"],
            want["ranked_groups"],
            want["pairs"],
        )
        for name in ("spearman_mean", "kendall_mean", "pooled_spearman", "pooled_kendall"):
            assert row[name] == pytest.approx(want[name], abs=1e-9), (rubric, name)
        assert [(g["spearman"], g["kendall"], g["group_id"]) for g in row["worst_groups"]] == [
            (pytest.approx(s), pytest.approx(k), g) for s, k, g in want["worst"]
        ]
        assert row["state"] == expected_states[rubric], (rubric, row["spearman_mean"])
    assert rows[JUDGE, MEDIUM]["spearman_mean"] == pytest.approx(0.45)  # below the default 0.5, above 0.3
    assert rows[JUDGE, GOOD]["groups"] == 3 and rows[JUDGE, GOOD]["ranked_groups"] == 2  # the constant group
    # The model's status lists the flagged rubric.
    flags = httpx.get(f"{gateway.base_url}/art/models/my-agent", timeout=120, headers=gateway.admin).json()[
        "judge_flags"
    ]
    assert [(f["judge_model"], f["rubric"], f["state"]) for f in flags] == [(OTHER_JUDGE, BAD, "flagged")]


def test_a_key_sees_the_reports_of_its_models_only(gateway: GatewayProcess) -> None:
    made = httpx.post(
        f"{gateway.base_url}/art/keys",
        json={"name": "other-reader", "models": ["other"], "scopes": ["read"]},
        headers=gateway.admin,
        timeout=120,
    )
    assert made.status_code == 201, made.text
    key = {"Authorization": f"Bearer {made.json()['key']}"}
    hidden = httpx.get(f"{gateway.base_url}/art/models/my-agent/judge-report", headers=key, timeout=120)
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
    # Worded exactly as for a model nobody serves, as GET /v1/art/models/{name} does.
    model_status = httpx.get(f"{gateway.base_url}/art/models/my-agent", headers=key, timeout=120)
    assert model_status.status_code == 404
    assert hidden.json()["error"]["message"] == model_status.json()["error"]["message"]
    own = httpx.get(f"{gateway.base_url}/art/models/other/judge-report", headers=key, timeout=120)
    assert own.status_code == 200, own.text
    [row] = own.json()["rubrics"]
    assert (row["groups"], row["ranked_groups"], row["spearman_mean"]) == (1, 1, pytest.approx(1.0))
    unknown = httpx.get(f"{gateway.base_url}/art/models/nope/judge-report", timeout=120, headers=gateway.admin)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_metrics_show_each_rubrics_agreement_and_flag(gateway: GatewayProcess) -> None:
    # `other`'s report was never asked for over the API here: the scrape makes it.
    agreement = metric(gateway.url, "artgw_judge_agreement", exported=True, model="other", rubric=rid(GOOD))
    assert agreement == pytest.approx(1.0)
    bad = {"model": "my-agent", "rubric": rid(BAD), "judge": OTHER_JUDGE}
    assert metric(gateway.url, "artgw_judge_agreement", **bad) == pytest.approx(
        expected_row(["bad-1", "bad-2"])["spearman_mean"]
    )
    assert metric(gateway.url, "artgw_judge_flagged", **bad) == 1.0
    assert metric(gateway.url, "artgw_judge_flagged", model="my-agent", rubric=rid(GOOD), judge=JUDGE) == 0.0


def artgw(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ARTGW_")}
    # 80 columns, a plain terminal's width: the tables must show every figure whole there.
    return subprocess.run(
        [ARTGW, *args], cwd=cwd, env={**clean, "COLUMNS": "80"}, capture_output=True, text=True, timeout=120
    )


def test_the_cli_prints_the_table_and_writes_the_scatter_plot(gateway: GatewayProcess, tmp_path: Path) -> None:
    png = tmp_path / "judge.png"
    where = ("--gateway", gateway.url, "--data-dir", str(gateway.data_dir))  # the admin key is found there
    result = artgw("judge-report", "--model", "my-agent", "--png", str(png), *where, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count("FLAGGED") == 1  # BAD alone: the MEDIUM rubric's 0.45 passes this gateway's threshold
    for rubric, ids in (
        (GOOD, ["good-1", "good-2", "good-constant"]),
        (MEDIUM, ["medium-1", "medium-2"]),
        (BAD, ["bad-1", "bad-2"]),
    ):
        want = expected_row(ids)
        assert f"rubric {rid(rubric)}: {rubric}" in out
        row = next(line for line in out.splitlines() if line.strip().startswith(rid(rubric)))
        figures = [f"{want[name]:+.3f}" for name in ("spearman_mean", "kendall_mean", "pooled_spearman")]
        assert row.split()[1:6] == [str(want["groups"]), str(want["ranked_groups"]), *figures], row
    assert "worst-agreeing groups" in out and "bad-1" in out and "good-2" in out
    assert "good-constant" not in out  # constant groups have no correlation to list
    assert f"written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as image:
        image.verify()  # every chunk's CRC and the structure
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (700, 500)


def test_cli_errors_are_one_line(gateway: GatewayProcess, tmp_path: Path) -> None:
    where = ("--gateway", gateway.url, "--data-dir", str(gateway.data_dir))
    for args, words in (
        (("--model", "nope"), "404"),
        (("--model", "my-agent", "--png", str(tmp_path / "no-such-dir" / "x.png")), "no-such-dir"),
    ):
        result = artgw("judge-report", *args, *where, cwd=tmp_path)
        assert result.returncode == 1, result
        assert "Traceback" not in result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("artgw judge-report: ") and words in lines[0], result.stderr


def test_a_model_with_no_judged_group_has_an_empty_report_and_no_plot(gateway: GatewayProcess, tmp_path: Path) -> None:
    r = httpx.get(f"{gateway.base_url}/art/models/fresh/judge-report", timeout=120, headers=gateway.admin)
    assert r.status_code == 200 and r.json()["rubrics"] == []
    png = tmp_path / "none.png"
    where = ("--gateway", gateway.url, "--data-dir", str(gateway.data_dir))
    result = artgw("judge-report", "--model", "fresh", "--png", str(png), *where, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "no group of fresh has both caller rewards and RULER scores yet" in result.stdout
    assert not png.exists()


def test_a_key_gets_the_models_figures_but_no_other_owners_group_ids(gateway: GatewayProcess) -> None:
    """Group ids are per key (#40): the report's figures are the model's, for every reader of it, but its worst
    groups are named only to a reader that may read them. Before: any `read` key of the model got every owner's
    group ids (here the admin's, all of them)."""
    body = {"name": "reader", "models": ["my-agent"], "scopes": ["read"]}
    made = httpx.post(f"{gateway.base_url}/art/keys", json=body, headers=gateway.admin, timeout=30)
    assert made.status_code == 201, made.text
    path = f"{gateway.base_url}/art/models/my-agent/judge-report"
    admins = httpx.get(path, timeout=120, headers=gateway.admin).json()
    keys = httpx.get(path, timeout=120, headers={"Authorization": f"Bearer {made.json()['key']}"}).json()
    assert any(row["worst_groups"] for row in admins["rubrics"])
    assert [row["worst_groups"] for row in keys["rubrics"]] == [[] for _ in keys["rubrics"]]
    figures = [{k: v for k, v in row.items() if k != "worst_groups"} for row in admins["rubrics"]]
    assert [{k: v for k, v in row.items() if k != "worst_groups"} for row in keys["rubrics"]] == figures
