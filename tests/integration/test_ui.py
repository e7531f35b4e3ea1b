"""The web UI at /ui in a real browser: Debian's headless chromium driven by Selenium, against a gateway in front of
the session's real vLLM (`--auth required`), after real traffic (the demo task's agent over the OpenAI SDK: two
forced tool calls per rollout), two groups of rewarded attempts and one real trainer step.

Checks that each page loads without a browser console error, that the token view shows exactly the tokens the API
recorded (ids, trained/context, logprobs, call boundaries), that the rollout list's filters and pagination work,
and that a page without a key is refused; writes the README's screenshots to docs/ui/*.png (1280x800).
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
import openai
import pytest

from artgw import demo_task
from gateway.ui.views import advantages, token_view
from store.trajectories import assemble
from tests.conftest import (
    ROOT,
    GatewayProcess,
    make_call,
    poll,
    start_gateway,
    start_stub,
    start_trainer,
    stop_group,
)
from tests.stand_in_judge import StandInJudge, write_judges

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SHOTS = ROOT / "docs" / "ui"
MODEL = "my-agent"
SCENARIOS = 2  # groups
ATTEMPTS = 4  # rollouts per group: 8 in all, more than the pages of 3 the list test asks for

# The browser tests need the real vLLM and Debian's chromium; the rest of the module runs on the stand-in engine.
NEEDS_CHROMIUM = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="Debian's chromium and chromium-driver are not installed (scripts/test installs them)",
)


@dataclass
class Site:
    gateway: GatewayProcess
    key: str  # a client key: my-agent, infer + reward + read
    key_id: str
    episodes: list[demo_task.Episode]
    group_ids: list[str]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def api(self, path: str) -> Any:
        answer = httpx.get(f"{self.gateway.url}{path}", headers=self.headers, timeout=30)
        answer.raise_for_status()
        return answer.json()


def _make_key(gateway: GatewayProcess, name: str, scopes: list[str]) -> dict[str, Any]:
    answer = httpx.post(
        f"{gateway.url}/v1/art/keys",
        headers=gateway.admin,
        json={"name": name, "models": [MODEL], "scopes": scopes},
        timeout=30,
    )
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


async def _traffic(gateway: GatewayProcess, key: str, bias: dict[str, dict[str, int]]) -> list[demo_task.Episode]:
    client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=120)
    jobs = [(s, f"ui-{s.id}-{k}") for s in demo_task.scenarios("train", SCENARIOS, seed=7) for k in range(ATTEMPTS)]
    try:
        return await demo_task.run_episodes(client, jobs, model=MODEL, logit_bias=bias, concurrency=4)
    finally:
        await client.close()


@pytest.fixture(scope="module")
def site(vllm_url: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    gateway = start_gateway(tmp_path_factory.mktemp("ui"), "--upstream", vllm_url, "--auth", "required")
    try:
        made = _make_key(gateway, "ui-agent", ["infer", "reward", "read"])
        episodes = asyncio.run(_traffic(gateway, made["key"], demo_task.call_logit_bias(tiny_model)))
        assert not [e.error for e in episodes if e.error]
        group_ids = []
        for scenario_id in dict.fromkeys(e.scenario_id for e in episodes):
            attempts = [e for e in episodes if e.scenario_id == scenario_id]
            body = msgspec.to_builtins(demo_task.group_body(MODEL, attempts, group_id=f"ui-group-{scenario_id}"))
            if len({r["reward"] for r in body["rollouts"]}) == 1:
                # All attempts scored alike (vLLM's sampling is not seeded; 1 run in 64 for both groups): no
                # learning signal, and the trainer would take no step, which the pages need. One reward flipped.
                body["rollouts"][0]["reward"] = 1.0 - body["rollouts"][0]["reward"]
            answer = httpx.post(
                f"{gateway.url}/v1/art/groups", json=body, headers={"Authorization": f"Bearer {made['key']}"}
            )
            assert answer.status_code == 201, answer.text
            group_ids.append(body["group_id"])
        site = Site(gateway, made["key"], made["id"], episodes, group_ids)
        _train_one_step(site, tiny_model)
        yield site
    finally:
        gateway.stop()


def _train_one_step(site: Site, tiny_model: Path) -> None:
    """One real GRPO step on the two groups, served before the pages are looked at (models page, trained step)."""
    options = ("--groups-per-step", str(SCENARIOS), "--min-groups-per-step", "1", "--max-wait", "5")
    proc, log_path = start_trainer(site.gateway, tiny_model, *options, "--max-steps", "1")
    try:
        poll(
            lambda: site.api(f"/v1/art/models/{MODEL}")["latest_step"] >= 1 or None,
            400,
            "the trainer's first step to be served",
            every=1.0,
            alive=[proc],
        )
    except BaseException:
        print(log_path.read_text(errors="replace")[-4000:])
        raise
    finally:
        stop_group(proc)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless chromium at 1280x800, keeping the console's messages; Selenium Manager never downloads a thing."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # belt and braces: the paths below already leave it nothing to find
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,800"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    # The page itself 1280x800 (the window's size includes headless chromium's own frame).
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False}
    )
    try:
        yield driver
    finally:
        driver.quit()


def visit(driver: Any, url: str, shot: str | None = None) -> None:
    """Load a page; no console error may come of it (nor of what it loads). `shot`: save docs/ui/<shot>.png."""
    driver.get(url)
    errors = [entry for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "ERROR")]
    assert errors == [], f"console errors on {url}: {errors}"
    if shot is not None:
        screenshot(driver, shot)


def screenshot(driver: Any, name: str) -> None:
    """docs/ui/<name>.png for the README: the 1280x800 window, small enough to commit."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    driver.save_screenshot(str(path))
    assert path.stat().st_size < 600_000


