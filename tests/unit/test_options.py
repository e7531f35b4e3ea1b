"""Options are declared once, on the settings dataclasses, and artgw/options.py makes them flags and variables.

Parsing goes through the real parser (`artgw.cli.build_parser`) and `options.resolve` with an explicit
environment, so nothing here depends on the ARTGW_* variables of the shell running the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
from pathlib import Path
from typing import Any, get_args, get_type_hints

import pytest

from artgw import cli, options
from artgw.demo import DemoConfig
from artgw.workers import worker_settings
from gateway.provide import with_engine_ports
from gateway.settings import Settings
from trainer.config import TrainConfig


def no_artgw_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shell's ARTGW_* variables out of this test's way: only what it sets counts."""
    for name in [k for k in os.environ if k.startswith("ARTGW_")]:
        monkeypatch.delenv(name)


def parse(*argv: str, env: dict[str, str] | None = None) -> argparse.Namespace:
    args = cli.build_parser().parse_args(argv)
    options.resolve(args, env or {})
    return args


def settings(*argv: str, env: dict[str, str] | None = None) -> Settings:
    return options.build(Settings, parse("serve", *argv, env=env))


def train(*argv: str, env: dict[str, str] | None = None) -> TrainConfig:
    return cli.train_config(parse("train", "--base-model", "base", *argv, env=env))


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the CLI, groups (`ruler`) and leaves (`ruler score`) alike."""
    found = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += commands(sub, (*path, name))
    return found


# -----------------------------------------------------------------------------
# declarations


@pytest.mark.parametrize("cls", [Settings, TrainConfig])
def test_every_field_is_an_option_with_help_and_variable(cls: type) -> None:
    declared = {o.name: o for o in options.options_of(cls)}
    not_options = {f.name for f in dataclasses.fields(cls) if f.metadata.get("option", True) is False}
    assert set(declared) | not_options == {f.name for f in dataclasses.fields(cls)}
    code_set = {"extra_env", "extra", "db", "engine_ports"}
    assert not_options <= code_set, "only code-set fields may stay off the command line"
    for name, option in declared.items():
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        assert option.flag == field.metadata.get("flag", "--" + name.replace("_", "-"))
        assert option.env == "ARTGW_" + option.flag.removeprefix("--").replace("-", "_").upper()
        assert len(option.help) > 5
        assert option.env in option.help_text()


def test_undeclared_help_or_unsupported_type_is_a_programming_error() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoHelp:
        x: int = 1

    @dataclasses.dataclass(frozen=True)
    class Mapping:
        x: dict[str, str] = dataclasses.field(default_factory=dict, metadata={"help": "a mapping"})

    with pytest.raises(TypeError, match="no help"):
        options.options_of(NoHelp)
    with pytest.raises(TypeError, match="cannot be an option"):
        options.options_of(Mapping)


def test_trainer_choices_match_the_loss() -> None:
    from trainer.loss import AdvantageScale, Normalization

    hints = get_type_hints(TrainConfig)
    assert get_args(hints["scale_rewards"]) == get_args(AdvantageScale)
    assert get_args(hints["normalization"]) == get_args(Normalization)


def test_help_of_every_command_works_and_names_its_variables(capsys: pytest.CaptureFixture[str]) -> None:
    paths = commands(cli.build_parser())
    assert {("serve",), ("train",), ("status",), ("export",), ("migrate",), ("demo",), ("ruler", "score")} <= set(paths)
    for path in paths:
        with pytest.raises(SystemExit) as exit_:
            cli.main([*path, "--help"])
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert "ARTGW_DEBUG" in text, path
        args_parser = cli.build_parser()
        for name in path:
            args_parser = next(a for a in args_parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
                name
            ]
        for option in args_parser.get_default("_artgw_options") or []:
            assert option.env in text, (path, option.env)
            assert option.flag in text, (path, option.flag)


def test_serve_settings_come_in_sections_each_option_once(capsys: pytest.CaptureFixture[str]) -> None:
    """Settings is made of sections (server, engine, recording, auth, promotion, models): each field is declared
    on exactly one of them, and `serve --help` shows each section's options under its title."""
    sections = [base for base in Settings.__mro__[1:] if dataclasses.is_dataclass(base)]
    assert {s.__name__ for s in sections} >= {"ServerSettings", "EngineSettings", "RecordingSettings"}
    declared = [name for section in sections for name in inspect.get_annotations(section)]
    assert sorted(declared) == sorted(f.name for f in dataclasses.fields(Settings))  # each once, none outside
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = capsys.readouterr().out
    for section in sections:
        title = section.__name__.removesuffix("Settings").lower() + " options:"
        block = text.split(title, 1)[1].split(" options:", 1)[0]  # up to the next section's title
        for name in inspect.get_annotations(section):
            flag = Settings.__dataclass_fields__[name].metadata.get("flag") or "--" + name.replace("_", "-")
            if Settings.__dataclass_fields__[name].metadata.get("option", True):
                assert flag in block, (section.__name__, flag)


