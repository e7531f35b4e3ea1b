"""`artgw train --wandb-project` (trainer/tracking.py): the options, and that W&B stays out of a trainer without them.

What a real run logs is tests/integration/test_trainer_wandb.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from artgw import cli, options
from store.types import StepMetrics
from tests.conftest import ROOT
from trainer.config import TrainConfig
from trainer.tracking import step_values


def train(*argv: str, env: dict[str, str] | None = None) -> TrainConfig:
    args = cli.build_parser().parse_args(["train", "--base-model", "base", *argv])
    options.resolve(args, env or {})
    return cli.train_config(args)


def test_without_wandb_project_wandb_is_never_imported() -> None:
    # A fresh interpreter: what the trainer loads, its tracker opened, told of a step and finished as `train` does.
    code = textwrap.dedent(
        """
        import sys
        from pathlib import Path

        from artgw import cli, options
        from store.types import StepMetrics
        from trainer import train
        from trainer.tracking import tracking

        args = cli.build_parser().parse_args(["train", "--base-model", "base"])
        options.resolve(args)
        config = cli.train_config(args)
        assert config.wandb_project is None
        with tracking(config) as tracker:
            tracker.step("my-agent", 1, StepMetrics(loss=0.5), Path("no-such-checkpoint"))
        assert not tracker.active
        print(sorted(name for name in sys.modules if name.split(".")[0] == "wandb"))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ARTGW_", "WANDB_"))}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_wandb_options_from_flags_and_variables() -> None:
    assert (train().wandb_project, train().wandb_entity, train().wandb_run_name) == (None, None, None)
    config = train("--wandb-project", "grpo", "--wandb-entity", "lab", "--wandb-run-name", "first try")
    assert (config.wandb_project, config.wandb_entity, config.wandb_run_name) == ("grpo", "lab", "first try")
    env = {"ARTGW_WANDB_PROJECT": "grpo", "ARTGW_WANDB_RUN_NAME": "from-env"}
    assert (train(env=env).wandb_project, train(env=env).wandb_run_name) == ("grpo", "from-env")
    assert train("--wandb-project", "", env={"ARTGW_WANDB_PROJECT": "grpo"}).wandb_project is None  # '': off
    assert train("--wandb-project", "cli", env=env).wandb_project == "cli"  # the command line wins


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (("--wandb-project", "team/project"), {}, "--wandb-project must be a W&B project name"),
        (("--wandb-project", "runs:1"), {}, "--wandb-project must be a W&B project name"),
        ((), {"ARTGW_WANDB_PROJECT": "x" * 129}, "--wandb-project must be a W&B project name"),
        (("--wandb-entity", "lab"), {}, "--wandb-entity names a W&B run: give --wandb-project too"),
        ((), {"ARTGW_WANDB_RUN_NAME": "first"}, "--wandb-run-name names a W&B run: give --wandb-project too"),
        (("--wandb-project", "p", "--wandb-entity", "a/b"), {}, "--wandb-entity must be a W&B team or user"),
    ],
)
def test_a_bad_wandb_value_is_one_line_and_exit_2(
    argv: tuple[str, ...],
    env: dict[str, str],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in [k for k in os.environ if k.startswith("ARTGW_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["train", "--base-model", "b", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"artgw train: {says}") and err.count("\n") == 1, err


def test_a_step_logs_every_number_of_its_metrics() -> None:
    metrics = StepMetrics(loss=0.25, reward_mean=0.5, clip_fraction=0.1, groups=2, group_ids=["g1", "g2"])
    values = step_values(metrics)
    assert values["loss"] == 0.25 and values["reward_mean"] == 0.5 and values["groups"] == 2
    assert "group_ids" not in values
    numbers = {f for f in StepMetrics.__struct_fields__ if isinstance(getattr(metrics, f), int | float)}
    assert set(values) == numbers


def test_the_config_it_logs_keeps_no_secret() -> None:
    config = TrainConfig(
        base_model="b",
        db="postgresql+asyncpg://trainer:s3cret-pass@db:5432/artgw",
        admin_key="admin-key-0123456789abcdef",
        wandb_project="p",
    )
    saved = str(config.to_json())
    assert "s3cret-pass" not in saved and "admin-key-0123456789abcdef" not in saved
    assert config.to_json()["db"] == "postgresql+asyncpg://trainer:***@db:5432/artgw"