def login(driver: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    visit(driver, f"{site.gateway.url}/ui/login")
    from selenium.webdriver.support.ui import WebDriverWait

    driver.find_element(By.ID, "key").send_keys(site.key)
    driver.find_element(By.CSS_SELECTOR, "#login button").click()
    # The form posts, then redirects: wait until the browser has left the login page.
    WebDriverWait(driver, 30).until(lambda d: "/ui/login" not in d.current_url)


@pytest.mark.engine
@NEEDS_CHROMIUM
def test_a_page_without_a_key_is_refused(site: Site, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url = site.gateway.url
    browser.delete_all_cookies()
    visit(browser, f"{url}/ui/rollouts?limit=3")  # no key: to the login page, which knows where to go back
    assert browser.current_url == f"{url}/ui/login?next={quote('/ui/rollouts?limit=3', safe='')}"
    screenshot(browser, "login")
    browser.find_element(By.ID, "key").send_keys("not-a-key")
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.ID, "login-error"))  # the 401 page is in
    assert "Incorrect API key" in browser.find_element(By.ID, "login-error").text
    browser.get_log("browser")  # the 401 answer's own console line: expected here
    # Scripts: a wrong key is a 401, a key without `read` a 403; neither gets a page.
    assert httpx.get(f"{url}/ui/rollouts", headers={"Authorization": "Bearer nope"}).status_code == 401
    infer_only = _make_key(site.gateway, "ui-infer-only", ["infer"])["key"]
    refused = httpx.get(f"{url}/ui/models", headers={"Authorization": f"Bearer {infer_only}"})
    assert refused.status_code == 403 and "read" in refused.text
    assert httpx.get(f"{url}/ui/models", headers=site.headers).status_code == 200  # a reader's header: in
    # The right key at the login form: the session cookie (HttpOnly, SameSite=Strict), then the page asked for.
    login(browser, site)
    assert browser.current_url.endswith("/ui/rollouts")
    cookie = browser.get_cookie("artgw_ui_session")
    assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert browser.execute_script("return document.cookie") == ""  # no script on the page can read the key