def test_shared_options_are_the_same_declaration() -> None:
    # --data-dir/--db and --host/--port: one field each, on Settings, for every command that has them.
    needs = {"serve": ("--upstream", "http://x"), "train": ("--base-model", "b")}
    for command in ("serve", "migrate", "export", "train"):
        args = parse(command, *needs.get(command, ()), "--data-dir", "/s")
        owners = {o.name: o.owner for o in args._artgw_options}
        assert owners["data_dir"] is owners["db"] is Settings
        assert args.data_dir == Path("/s")
    for argv in (("status",), ("train", "--base-model", "b")):
        owners = {o.name: o.owner for o in parse(*argv)._artgw_options}
        assert owners["host"] is owners["port"] is Settings
        assert owners["gateway"] is TrainConfig


# -----------------------------------------------------------------------------
# the environment


def test_environment_is_read_for_every_type() -> None:
    s = settings(
        env={
            "ARTGW_UPSTREAM": "http://vllm:8000",
            "ARTGW_PORT": "9001",  # int
            "ARTGW_REQUEST_TIMEOUT": "5.5",  # float
            "ARTGW_MIGRATE": "off",  # bool
            "ARTGW_DATA_DIR": "/srv/artgw",  # Path
            "ARTGW_LOG_LEVEL": "debug",  # Literal
            "ARTGW_ENGINE_ARGS": "--enforce-eager --chat-template '/a b.jinja'",  # tuple: one shell-quoted string
            "ARTGW_ADMIN_KEY": "k" * 16,  # str | None
            "ARTGW_MODEL_NAME": "a, b",  # a repeated option: a comma list
        }
    )
    assert (s.upstream, s.port, s.request_timeout, s.migrate) == (("http://vllm:8000",), 9001, 5.5, False)
    assert (s.data_dir, s.log_level, s.admin_key) == (Path("/srv/artgw"), "debug", "k" * 16)
    assert s.model_names == ("a", "b")
    assert s.engine_args == ("--enforce-eager", "--chat-template", "/a b.jinja")


def test_trainer_booleans_choices_and_optionals_read_the_environment() -> None:
    config = train(
        env={
            "ARTGW_GRADIENT_CHECKPOINTING": "on",
            "ARTGW_MASK_TRUNCATED": "yes",
            "ARTGW_TRAIN_CONSTRAINED": "TRUE",
            "ARTGW_NORMALIZATION": "dapo",
            "ARTGW_TIS_CAP": "none",
            "ARTGW_MAX_STEPS": "3",
            "ARTGW_LEARNING_RATE": "3e-5",
            "ARTGW_CHECKPOINTS": "/ckpt",
        }
    )
    assert config.gradient_checkpointing == "on" and config.mask_truncated and config.train_constrained
    assert (config.normalization, config.tis_cap, config.max_steps) == ("dapo", None, 3)
    assert math.isclose(config.learning_rate, 3e-5)
    assert config.checkpoints == Path("/ckpt")


def test_several_engines_repeated_or_as_a_comma_list() -> None:
    """--upstream names several engines, repeated or as a comma list (ARTGW_UPSTREAM too); the supervised engine
    is the one engine without it."""
    urls = ("http://a:8000", "http://b:8001")
    assert settings("--upstream", "http://a:8000", "--upstream", "http://b:8001/").engine_urls == urls
    assert settings("--upstream", "http://a:8000, http://b:8001").engine_urls == urls
    assert settings(env={"ARTGW_UPSTREAM": "http://a:8000,http://b:8001"}).engine_urls == urls
    assert settings("--base-model", "b", "--engine-port", "9000").engine_urls == ("http://127.0.0.1:9000",)


