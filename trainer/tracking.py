"""Experiment tracking: `artgw train --wandb-project P` reports every committed step to one W&B run.

One run per trainer process, opened when `train` starts and finished when it ends (SIGINT/SIGTERM end the loop
as they do without W&B, then the run finishes; an error finishes it with exit code 1). Only the process that
commits steps (rank 0 under torch.distributed) logs. Without --wandb-project nothing of wandb is imported.

- Metrics: each committed step's numbers (StepMetrics, store/types.py: loss, reward, KL, clip fraction,
  tokens/s, step time, ...) under the model's name, `NAME/loss`, with `NAME/step`, the model's own step, as
  their x-axis (`define_metric`): a trainer that takes turns between several models draws each one's curves
  over its own steps.
- Adapters: each committed step's checkpoint (the directory the gateway loaded) as an artifact of type "lora"
  named after the model, aliased `step-K` (W&B adds `latest` and `vN`): the adapter files vLLM loads and
  step.json (metrics, config), not the optimizer state (resume state, twice the adapter's size). The files are
  referenced where they lie (policy "immutable", no staged copy): a committed checkpoint is never rewritten.
- The run's config: the TrainConfig as every step.json keeps it, without secrets (TrainConfig.to_json).
- W&B's own variables work as usual: WANDB_MODE=offline writes the run under WANDB_DIR for a later
  `wandb sync`; WANDB_API_KEY, WANDB_ENTITY, WANDB_NAME, ...
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from store.types import StepMetrics
from trainer import distributed
from trainer.config import TrainConfig

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

log = logging.getLogger("artgw.trainer")

ADAPTER_ARTIFACT_TYPE = "lora"
NOT_ADAPTER = frozenset({"optimizer.pt"})  # in a checkpoint dir, but only for resuming


class TrackingError(RuntimeError):
    """W&B could not start the run (not logged in, an unknown entity, ...): said before any step trains."""


class Tracker:
    """Where the trainer reports each committed step beside its console and the gateway: a W&B run, or nowhere
    (no --wandb-project, or a rank > 0)."""

    def __init__(self, run: Run | None = None) -> None:
        self._run = run

    @property
    def active(self) -> bool:
        return self._run is not None

    def step(self, model: str, step: int, metrics: StepMetrics, checkpoint: Path) -> None:
        """`model`'s committed `step`: its metrics at its own step, and its checkpoint's adapter as an artifact."""
        if self._run is None:
            return
        import wandb

        values = step_values(metrics)
        self._run.log({f"{model}/step": step, **{f"{model}/{key}": value for key, value in values.items()}})
        try:
            artifact = wandb.Artifact(
                model, type=ADAPTER_ARTIFACT_TYPE, metadata={"model": model, "step": step, "metrics": values}
            )
            for path in sorted(checkpoint.iterdir()):
                if path.is_file() and path.name not in NOT_ADAPTER:
                    artifact.add_file(str(path), policy="immutable", skip_cache=True)
            self._run.log_artifact(artifact, aliases=[f"step-{step}"])
        except (wandb.errors.Error, OSError) as exc:  # the step is committed and serves: tracking must not undo it
            log.warning("%s step %d: adapter not logged to W&B: %s", model, step, exc)

    def finish(self, exit_code: int = 0) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish(exit_code=exit_code)


def step_values(metrics: StepMetrics) -> dict[str, float]:
    """A step's numbers: every field of its metrics but the ids of its groups."""
    return {key: value for key, value in msgspec.structs.asdict(metrics).items() if isinstance(value, int | float)}


def start_run(config: TrainConfig) -> Run:
    """The W&B run of this trainer process, one x-axis per model. TrackingError when W&B says no."""
    import wandb

    try:
        run = wandb.init(
            project=config.wandb_project,
            entity=config.wandb_entity,  # None: W&B's WANDB_ENTITY or the account's default
            name=config.wandb_run_name,  # None: WANDB_NAME or a made-up one
            job_type="train",
            config=config.to_json(),
        )
    except wandb.errors.Error as exc:
        raise TrackingError(f"W&B run in project {config.wandb_project!r} not started: {exc}") from None
    for model in config.models:
        run.define_metric(f"{model}/step")
        run.define_metric(f"{model}/*", step_metric=f"{model}/step")
    log.info("W&B run %s (%s) in project %s", run.id, run.name, run.project)
    return run


@contextlib.contextmanager
def tracking(config: TrainConfig) -> Iterator[Tracker]:
    """The tracker of one `train`: a W&B run with --wandb-project on the lead process, else one that does
    nothing. Finished on the way out, with exit code 1 if by an error."""
    on = config.wandb_project is not None and distributed.is_lead()
    tracker = Tracker(start_run(config) if on else None)
    try:
        yield tracker
    except BaseException:
        tracker.finish(exit_code=1)
        raise
    tracker.finish()