def _click_to_next_page(driver: Any, button: str) -> None:
    """Click what loads the list's next page, then wait until a new document has loaded (a click may return
    first). The old page is marked and the wait is for a complete document without the mark: asking an old
    element whether it is stale (`staleness_of`) can itself fail while the page is replaced (Chromium answers
    "Node with given id does not belong to the document", not a stale-element error)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.execute_script("window.artgwOldPage = true")
    driver.find_element(By.CSS_SELECTOR, button).click()
    WebDriverWait(driver, 30, ignored_exceptions=(WebDriverException,)).until(
        lambda d: d.execute_script("return window.artgwOldPage === undefined && document.readyState === 'complete'")
    )


def _listed(driver: Any) -> list[str]:
    from selenium.webdriver.common.by import By

    return [row.get_attribute("data-rollout") for row in driver.find_elements(By.CSS_SELECTOR, "tr.rollout-row")]


@pytest.mark.engine
@NEEDS_CHROMIUM
def test_rollout_list_filters_and_pages(site: Site, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    url = site.gateway.url
    login(browser, site)
    recorded = [row["id"] for row in site.api("/v1/art/rollouts?limit=1000")["data"]][::-1]  # the UI: newest first
    assert len(recorded) == SCENARIOS * ATTEMPTS
    # Pages of 3, by the form (per page, model), then "older" to the end: every rollout once, newest first.
    visit(browser, f"{url}/ui/rollouts")
    Select(browser.find_element(By.NAME, "model")).select_by_value(MODEL)
    per_page = browser.find_element(By.NAME, "limit")
    per_page.clear()
    per_page.send_keys("3")
    _click_to_next_page(browser, "#filters button")
    seen = _listed(browser)
    screenshot(browser, "rollouts")
    while browser.find_elements(By.ID, "next-page"):
        _click_to_next_page(browser, "#next-page")
        assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert len(_listed(browser)) <= 3
        seen += _listed(browser)
    assert seen == recorded
    # The sequences column: what each rollout trains as, as the API assembles it; a demo episode whose two calls
    # went on from the model's own tokens is one sequence.
    visit(browser, f"{url}/ui/rollouts?limit=50")
    cells = {
        row.get_attribute("data-rollout"): row.find_element(By.CSS_SELECTOR, "td.sequences").text
        for row in browser.find_elements(By.CSS_SELECTOR, "tr.rollout-row")
    }
    assembled = {rid: site.api(f"/v1/art/rollouts/{rid}") for rid in recorded}
    assert cells == {rid: str(len(t["sequences"])) for rid, t in assembled.items()}
    assert any(len(t["calls"]) == 2 and len(t["sequences"]) == 1 for t in assembled.values())
    # The key filter: this key's rollouts, and none of another key's.
    visit(browser, f"{url}/ui/rollouts?key_id={site.key_id}")
    assert _listed(browser) == recorded
    visit(browser, f"{url}/ui/rollouts?key_id=k-nobody")
    assert _listed(browser) == []
    # `since` (UTC, as the form's datetime-local sends it): after the last call, nothing.
    last = site.api("/v1/art/rollouts?limit=1000")["data"][-1]["last_call_at"]
    visit(browser, f"{url}/ui/rollouts?since={last + 1}")
    assert _listed(browser) == []
    visit(browser, f"{url}/ui/rollouts?since=2000-01-01T00:00")
    assert _listed(browser) == recorded
    # Status, API and group, by the form: as the API lists them.
    members = site.api(f"/v1/art/groups/{site.group_ids[0]}")["rollouts"]
    grouped = [r["rollout_id"] for r in members]
    for field, value, want in (
        ("status", "ok", recorded),
        ("status", "upstream_error", []),
        ("api", "chat", recorded),
        ("api", "messages", []),
    ):
        visit(browser, f"{url}/ui/rollouts")
        Select(browser.find_element(By.NAME, field)).select_by_value(value)
        _click_to_next_page(browser, "#filters button")
        assert _listed(browser) == want, (field, value)
        assert [r["id"] for r in site.api(f"/v1/art/rollouts?{field}={value}&limit=1000")["data"]][::-1] == want
    visit(browser, f"{url}/ui/rollouts?group_id={site.group_ids[0]}")
    assert sorted(_listed(browser)) == sorted(grouped) and grouped


@pytest.mark.engine
@NEEDS_CHROMIUM
def test_rollout_page_shows_the_recorded_tokens(site: Site, browser: Any, tiny_model: Path, vllm_url: str) -> None:
    from selenium.webdriver.common.by import By
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    login(browser, site)
    rollout_id = site.episodes[0].rollout_id
    trajectory = site.api(f"/v1/art/rollouts/{rollout_id}")
    assert len(trajectory["calls"]) == 2  # get_ballots, then report
    # The conversation: the question, both tool calls, the tool's result.
    visit(browser, f"{site.gateway.url}/ui/rollouts/{rollout_id}", shot="rollout-conversation")
    conversation = browser.find_element(By.ID, "conversation")
    assert conversation.is_displayed()
    names = [e.text for e in conversation.find_elements(By.CSS_SELECTOR, ".tool-call b")]
    assert names == ["get_ballots", "report"]
    assert len(conversation.find_elements(By.CSS_SELECTOR, ".msg.tool")) == 1
    # Each call's row names the engine that served it (#45), as the API records it.
    engines = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#calls td.engine")]
    assert engines == [c["engine"] for c in trajectory["calls"]] == [vllm_url] * 2
    # The token view, by its tab (switched by the page's script, without a reload).
    browser.find_element(By.CSS_SELECTOR, "a[data-tab=tokens]").click()
    assert browser.find_element(By.ID, "tokens").is_displayed() and not conversation.is_displayed()
    assert browser.current_url.endswith("?view=tokens")
    shown = browser.find_elements(By.CSS_SELECTOR, "#tokens .sequence")
    assert len(shown) == len(trajectory["sequences"])
    for element, sequence in zip(shown, trajectory["sequences"], strict=True):
        tokens = browser.execute_script(
            "return [...arguments[0].querySelectorAll('.tok')].map(t => [+t.dataset.id, t.className, t.title,"
            " t.textContent])",
            element,
        )
        assert [t[0] for t in tokens] == sequence["token_ids"]
        assert [int("trn" in t[1]) for t in tokens] == sequence["sampled_mask"]
        for (_, _, title, _), logprob in zip(tokens, sequence["logprobs"], strict=True):
            assert title.endswith(f" · logprob {logprob:.4f}") if logprob is not None else "logprob" not in title
        pieces = tokenizer.decode_batch([[t] for t in sequence["token_ids"]], skip_special_tokens=False)
        assert [t[3] for t in tokens] == pieces
        marks = element.find_elements(By.CSS_SELECTOR, ".call-mark")
        assert [m.get_attribute("data-call") for m in marks] == sequence["call_ids"]
        constrained = {c["id"] for c in trajectory["calls"] if c["constrained"]}  # both: forced tool calls
        assert constrained and all(
            ("constrained" in mark.get_attribute("class")) == (mark.get_attribute("data-call") in constrained)
            for mark in marks
        )
    visit(browser, f"{site.gateway.url}/ui/rollouts/{rollout_id}?view=tokens")  # the view by its query, no script
    assert browser.find_element(By.ID, "tokens").is_displayed()
    first_trained = browser.find_element(By.CSS_SELECTOR, "#tokens .sequence .tok.trn")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", first_trained)
    screenshot(browser, "rollout-tokens")


@pytest.mark.engine
@NEEDS_CHROMIUM
def test_models_and_group_pages(site: Site, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url = site.gateway.url
    login(browser, site)
    status = site.api(f"/v1/art/models/{MODEL}")
    visit(browser, f"{url}/ui/models")
    row = browser.find_element(By.CSS_SELECTOR, "#models tbody tr").text
    assert row.startswith(f"{MODEL} {status['served_step']} {status['latest_step']}")
    visit(browser, f"{url}/ui/models/{MODEL}", shot="model")
    charts = browser.find_elements(By.CSS_SELECTOR, "svg.chart")
    assert len(charts) == 2
    steps = [s for s in status["steps"] if s["metrics"]]
    assert len(charts[0].find_elements(By.CSS_SELECTOR, "circle")) == len(steps) >= 1
    first = browser.find_element(By.CSS_SELECTOR, "#steps tbody tr").text.split()
    assert first[0] == str(status["steps"][0]["step"]) and first[3] == f"{status['steps'][0]['metrics']['loss']:.4f}"
    # The model's groups, newest first (the API lists them oldest first); the list of all groups, the same here.
    newest_first = [g["id"] for g in site.api(f"/v1/art/groups?model={MODEL}")["data"]][::-1]
    assert sorted(newest_first) == sorted(site.group_ids)
    assert _groups_listed(browser.page_source) == newest_first
    browser.find_element(By.ID, "all-groups").click()
    WebDriverWait(browser, 30).until(lambda d: "<h1>Groups</h1>" in d.page_source)  # the list, not the model page
    assert _groups_listed(browser.page_source) == newest_first
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    # A group: its attempts side by side, rewards and advantages as GRPO computes them, the step that trained it.
    group = site.api(f"/v1/art/groups/{site.group_ids[0]}")
    visit(browser, f"{url}/ui/groups/{site.group_ids[0]}", shot="group")
    cards = browser.find_elements(By.CSS_SELECTOR, "#attempts .attempt")
    assert [c.get_attribute("data-rollout") for c in cards] == [r["rollout_id"] for r in group["rollouts"]]
    rewards = [r["reward"] for r in group["rollouts"]]
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    for card, reward in zip(cards, rewards, strict=True):
        expected = 0.0 if std == 0 else (reward - mean) / (std + 1e-6)
        assert card.find_element(By.CSS_SELECTOR, ".advantage").text == f"{expected:+.3f}"
        assert card.find_element(By.CSS_SELECTOR, ".reward").text == f"{reward:.3f}"
    if group["trained_step"] is not None:
        assert f"step {group['trained_step']}" in browser.find_element(By.CSS_SELECTOR, "p.facts").text
    # Unknown pages of the UI are pages too (and no console error beyond the 404 itself).
    browser.get(f"{url}/ui/groups/no-such-group")
    assert "No group" in browser.find_element(By.ID, "error-message").text
    browser.get_log("browser")


# ---------------------------------------------------------------- on the stand-in engine (fast: no vLLM, no browser)


@dataclass
class StubSite:
    gateway: GatewayProcess
    reader: str  # a client key of my-agent with `read`
    infer_only: str  # a client key of my-agent without it
    judges: dict[str, StandInJudge]  # the operator's judges (--judges-file) by name: stand-ins a test answers for
    engine: str  # the stand-in engine's URL

    def get(self, path: str, key: str | None = None, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(f"{self.gateway.url}{path}", headers=headers, timeout=30, **kwargs)


def _as(gateway: GatewayProcess, key: str | None) -> dict[str, str]:
    """The headers of a call with `key` (None: the admin key)."""
    return {"Authorization": f"Bearer {key}"} if key else gateway.admin


def _chat(gateway: GatewayProcess, rollout_id: str, model: str, content: str, key: str | None = None) -> None:
    """One call of the rollout, with `key` (None: the admin key): rollout ids are its key's (#40)."""
    answer = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers={**_as(gateway, key), "X-ART-Rollout-Id": rollout_id},
        json={"model": model, "messages": [{"role": "user", "content": content}]},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text