def test_engines_are_supervised_on_ports_of_their_own_and_workers_call_them_as_upstreams() -> None:
    """--engines N: N supervised engines, on --engine-port and the ports after it, or on free ones chosen at start;
    --workers' other processes are given them as --upstream URLs."""
    given = settings("--base-model", "b", "--engines", "2", "--engine-port", "9000")
    assert given.engine_urls == ("http://127.0.0.1:9000", "http://127.0.0.1:9001")
    assert settings("--base-model", "b", "--engine-port", "9000", env={"ARTGW_ENGINES": "3"}).engine_urls[2:] == (
        "http://127.0.0.1:9002",
    )
    free = with_engine_ports(settings("--base-model", "b", "--engines", "2"))
    assert len(set(free.engine_urls)) == 2 and free.engine_port == free.engine_ports[0] != 0
    assert with_engine_ports(free) == free  # chosen once
    worker = worker_settings(free, 8001)
    assert (worker.base_model, worker.upstream_urls, worker.engines, worker.port) == (None, free.engine_urls, 1, 8001)


def test_more_engines_than_gpus_is_one_line_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    no_artgw_environment(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert cli.main(["serve", "--base-model", "b", "--engines", "2"]) == 2
    assert capsys.readouterr().err == (
        "artgw serve: --engines 2 needs a GPU per engine; 1 visible (0): give --engines 1 or fewer\n"
    )


def test_defaults_are_the_dataclass_defaults() -> None:
    s = settings("--upstream", "http://x")
    assert dataclasses.replace(s, upstream=(), base_model="b") == Settings(base_model="b")
    config = train()
    assert config == TrainConfig(
        base_model="base",
        db=config.db,
        gateway="http://127.0.0.1:8000",
        checkpoints=Path("data") / "checkpoints",
    )


def test_a_repeated_flag_collects_its_values_and_beats_the_variable() -> None:
    s = settings("--upstream", "http://x", "--model-name", "a", "--model-name", "b", env={"ARTGW_MODEL_NAME": "c"})
    assert s.model_names == ("a", "b")
    assert settings("--upstream", "http://x").model_names == ("my-agent",)
    with pytest.raises(options.OptionError, match="ARTGW_MODEL_NAME: expected a comma-separated list"):
        settings("--upstream", "http://x", env={"ARTGW_MODEL_NAME": "a,,b"})


def test_auth_is_required_off_loopback_unless_said() -> None:
    assert not settings("--upstream", "http://x").auth_required
    assert settings("--upstream", "http://x", "--host", "0.0.0.0").auth_required
    assert settings("--upstream", "http://x", "--auth", "required").auth_required


def test_empty_variable_counts_as_unset() -> None:
    s = settings("--upstream", "http://x", env={"ARTGW_PORT": "", "ARTGW_ADMIN_KEY": ""})
    assert (s.port, s.admin_key) == (8000, None)


def test_no_migrate_variable_still_works() -> None:
    assert settings("--upstream", "http://x", env={"ARTGW_NO_MIGRATE": "1"}).migrate is False
    assert settings("--upstream", "http://x", env={"ARTGW_NO_MIGRATE": "0"}).migrate is True
    assert settings("--upstream", "http://x", env={"ARTGW_NO_MIGRATE": "1", "ARTGW_MIGRATE": "1"}).migrate is True
    assert settings("--upstream", "http://x", "--migrate", env={"ARTGW_NO_MIGRATE": "1"}).migrate is True


def test_command_line_beats_environment() -> None:
    env = {"ARTGW_PORT": "9001", "ARTGW_MIGRATE": "1", "ARTGW_LOG_LEVEL": "debug", "ARTGW_UPSTREAM": "http://env"}
    s = settings("--port", "7000", "--no-migrate", "--log-level", "error", "--upstream", "http://cli", env=env)
    assert (s.port, s.migrate, s.log_level, s.upstream) == (7000, False, "error", ("http://cli",))
    config = train("--mask-truncated", "--no-train-constrained", env={"ARTGW_TRAIN_CONSTRAINED": "on"})
    assert config.mask_truncated and not config.train_constrained


def test_old_flag_alias_still_parses() -> None:
    assert train("--max-wait", "600").max_wait_seconds == 600.0


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("ARTGW_LEARNING_RATE", "abc", "expected a number"),
        ("ARTGW_LEARNING_RATE", "nan", "finite"),
        ("ARTGW_GROUPS_PER_STEP", "2.5", "expected an integer"),
        ("ARTGW_MASK_TRUNCATED", "maybe", "1/true/yes/on"),
        ("ARTGW_NORMALIZATION", "ppo", "grpo, dr_grpo, dapo"),
        ("ARTGW_TARGET_MODULES", "q_proj 'k_proj", "shell-quoted"),
    ],
)
def test_bad_variable_is_one_error_naming_it(variable: str, value: str, says: str) -> None:
    with pytest.raises(options.OptionError) as error:
        train(env={variable: value})
    assert str(error.value).startswith(f"{variable}: ") and says in str(error.value)
    assert "\n" not in str(error.value)


