"""The deployment for real: `docker compose up` of docker-compose.yml + docker-compose.cpu.yml, our image built from
deploy/Dockerfile, in containers of a Docker daemon that scripts/compose-up starts on this machine (no registry,
no bridge: deploy/local/compose.yml rewires the addresses to 127.0.0.1 on the host's network, and nothing else),
with the two-engines profile: vllm and vllm-1 behind the gateway.

What a user's first `docker compose up` would find wrong: a file missing from the image, the checkpoints at a path
vLLM or the gateway does not see, a healthcheck that never passes, a scrape that never authenticates, a volume
that loses the store. The tests run in order against one deployment: an OpenAI client through the gateway
container; a step trained by the trainer container, published to both engines and served, each rollout on one
engine and both engines serving; Prometheus's scrapes and every dashboard
expression; `compose down` and `up` again (with one engine); the gateway's process killed.

scripts/compose-up starts the daemon and makes every image it does not find (about 5 minutes from nothing:
README "Deployment"); its failure, the container engine's above all, fails the test with what it said. At the end
the test runs `scripts/compose-down --keep-images`: containers, volumes and the daemon go, the images stay in the
machine's state dir, so the next run (from any checkout) builds only the layers its sources change, as anyone's
`docker compose up` would (`ARTGW_COMPOSE_PURGE=1`: remove them too). `ARTGW_COMPOSE_KEEP=1` leaves the deployment
up after the tests, to look at; the tests expect a fresh one: `scripts/compose-down --keep-images` before the next
run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest

from client import ArtClient
from store.api import GroupCreate, ModelStatus, RolloutIn
from store.trajectories import Trajectory
from tests.conftest import poll
from tests.dashboard import METRIC_NAME, dashboard_expressions

# Marked `engine` (these containers run a vLLM and a trainer of their own: `-m "not engine"` skips them), in a group of
# their own, last (tests/conftest.py): whichever worker is free first runs them.
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "my-agent"  # docker-compose.yml's MODEL_NAME default
GROUPS_PER_STEP = 4  # the trainer's ARTGW_GROUPS_PER_STEP default in docker-compose.yml
ROLLOUT_HEADER = "X-ART-Rollout-Id"
RATE_WINDOW = "2m"  # for Grafana's $__rate_interval: wide enough for two of Prometheus's 15 s scrapes


@dataclass
class Deployment:
    """The running deployment: scripts/compose-up's state dir, its variables, and docker at its daemon."""

    state: Path
    variables: dict[str, str]
    client_key: str = ""
    answered: dict[str, int] = field(default_factory=dict)  # rollout id -> the step that answered it
    overrides: dict[str, str] = field(default_factory=dict)  # compose's variables over its env file's, as a shell's

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.variables['ARTGW_GATEWAY_LISTEN_PORT']}"

    @property
    def prometheus(self) -> str:
        return f"http://127.0.0.1:{self.variables['ARTGW_PROMETHEUS_LISTEN_PORT']}"

    @property
    def engines(self) -> list[str]:
        """The engines as the gateway's --upstream names them: vLLM and vllm-1 (the two-engines profile); vLLM alone
        once the down/up test brought the deployment back with one engine."""
        urls = self.overrides.get("VLLM_URLS") or self.variables["VLLM_URLS"]
        return urls.split(",")

    def engine_models(self) -> list[set[str]]:
        """The models each engine lists (its base and the LoRA steps loaded)."""
        return [{m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]} for url in self.engines]

    @property
    def admin_key(self) -> str:
        return self.variables["ARTGW_ADMIN_KEY"]

    def docker(self, *args: str, timeout: float = 120) -> str:
        env = {
            **os.environ,
            "DOCKER_HOST": f"unix://{self.state / 'docker.sock'}",
            "DOCKER_CONFIG": str(self.state / "docker-config"),
            "COMPOSE_PROJECT_NAME": "art-gateway",
            **self.overrides,
        }
        done = subprocess.run(
            ["docker", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        assert done.returncode == 0, f"docker {' '.join(args)}: exit {done.returncode}\n{done.stderr[-4000:]}"
        return done.stdout

    def compose(self, *args: str, timeout: float = 120) -> str:
        files = ("docker-compose.yml", "docker-compose.cpu.yml", "deploy/local/compose.yml")
        return self.docker(
            "compose",
            *(arg for name in files for arg in ("-f", name)),
            "--env-file",
            str(self.state / "compose.env"),
            *args,
            timeout=timeout,
        )

    def container(self, service: str) -> str:
        (container,) = self.compose("ps", "-q", service).split()
        return container

    def inspect(self, container: str, template: str) -> str:
        return self.docker("inspect", "-f", template, container).strip()

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", "--tail", "60", service)

    def art(self, key: str | None = None) -> ArtClient:
        return ArtClient(self.gateway, key or self.admin_key, timeout=60)

    def openai(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway}/v1", api_key=key or self.client_key, max_retries=0, timeout=120)

    def status(self) -> ModelStatus:
        with self.art() as admin:
            return admin.model_status(MODEL)

    def chat(self, rollout_id: str, history: list[dict[str, str]] | None = None) -> Any:
        answer = self.openai().chat.completions.create(
            model=MODEL,
            messages=history or [{"role": "user", "content": f"Say hello ({rollout_id})."}],
            max_tokens=8,
            extra_headers={ROLLOUT_HEADER: rollout_id},
        )
        assert answer.choices and answer.usage is not None and answer.usage.completion_tokens > 0, answer
        return answer

    def two_turns(self, rollout_id: str) -> None:
        """A two-call rollout, the second call sending back the first one's reply, as an agent's loop does."""
        history = [{"role": "user", "content": f"Say hello ({rollout_id})."}]
        reply = self.chat(rollout_id, history).choices[0].message.content or ""
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again."}]
        self.chat(rollout_id, history)

    def rollout(self, rollout_id: str, timeout: float = 60) -> Trajectory:
        """The rollout as the store has it (a 404 `rollout_pending` while the recorder is still writing it)."""

        def read() -> Trajectory | None:
            answer = httpx.get(
                f"{self.gateway}/v1/art/rollouts/{rollout_id}",
                headers={"Authorization": f"Bearer {self.client_key}"},
                timeout=30,
            )
            if answer.status_code == 404 and answer.json()["error"]["code"] == "rollout_pending":
                return None
            assert answer.status_code == 200, (rollout_id, answer.status_code, answer.text)
            return msgspec.json.decode(answer.content, type=Trajectory)

        return poll(read, timeout, f"rollout {rollout_id} in the store", every=0.5)


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    started = time.monotonic()
    # in a session of its own: at the timeout, the script and everything it runs (compose, docker build) end
    up = subprocess.Popen(
        ["bash", str(ROOT / "scripts" / "compose-up")],
        cwd=ROOT,
        env={**os.environ, "ARTGW_COMPOSE_ENGINES": "2"},  # vllm-1 beside vllm (the two-engines profile)
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        try:
            out, err = up.communicate(timeout=1500)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            out, err = up.communicate()
            err += "\n(killed after 1500 s)"
        state = Path(out.strip().splitlines()[-1]) if out.strip() else None
        assert up.returncode == 0 and state is not None, (
            f"scripts/compose-up failed (exit {up.returncode}): the deployment could not be made\n{err[-6000:]}"
        )
        variables = dict(line.split("=", 1) for line in (state / "compose.env").read_text().splitlines() if "=" in line)
        timings = (state / "timings").read_text() if (state / "timings").exists() else ""
        print(f"\nscripts/compose-up: {time.monotonic() - started:.0f}s\n{timings}")
        yield Deployment(state, variables)
    finally:
        if os.environ.get("ARTGW_COMPOSE_KEEP") != "1":
            keep = [] if os.environ.get("ARTGW_COMPOSE_PURGE") == "1" else ["--keep-images"]
            subprocess.run(["bash", str(ROOT / "scripts" / "compose-down"), *keep], cwd=ROOT, timeout=300, check=False)


def test_an_openai_client_with_a_client_key_gets_answers_through_the_gateway_container(
    deployment: Deployment,
) -> None:
    # as the README has a user make one: `artgw keys create` in the gateway's container, with the admin key of
    # its environment (--port: the host network's port here; 8000, the default, on a compose network)
    made = deployment.compose(
        *(
            "exec",
            "-T",
            "gateway",
            "artgw",
            "keys",
            "create",
            "--port",
            deployment.variables["ARTGW_GATEWAY_LISTEN_PORT"],
        ),
        *("--name", "compose-test", "--model", MODEL, "--scope", "infer", "--scope", "reward", "--scope", "read"),
    )
    deployment.client_key = made.strip()
    assert deployment.client_key.startswith("sk-art-"), made

    answer = deployment.chat("compose-hello")
    assert answer.model == MODEL
    trajectory = deployment.rollout("compose-hello")
    assert [(call.status, call.step) for call in trajectory.calls] == [("ok", 0)]
    assert trajectory.trainable_tokens == answer.usage.completion_tokens
    # --auth required (the gateway listens for everyone in a real deployment): no key, no answer
    with pytest.raises(openai.AuthenticationError):
        deployment.openai(key="not-a-key").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )


def test_the_trainer_container_trains_a_step_that_the_gateway_container_serves(deployment: Deployment) -> None:
    assert deployment.client_key, "needs the client key of the test before"
    assert deployment.status().served_step == 0
    with deployment.art(deployment.client_key) as client:
        for group in range(GROUPS_PER_STEP):
            ids = [f"compose-g{group}-{attempt}" for attempt in range(2)]
            for rollout_id in ids:
                deployment.two_turns(rollout_id)
            client.post_group(
                GroupCreate(
                    model=MODEL,
                    rollouts=[RolloutIn(rollout_id, reward=float(i)) for i, rollout_id in enumerate(ids)],
                    group_id=f"compose-g{group}",
                )
            )

    def trained_and_served() -> ModelStatus | None:
        # the trainer may take the groups in more than one step (it starts once enough have waited long enough)
        status = deployment.status()
        done = status.groups == {"trained": GROUPS_PER_STEP} and status.served_step == status.latest_step >= 1
        return status if done else None

    try:
        status = poll(trained_and_served, 900, "every group trained and the last step served", every=2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- trainer ---\n{deployment.logs('trainer')}") from None
    step = status.served_step
    assert step in status.loaded_steps, status
    # one rollout, one sequence: vLLM in its container continues the tokens it sampled (--enable-scale-out), on
    # the engine of its first call; new rollouts went to the least loaded, so both engines served some
    engines_of: dict[str, str | None] = {}
    for group in range(GROUPS_PER_STEP):
        for attempt in range(2):
            trajectory = deployment.rollout(f"compose-g{group}-{attempt}")
            assert [len(trajectory.calls), len(trajectory.sequences)] == [2, 1], trajectory.sequences[-1].split_reason
            (engines_of[trajectory.rollout_id],) = {call.engine for call in trajectory.calls}
    assert set(engines_of.values()) == set(deployment.engines), engines_of
    # the step published to both engines before the gateway served it
    assert all(f"{MODEL}@{step}" in models for models in deployment.engine_models()), deployment.engine_models()

    # the checkpoint the trainer wrote, at the path the gateway handed vLLM, in all three containers
    checkpoint = f"/checkpoints/{MODEL}/{step}/adapter_config.json"
    for service in ("trainer", "gateway", "vllm", "vllm-1"):
        deployment.compose("exec", "-T", service, "test", "-s", checkpoint)

    answer = deployment.chat("compose-after-step")
    assert [call.step for call in deployment.rollout("compose-after-step").calls] == [step]
    assert answer.model == MODEL
    deployment.answered["compose-after-step"] = step


def test_prometheus_scrapes_both_services_and_answers_every_dashboard_expression(deployment: Deployment) -> None:
    prometheus = deployment.prometheus

    def query(expr: str) -> list[dict[str, Any]]:
        answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=30).json()
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def targets_up() -> list[tuple[str, str]] | None:
        active = httpx.get(f"{prometheus}/api/v1/targets", timeout=30).json()["data"]["activeTargets"]
        health = sorted((t["scrapePool"], t["health"]) for t in active)
        return health if health == [("artgw-gateway", "up"), ("vllm", "up"), ("vllm", "up")] else None

    # the gateway's target is up only with the metrics key compose hands Prometheus as a secret file; both engines
    poll(targets_up, 120, "the gateway's and both engines' scrape targets up", every=2)
    # two scrapes since the step (the trainer's metrics are the step's): what a rate or an increase needs
    served = deployment.status().served_step
    assert served >= 1
    poll(
        lambda: (
            query(f'artgw_adapter_step{{model="{MODEL}"}} == {served}')
            and query(f'count_over_time(artgw_trainer_loss{{model="{MODEL}"}}[{RATE_WINDOW}]) >= 2')
        ),
        120,
        f"two scrapes of the gateway serving step {served}",
        every=2,
    )

    names = set(httpx.get(f"{prometheus}/api/v1/label/__name__/values", timeout=30).json()["data"])
    assert any(n.startswith("artgw_") for n in names) and any(n.startswith("vllm:") for n in names), names
    with_data, without_metrics, events = [], [], []
    for expr in dashboard_expressions():
        if expr.startswith("label_values("):  # Grafana's own function: the model variable's choices
            models = httpx.get(f"{prometheus}/api/v1/label/model/values", timeout=30).json()["data"]
            assert MODEL in models, models
            continue
        promql = expr.replace("$__rate_interval", RATE_WINDOW).replace("$model", ".*")
        result = query(promql)
        if promql.rstrip().endswith("> 0"):  # an annotation: data only while its event (a step, a rollback) is recent
            events.append(expr)
        elif not set(METRIC_NAME.findall(promql)) <= names:  # e.g. RULER's, never called here
            without_metrics.append(expr)
        else:
            assert result, f"no data for the dashboard's {expr!r}"
            with_data.append(expr)
    print(f"\n{len(with_data)} expressions with data; {len(events)} annotations; no such metric yet: {without_metrics}")
    # the panels of what this deployment did: calls, tokens, latency, the recorder, groups, the step, vLLM
    for needed in ("artgw_requests_total", "artgw_records_written_total", "artgw_trainer_loss", "vllm:prompt_tokens"):
        assert any(needed in expr for expr in with_data), needed


def test_compose_down_and_up_keep_the_store_and_the_checkpoints(deployment: Deployment) -> None:
    """Down, then up again with one engine (the profile off, the gateway on `vllm` alone), as a user scaling down
    does: the store and the checkpoints are the deployment's volumes, whatever its engines. (Up again with both
    would start two engines for what one shows; a restarted engine of several getting the served step is
    test_supervised_engines.py's.)"""
    assert deployment.answered, "needs the step of the tests before"
    step = deployment.status().served_step
    deployment.compose("down", "--timeout", "30", timeout=300)
    assert not deployment.compose("ps", "-aq").split()
    deployment.overrides.update(COMPOSE_PROFILES="", VLLM_URLS=deployment.engines[0])
    deployment.compose("up", "-d", "--wait", "--wait-timeout", "600", "--no-build", "--pull", "never", timeout=900)
    services = deployment.compose("ps", "--format", "{{.Service}}").split()
    assert "vllm" in services and "vllm-1" not in services, services

    # the store (pgdata): the client key, the rollouts, the model's steps; the checkpoints: the step serves again
    status = deployment.status()
    assert status.served_step == step and step in status.loaded_steps, status
    # the engine started anew: the gateway loaded the served step onto it before it took a call
    assert [f"{MODEL}@{step}" in models for models in deployment.engine_models()] == [True], deployment.engine_models()
    assert [call.step for call in deployment.rollout("compose-after-step").calls] == [step]
    deployment.chat("compose-after-restart")
    assert [call.step for call in deployment.rollout("compose-after-restart").calls] == [step]


def test_a_killed_gateway_is_restarted_and_no_acknowledged_call_is_lost(deployment: Deployment) -> None:
    """The gateway's process killed with SIGKILL, as a crash or the OOM killer does: its restart policy
    (`unless-stopped`) brings it back. (`docker kill` would not do: Docker counts it as a manual stop, after
    which no policy restarts the container.) Every call answered before the kill and after it is in the store:
    the gateway journals a call (gateway-data volume) before it answers, and replays the journal at start."""
    gateway = deployment.container("gateway")
    restarts = int(deployment.inspect(gateway, "{{.RestartCount}}"))
    answered: list[str] = []
    failed: list[str] = []
    stop = threading.Event()

    def calls() -> None:
        client = deployment.openai()
        n = 0
        while not stop.is_set():
            rollout_id = f"compose-kill-{n}"
            n += 1
            try:
                client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"Count to {n}."}],
                    max_tokens=8,
                    extra_headers={ROLLOUT_HEADER: rollout_id},
                )
                answered.append(rollout_id)
            except openai.APIError:
                failed.append(rollout_id)
                time.sleep(0.5)

    caller = threading.Thread(target=calls, daemon=True)
    caller.start()
    try:
        poll(lambda: len(answered) >= 3, 120, "calls answered before the kill")
        pid = int(deployment.inspect(gateway, "{{.State.Pid}}"))
        assert pid > 0, "the gateway's container is not running"  # kill(0) would end this test's process group
        os.kill(pid, signal.SIGKILL)
        killed_at = len(answered)

        def back() -> bool:
            state = deployment.inspect(gateway, "{{.RestartCount}} {{.State.Health.Status}}").split()
            return int(state[0]) > restarts and state[1] == "healthy"

        poll(back, 300, "the gateway container restarted and healthy", every=1)
        poll(lambda: len(answered) >= killed_at + 3, 120, "calls answered after the restart")
    finally:
        stop.set()
        caller.join(timeout=150)
    print(f"\n{len(answered)} calls answered, {len(failed)} refused while the gateway was down")
    lost = [rollout_id for rollout_id in answered if not deployment.rollout(rollout_id, timeout=120).calls]
    assert not lost, lost