@pytest.fixture(scope="module")
def stub_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StubSite]:
    judges = {name: StandInJudge(lambda blocks, _: {"scores": {}}) for name in ("openai/one", "openai/two")}
    where = tmp_path_factory.mktemp("ui-stub")
    url, stub = start_stub()
    try:
        gateway = start_gateway(
            where,
            "--upstream",
            url,
            "--auth",
            "required",
            "--judges-file",
            str(write_judges(where / "judges.json", judges)),
            models=(MODEL, "other"),
        )
    except BaseException:
        stop_group(stub)
        for judge in judges.values():
            judge.close()
        raise
    try:
        # The reader's own rollouts (a key reads only the rollouts it made, #40), and the admin's of `other`.
        reader = _make_key(gateway, "ui-reader", ["infer", "reward", "read"])["key"]
        for rollout_id, model, key in [("mine-0", MODEL, reader), ("mine-1", MODEL, reader), ("theirs", "other", None)]:
            _chat(gateway, rollout_id, model, f"hi {rollout_id}", key)
        yield StubSite(gateway, reader, _make_key(gateway, "ui-infer", ["infer"])["key"], judges, url)
    finally:
        gateway.stop()
        stop_group(stub)
        for judge in judges.values():
            judge.close()


def test_pages_need_a_key_with_read(stub_site: StubSite) -> None:
    no_key = stub_site.get("/ui/rollouts?model=my-agent")
    assert no_key.status_code == 303
    assert no_key.headers["location"] == f"/ui/login?next={quote('/ui/rollouts?model=my-agent', safe='')}"
    wrong = stub_site.get("/ui/rollouts", "not-a-key")
    assert wrong.status_code == 401 and wrong.headers["content-type"].startswith("text/html")
    assert "Incorrect API key" in wrong.text
    lacking = stub_site.get("/ui/rollouts", stub_site.infer_only)
    assert lacking.status_code == 403 and "`read` scope" in lacking.text
    assert stub_site.get("/ui/rollouts", stub_site.reader).status_code == 200
    assert stub_site.get("/ui/static/ui.css").status_code == 200  # the stylesheet and script hold no data