def test_bad_flag_value_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--base-model", "b", "--lora-rank", "eight"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("artgw train: argument --lora-rank: expected an integer")


def test_required_option_names_flag_and_variable() -> None:
    # `train` has none any more (the gateway tells the base model): `ruler score --judge` is one.
    with pytest.raises(options.OptionError, match=r"--judge is required \(or set ARTGW_JUDGE\)"):
        parse("ruler", "score", "t.jsonl")
    assert parse("ruler", "score", "t.jsonl", env={"ARTGW_JUDGE": "j"}).judge == "j"
    assert parse("train", env={"ARTGW_BASE_MODEL": "b"}).base_model == "b"


# -----------------------------------------------------------------------------
# values: rejected with a message, never clamped


def test_min_groups_above_groups_per_step_is_rejected_not_clamped() -> None:
    with pytest.raises(ValueError, match="--min-groups-per-step must be between 1 and --groups-per-step"):
        TrainConfig(base_model="b", db="x", groups_per_step=2, min_groups_per_step=3)
    with pytest.raises(cli.CommandError) as error:
        train("--groups-per-step", "2", "--min-groups-per-step", "3")
    assert error.value.code == 2


def test_main_prints_one_line_and_exits_2_for_a_bad_value(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    no_artgw_environment(monkeypatch)
    monkeypatch.setenv("ARTGW_MIN_GROUPS_PER_STEP", "9")
    assert cli.main(["train", "--base-model", "b"]) == 2
    err = capsys.readouterr().err
    assert err == "artgw train: --min-groups-per-step must be between 1 and --groups-per-step (4), got 9\n"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--port", "70000"), "--port must be a port number"),
        (("--request-timeout", "0"), "--request-timeout must be a number of seconds > 0"),
        (("--max-body-bytes", "0"), "--max-body-bytes must be >= 1"),
        (("--model-name", "a/b"), "invalid --model-name"),
        (("--model-name", ".."), "invalid --model-name '..': 1 to 128 letters, digits and `._:-`"),
        (("--model-name", "."), "invalid --model-name"),
        (("--model-name", "a\\b"), "invalid --model-name"),
        (("--model-name", "tab\tname"), "invalid --model-name"),
        (("--model-name", "a", "--model-name", "a"), "--model-name given twice"),
        (("--engine-max-restarts", "-1"), "--engine-max-restarts must be >= 0"),
        (("--engine-restart-window", "0"), "--engine-restart-window must be a number of seconds > 0"),
        (("--host", "0.0.0.0", "--auth", "off"), "--auth off is for a gateway on loopback only"),
        (("--admin-key", "short"), "--admin-key must be at least 16 characters"),
        (("--upstream", "vllm:8000"), "--upstream must be an http"),
        (("--upstream", "http://a:8000", "--upstream", "b:8001"), "--upstream must be an http.*'b:8001'"),
        (("--upstream", "http://a:8000,,http://b"), "--upstream must be an http.*''"),
        (("--upstream", "http://a:8000,http://a:8000/"), "--upstream names an engine twice"),
        (("--engine-saturation", "0"), "--engine-saturation must be >= 1"),
        (("--engine-health-interval", "0"), "--engine-health-interval must be a number of seconds > 0"),
        (("--engines", "0"), "--engines must be >= 1, got 0"),
        (("--engines", "2"), "--engines 2 starts supervised engines of --base-model; with --upstream, give each"),
        (("--engine-port", "65535", "--engines", "2"), "the engines' ports 65535-65536 go past 65535"),
    ],
)
def test_bad_gateway_values_are_rejected(argv: tuple[str, ...], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        settings(*argv, env={"ARTGW_UPSTREAM": "http://x"})


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--lora-rank", "0"), "--lora-rank must be >= 1"),
        (("--learning-rate", "0"), "--learning-rate must be > 0"),
        (("--beta2", "1"), "--beta2 must be in"),
        (("--max-steps", "0"), "--max-steps must be >= 1"),
        (("--tis-cap", "0"), "tis_cap must be None"),
        (("--gateway", "gateway:8000"), "--gateway must be an http"),
    ],
)
def test_bad_trainer_values_are_rejected(argv: tuple[str, ...], says: str) -> None:
    with pytest.raises(cli.CommandError, match=says):
        train(*argv)


# -----------------------------------------------------------------------------
# what commands compute from the shared options


def test_train_finds_gateway_store_and_checkpoints_like_serve() -> None:
    config = train("--port", "9100", "--data-dir", "/d")
    assert config.gateway == "http://127.0.0.1:9100"
    assert config.db == f"sqlite+aiosqlite:///{Path('/d/artgw.sqlite').resolve()}"
    assert config.checkpoints == Path("/d/checkpoints")
    assert train(env={"ARTGW_HOST": "0.0.0.0", "ARTGW_PORT": "81"}).gateway == "http://127.0.0.1:81"
    assert train("--host", "::1").gateway == "http://[::1]:8000"
    assert train("--port", "9100", env={"ARTGW_GATEWAY": "http://gw:8000/"}).gateway == "http://gw:8000"
    assert train("--db", "postgresql+asyncpg://u@h/d").db == "postgresql+asyncpg://u@h/d"


def test_status_finds_the_gateway_like_train() -> None:
    assert cli.gateway_url(parse("status", env={"ARTGW_PORT": "8123"})) == "http://127.0.0.1:8123"
    assert cli.gateway_url(parse("status", "--gateway", "https://g.example")) == "https://g.example"
    with pytest.raises(cli.CommandError, match="--port must be the port the gateway listens on"):
        cli.gateway_url(parse("status", "--port", "0"))


def test_demo_passes_only_what_was_set() -> None:
    args = parse("demo", "--steps", "3", env={"ARTGW_TRAINER_ARGS": "--beta 0.05"})
    chosen: dict[str, Any] = options.given(args, DemoConfig)
    assert chosen == {"steps": 3, "trainer_args": ("--beta", "0.05")}
    assert DemoConfig.quick(**chosen).eval_scenarios == DemoConfig.quick().eval_scenarios
    assert parse("demo", env={"ARTGW_QUICK": "on"}).quick is True


def _step_row(step: int, status: str, metrics: Any, error: str | None = None) -> dict[str, Any]:
    return {
        "model": "my-agent",
        "step": step,
        "path": f"/ckpt/{step}",
        "status": status,
        "metrics": metrics,
        "error": error,
        "group_count": step,
        "created_at": 1.0,
        "served_at": None,
    }