def test_login_keeps_a_session_in_a_strict_http_only_cookie(stub_site: StubSite) -> None:
    with httpx.Client(base_url=stub_site.gateway.url, timeout=30) as browser:
        refused = browser.post("/ui/login", data={"key": stub_site.infer_only, "next": "/ui/models"})
        assert refused.status_code == 403 and "`read` scope" in refused.text
        assert "artgw_ui_session" not in browser.cookies
        answer = browser.post("/ui/login", data={"key": stub_site.reader, "next": "/ui/models"})
        assert answer.status_code == 303 and answer.headers["location"] == "/ui/models"
        cookie = answer.headers["set-cookie"]
        assert {"HttpOnly", "Path=/ui", "SameSite=strict"} <= {part.strip() for part in cookie.split(";")}
        assert "Max-Age" not in cookie and "expires" not in cookie.lower()  # for the browser session only
        assert browser.get("/ui/models").status_code == 200
        assert browser.post("/ui/logout").status_code == 303
        assert browser.get("/ui/models").status_code == 303  # logged out: back to the login page
        # After logging in, only a page of the UI: never another site.
        answer = browser.post("/ui/login", data={"key": stub_site.reader, "next": "//evil.example/ui"})
        assert answer.headers["location"] == "/ui/rollouts"


def test_the_session_cookie_is_no_key_and_ends_with_its_key(stub_site: StubSite) -> None:
    """The cookie names the key by id, signed (a stolen cookie is not a key); a tampered one is no session, and a
    session ends when its key is revoked."""
    gateway = stub_site.gateway
    key = _make_key(gateway, "ui-revoked-later", ["read"])
    with httpx.Client(base_url=gateway.url, timeout=30) as browser:
        answer = browser.post("/ui/login", data={"key": key["key"], "next": "/ui/models"})
        assert answer.status_code == 303, answer.text
        token = browser.cookies["artgw_ui_session"]
        assert key["key"] not in token and token.startswith(f"{key['id']}.")
        assert browser.get("/ui/models").status_code == 200
        forged = token.rsplit(".", 1)[0] + "." + "0" * 64
        assert httpx.get(f"{gateway.url}/ui/models", cookies={"artgw_ui_session": forged}).status_code == 303
        other = _make_key(gateway, "ui-other", ["read"])  # another key's id, with this token's signature
        swapped = token.replace(key["id"], other["id"], 1)
        assert httpx.get(f"{gateway.url}/ui/models", cookies={"artgw_ui_session": swapped}).status_code == 303
        revoked = httpx.delete(f"{gateway.url}/v1/art/keys/{key['id']}", headers=gateway.admin, timeout=30)
        assert revoked.status_code == 200, revoked.text
        after = browser.get("/ui/models")
        assert after.status_code == 303 and after.headers["location"].startswith("/ui/login")