@pytest.fixture
def fake_gateway() -> Any:
    """A stand-in for the gateway's `GET /v1/art/models[/NAME]` (a plain HTTP server on loopback): it answers
    `answers[path]` as JSON and notes each request's path and Authorization header in `seen`."""
    import http.server
    import threading

    answers: dict[str, Any] = {}
    seen: list[tuple[str, str | None]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            body = json.dumps(answers.get(self.path, {"error": {"message": "no such model"}})).encode()
            self.send_response(200 if self.path in answers else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], answers, seen
    server.shutdown()
    server.server_close()


def test_status_decodes_typed_step_metrics(
    fake_gateway: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    port, answers, seen = fake_gateway
    body = {
        "name": "my-agent",
        "base_model": "tiny",
        "base_model_path": "/models/tiny",
        "served_step": 2,
        "loaded_steps": [1, 2],
        "groups": {"trained": 3, "ready": 1},
        "steps": [
            _step_row(2, "loaded", {"loss": 0.25, "reward_mean": 0.5}),
            _step_row(1, "failed", None, "engine said no"),
        ],
    }
    answers["/v1/art/models/my-agent"] = body
    engines = "1 of 2 in rotation: http://a:8000 in rotation (2 in flight), http://b:8000 out of rotation (0 in flight)"
    answers["/readyz"] = {"status": "ready", "engine": "ready", "engines": engines}
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps the table to the terminal otherwise
    args = parse("status", "--port", str(port), "--model", "my-agent", env={"ARTGW_ADMIN_KEY": "a" * 20})
    assert cli._cmd_status(args) == 0
    out = capsys.readouterr().out
    assert seen == [("/v1/art/models/my-agent", "Bearer " + "a" * 20), ("/readyz", "Bearer " + "a" * 20)]
    assert f"engines: {engines}" in out  # several engines: which are in rotation
    assert "serves step 2" in out and "ready=1, trained=3" in out
    assert "0.2500" in out and "0.500" in out and "engine said no" in out

    # No --model: every model the gateway lists, each in turn.
    seen.clear()
    answers["/v1/art/models"] = {"data": ["my-agent", "b"], "object": "list"}
    answers["/v1/art/models/b"] = {**body, "name": "b"}
    assert cli._cmd_status(parse("status", "--port", str(port))) == 0
    assert [path.rsplit("/", 1)[1] for path, _ in seen] == ["models", "my-agent", "b", "readyz"]
    assert capsys.readouterr().out.count("serves step 2") == 2

    with pytest.raises(cli.CommandError, match=r"answered 404: no such model"):
        cli._cmd_status(parse("status", "--port", str(port), "--model", "nope"))
    body["steps"] = [_step_row(3, "loaded", {"loss": "high"})]  # not a StepMetrics
    with pytest.raises(cli.CommandError, match="did not answer like an ART gateway"):
        cli._cmd_status(parse("status", "--port", str(port), "--model", "my-agent"))
    body["steps"] = [_step_row(3, "sideways", None)]  # not an adapter status: the CLI reads the server's Literal
    with pytest.raises(cli.CommandError, match="did not answer like an ART gateway"):
        cli._cmd_status(parse("status", "--port", str(port), "--model", "my-agent"))


# -----------------------------------------------------------------------------
# one trainer, several models (issue #13)


def test_train_takes_several_models_repeated_or_as_a_comma_list() -> None:
    assert train().models == ("my-agent",)
    assert train("--model", "a", "--model", "b").models == ("a", "b")
    assert train(env={"ARTGW_MODEL": "a, b"}).models == ("a", "b")
    assert train("--model", "c", env={"ARTGW_MODEL": "a,b"}).models == ("c",)  # the command line wins
    with pytest.raises(options.OptionError, match="ARTGW_MODEL: expected a comma-separated list"):
        train(env={"ARTGW_MODEL": "a,,b"})


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--model", "a", "--model", "a"), "--model given twice: a, a"),
        (("--model", "x/../y"), "invalid --model 'x/../y'"),
        (("--model", "a@1"), "invalid --model 'a@1'"),
        (("--model", ".."), "invalid --model '..'"),
    ],
)
def test_bad_models_are_rejected(argv: tuple[str, ...], says: str) -> None:
    with pytest.raises(cli.CommandError, match=says) as error:
        train(*argv)
    assert error.value.code == 2


def test_status_shows_the_models_given_or_every_model() -> None:
    assert cli._build(cli.StatusOptions, parse("status")).models == ()  # none: every model the gateway has
    assert cli._build(cli.StatusOptions, parse("status", "--model", "b")).models == ("b",)
    assert cli._build(cli.StatusOptions, parse("status", env={"ARTGW_MODEL": "a,b"})).models == ("a", "b")
    assert {o.name: o.owner for o in parse("status")._artgw_options}["models"] is cli.StatusOptions


def test_train_without_base_model_asks_the_gateway_with_the_admin_key(fake_gateway: Any) -> None:
    port, answers, seen = fake_gateway
    body: dict[str, Any] = {
        "name": "a",
        "base_model": "tiny",
        "base_model_path": "/models/tiny",
        "served_step": 0,
        "loaded_steps": [],
        "groups": {},
        "steps": [],
    }
    answers["/v1/art/models/a"] = body
    key = "k" * 32
    args = parse("train", "--model", "a", "--model", "b", "--port", str(port), env={"ARTGW_ADMIN_KEY": key})
    config = cli.train_config(args)
    assert config.base_model == "/models/tiny" and config.models == ("a", "b")
    assert seen == [("/v1/art/models/a", f"Bearer {key}")]

    # Given, the gateway is not asked.
    assert cli.train_config(parse("train", "--base-model", "/w", env={"ARTGW_ADMIN_KEY": key})).base_model == "/w"
    assert len(seen) == 1

    body["base_model_path"] = None  # an --upstream engine not up yet: the gateway does not know
    with pytest.raises(cli.CommandError, match="does not say what its engine loaded"):
        cli.train_config(args)


def test_train_without_base_model_or_gateway_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    no_artgw_environment(monkeypatch)
    port = str(_closed_port())
    assert cli.main(["train", "--data-dir", str(tmp_path), "--port", port]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("artgw train: --base-model not given and the gateway cannot tell it: no gateway answers at")


def _closed_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