def test_another_site_cannot_log_a_browser_in(stub_site: StubSite) -> None:
    """Login CSRF: a page elsewhere auto-submitting the login form with the attacker's key is refused by its Origin
    (or the browser's Sec-Fetch-Site), and sets no session; the UI's own form and scripts without an Origin work."""
    url = stub_site.gateway.url
    form = {"key": stub_site.reader, "next": "/ui/models"}
    for headers in ({"Origin": "https://evil.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}):
        with httpx.Client(base_url=url, timeout=30) as browser:
            answer = browser.post("/ui/login", data=form, headers=headers)
            assert answer.status_code == 403 and "artgw_ui_session" not in browser.cookies, (headers, answer.text)
            assert browser.post("/ui/logout", headers=headers).status_code == 403
    with httpx.Client(base_url=url, timeout=30) as browser:
        same = browser.post("/ui/login", data=form, headers={"Origin": url, "Sec-Fetch-Site": "same-origin"})
        assert same.status_code == 303 and "artgw_ui_session" in browser.cookies


def test_no_page_can_be_framed_or_run_a_script_of_elsewhere(stub_site: StubSite) -> None:
    """Every answer of the UI (a page, the login form, a refusal, its static files) forbids framing and holds the
    browser to the UI's own files."""
    for path, key in [("/ui/rollouts", stub_site.reader), ("/ui/login", None), ("/ui/rollouts", "not-a-key")]:
        answer = stub_site.get(path, key)
        assert answer.headers["x-frame-options"] == "DENY", path
        policy = {d.split()[0]: d.split()[1:] for d in answer.headers["content-security-policy"].split("; ")}
        assert policy["frame-ancestors"] == ["'none'"] and policy["script-src"] == ["'self'"], policy
        assert answer.headers["x-content-type-options"] == "nosniff"


def test_a_key_sees_only_its_models(stub_site: StubSite) -> None:
    listed = stub_site.get("/ui/rollouts", stub_site.reader).text
    assert 'data-rollout="mine-0"' in listed and 'data-rollout="mine-1"' in listed and "theirs" not in listed
    assert 'data-rollout="theirs"' in stub_site.get("/ui/rollouts", stub_site.gateway.admin_key).text
    assert stub_site.get("/ui/rollouts/mine-0", stub_site.reader).status_code == 200
    assert stub_site.get("/ui/rollouts/theirs", stub_site.reader).status_code == 404
    models = stub_site.get("/ui/models", stub_site.reader).text
    assert "/ui/models/my-agent" in models and "/ui/models/other" not in models
    assert stub_site.get("/ui/models/other", stub_site.reader).status_code == 404


def test_the_call_view_names_each_calls_engine(stub_site: StubSite) -> None:
    page = stub_site.get("/ui/rollouts/mine-0", stub_site.reader).text
    calls = stub_site.get("/v1/art/rollouts/mine-0", stub_site.reader).json()["calls"]
    shown = re.findall(r'<td class="engine"><code>([^<]*)</code></td>', page)
    assert shown == [c["engine"] for c in calls] == [stub_site.engine]


def test_bad_parameters_are_pages_naming_them(stub_site: StubSite) -> None:
    since = stub_site.get("/ui/rollouts?since=yesterday", stub_site.reader)
    assert since.status_code == 400 and "`since`" in since.text
    view = stub_site.get("/ui/rollouts/mine-0?view=raw", stub_site.reader)
    assert view.status_code == 400 and "`view`" in view.text
    limit = stub_site.get("/ui/rollouts?limit=0", stub_site.reader)
    assert limit.status_code == 400 and limit.headers["content-type"].startswith("text/html")


def _groups_listed(html: str) -> list[str]:
    return re.findall(r'<tr class="group-row" data-group="([^"]+)"', html)


def _next_page(html: str) -> str | None:
    found = re.search(r'href="([^"]+)" id="next-page"', html)
    return found.group(1).replace("&amp;", "&") if found else None


def test_group_list_newest_first_by_model_and_state_in_pages(stub_site: StubSite) -> None:
    gateway = stub_site.gateway
    made = []  # (group id, model), oldest first
    for k, model in enumerate([MODEL, MODEL, "other", MODEL, MODEL, MODEL]):
        rollout_ids = [f"grouped-{k}-{attempt}" for attempt in range(2)]
        key = stub_site.reader if model == MODEL else None  # a group is its key's, of its key's rollouts
        for rollout_id in rollout_ids:
            _chat(gateway, rollout_id, model, f"task {k}", key)
        body = {
            "model": model,
            "group_id": f"ui-list-{k}",
            "rollouts": [{"rollout_id": r, "reward": float(a)} for a, r in enumerate(rollout_ids)],
        }
        answer = httpx.post(f"{gateway.url}/v1/art/groups", json=body, headers=_as(gateway, key), timeout=30)
        assert answer.status_code == 201, answer.text
        made.append((body["group_id"], model))
    mine = [gid for gid, model in reversed(made) if model == MODEL]
    everyone = [gid for gid, _ in reversed(made)]

    def listed(path: str, key: str) -> list[str]:
        answer = stub_site.get(path, key)
        assert answer.status_code == 200, answer.text
        return _groups_listed(answer.text)

    # A key sees its models' groups only, newest first; the admin key every model's.
    assert listed("/ui/groups", stub_site.reader) == mine
    assert listed("/ui/groups", gateway.admin_key) == everyone
    assert listed("/ui/groups?model=other", gateway.admin_key) == ["ui-list-2"]
    assert listed("/ui/groups?model=other", stub_site.reader) == []
    # Every group here has its rewards and no trainer runs: all ready, none trained.
    assert listed("/ui/groups?state=ready", stub_site.reader) == mine
    assert listed("/ui/groups?state=trained", stub_site.reader) == []
    # Pages of 2 by the "older" link, to the end: each group once, in order, the filter kept.
    seen, path = [], f"/ui/groups?model={MODEL}&limit=2"
    while path is not None:
        answer = stub_site.get(path, stub_site.reader)
        assert len(_groups_listed(answer.text)) <= 2
        seen += _groups_listed(answer.text)
        path = _next_page(answer.text)
        assert path is None or f"model={MODEL}" in path
    assert seen == mine
    # The model's page: its newest groups, and how many there are in all.
    page = stub_site.get(f"/ui/models/{MODEL}", stub_site.reader).text
    assert _groups_listed(page) == mine and f"of {len(mine)}" in page
    bad = stub_site.get("/ui/groups?state=done", stub_site.reader)
    assert bad.status_code == 400 and "must be one of scoring, ready, training" in bad.text


def test_a_panel_group_page_shows_criteria_spread_and_checks(stub_site: StubSite) -> None:
    """A group scored by a panel (the operator's two stand-in judges over HTTP, tests/stand_in_judge.py: no paid
    judge runs here) on two criteria with a hard check: its page shows each attempt's criterion scores, the
    judges' spread and the check's outcome."""
    gateway = stub_site.gateway

    def by_length(blocks: list[tuple[str, str]], _: dict[str, Any]) -> dict[str, Any]:
        return {"scores": {tid: {"explanation": "measured", "criteria": {"depth": min(1, len(text) / 300),
                "focus": 0.5}} for tid, text in blocks}}  # fmt: skip

    for judge in stub_site.judges.values():
        judge.answer = by_length
    rollout_ids = ["panel-0", "panel-1"]
    for k, rollout_id in enumerate(rollout_ids):
        _chat(gateway, rollout_id, MODEL, "tell me more" * (k * 10 + 1), stub_site.reader)
    body = {
        "model": MODEL,
        "group_id": "ui-panel",
        "rollouts": [{"rollout_id": r} for r in rollout_ids],
        "ruler": {
            "judges": [
                {"judge_model": "openai/one"},
                {"judge_model": "openai/two"},
            ],
            "samples": 2,
            "criteria": [{"name": "depth", "description": "How deep?"}, {"name": "focus", "description": "On task?"}],
            "checks": [{"grader": {"type": "regex", "pattern": "^$"}}],  # the stub's answers are never empty: fail
        },
    }
    answer = httpx.post(f"{gateway.url}/v1/art/groups", json=body, headers=_as(gateway, stub_site.reader), timeout=30)
    assert answer.status_code == 201, answer.text
    poll(lambda: "state-ready" in stub_site.get("/ui/groups/ui-panel", stub_site.reader).text, 60, "the panel")
    page = stub_site.get("/ui/groups/ui-panel", stub_site.reader).text
    assert "RULER judges <code>openai/one</code>, <code>openai/two</code>" in page and "× 2 samples" in page
    assert page.count('<dt class="criterion">depth</dt>') == 2 and page.count('<dt class="criterion">focus</dt>') == 2
    assert page.count('<dd class="spread">') == 2 and "judges' spread" in page
    assert page.count('<dd class="check fail"') == 2 and "failed: reward 0" in page


def test_advantages_are_grpo_s() -> None:
    # (r - mean) / (population std + eps): rewards 1, 0, 0, 0 have mean 0.25 and std sqrt(3)/4; eps 1e-6.
    std = 3**0.5 / 4 + 1e-6
    assert advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std])
    assert advantages([0.5, 0.5]) == [0.0, 0.0]  # no signal: exactly 0
    assert advantages([1.0, None]) == [None, None]  # not every reward in yet


def test_token_view_cuts_at_call_boundaries() -> None:
    first = make_call("c1", 0.0, None, [1, 2, 3], ({"role": "assistant", "content": "a"}, [7, 8]), rollout_id="r")
    second = make_call("c2", 1.0, None, [1, 2, 3, 7, 8, 9], ({"role": "assistant", "content": "b"}, [10]))
    (sequence,) = token_view(assemble("r", [first, second]), lambda ids: [f"<{i}>" for i in ids])
    assert [[t.id for t in part.tokens] for part in sequence.parts] == [[1, 2, 3, 7, 8], [9, 10]]
    assert [part.call.id for part in sequence.parts if part.call] == ["c1", "c2"]
    assert [t.trained for part in sequence.parts for t in part.tokens] == [False] * 3 + [True] * 2 + [False, True]
    assert sequence.parts[1].tokens[1].text == "<10>" and sequence.parts[1].tokens[1].logprob == -0.5


def test_token_view_marks_where_a_split_sequence_leaves_the_one_before() -> None:
    """The first token of a split sequence that differs from the sequence before it (#25): the place to look."""
    first = make_call("c1", 0.0, None, [1, 2, 3], ({"role": "assistant", "content": "a"}, [7, 8]), rollout_id="r")
    rerendered = make_call("c2", 1.0, None, [1, 2, 3, 7, 5, 9], ({"role": "assistant", "content": "b"}, [10]))
    one, two = token_view(assemble("r", [first, rerendered]), lambda ids: [f"<{i}>" for i in ids])
    assert not any(t.diverges for part in one.parts for t in part.tokens)
    marked = [(i, t.id) for i, t in enumerate(t for part in two.parts for t in part.tokens) if t.diverges]
    assert marked == [(4, 5)]  # 1 2 3 7 are the sequence before's; 5 is where it went 8
