"""`artgw train`: the GRPO sidecar. Claims ready groups, trains a LoRA step on their recorded tokens,
writes a checkpoint, has the gateway serve it, and only then are the groups trained.

Reads top to bottom: config → store and resume → models → the loop. A step always runs in the same order:
claim (trainer/lineage.py) → load trajectories and advantages (trainer/data.py) → forward/backward, clip,
optimizer step (trainer/step.py) → checkpoint (trainer/checkpoints.py) → commit through the gateway (client/)
→ log. Several processes: rank 0 runs this loop and tells the others what to do (trainer/ranks.py).

Exactly once, per model: a step counts only when the gateway has loaded its adapter and, in the same
store transaction, marked its groups trained (see store/adapters.py). A trainer that dies before that
leaves its groups' leases to expire; on restart each model resumes from its own newest *committed*
checkpoint and deletes any newer, uncommitted one, so no group is trained twice or lost.

Synchronous: torch does the work; the store is reached through trainer/store_view.py, whose event loop runs in
a thread of its own.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

import torch
from opentelemetry.trace import Tracer
from rich.table import Table

from client import ArtClient
from store.api import AdapterLoad
from store.tracing import traced
from store.types import StepMetrics
from trainer import distributed, startwatch
from trainer.checkpoints import restore, save_checkpoint
from trainer.config import TrainConfig
from trainer.console import console
from trainer.data import load_step_data
from trainer.grammar import GrammarMasks
from trainer.lineage import Lineage, Turns, give_back, resume_lineages
from trainer.model import pad_token_id, pick_device
from trainer.ranks import Order, follow, process_line, tell
from trainer.step import train_step
from trainer.stopping import Stop, stop_on_signals
from trainer.store_view import TrainerStore
from trainer.tracing import step_span
from trainer.tracking import Tracker, tracking

FAILED_STEP_PAUSE_SECONDS = 2.0  # after a step the gateway refused, before claiming again


def main(config: TrainConfig) -> int:
    """`run` until done or SIGINT/SIGTERM, which let the step in hand finish (or fail) cleanly: what `artgw train`
    runs, in each of its processes. Returns the number of committed steps."""
    return run(config, stop_on_signals())  # ranks > 0 too, but rank 0 tells them when to stop


def run(config: TrainConfig, stop: Stop | None = None) -> int:
    """Train until stopped (or every model has max_steps); returns the number of committed steps, all models."""
    if not distributed.is_lead():
        return follow(config)  # ranks > 0 never open the store: rank 0 tells them what to train
    # StoreMissing if the gateway has not made it yet. --wandb-project: one W&B run, finished however the loop
    # ends; OTEL_EXPORTER_OTLP_ENDPOINT: a span per step.
    with (
        TrainerStore.open(config.db) as store,
        ArtClient(config.gateway, config.admin_key) as gateway,
        tracking(config) as tracker,
        traced("artgw-trainer", "artgw.trainer") as tracer,
    ):
        return train(config, store, gateway, stop or threading.Event(), tracker, tracer)


def train(
    config: TrainConfig,
    store: TrainerStore,
    gateway: ArtClient,
    stop: Stop,
    tracker: Tracker,
    tracer: Tracer | None = None,
) -> int:
    """The loop of the one process, or of rank 0 (which alone claims, checkpoints and commits); `tracker` hears
    of every committed step."""
    # ---- config
    torch.manual_seed(config.seed)  # several processes: every rank builds the same fresh LoRA
    device = pick_device(config)
    owner = lease_owner(store, config)
    console.print(f"[bold]artgw train[/bold] base={config.base_model} device={device} owner={owner}{process_line()}")
    startwatch.started()  # its first line: `artgw train`'s start-up stack dump is not needed

    # ---- resume and models, one lineage per model: each from its own newest committed step that loads, never
    # from an uncommitted checkpoint (trainer/lineage.py).
    lineages = resume_lineages(config, store, device)
    startwatch.disarm()  # started, its models loaded (the start's memory peak): no more watch for a stall
    pad_id = pad_token_id(config)
    # Built once: tokens sampled under a grammar are scored under the masks vLLM sampled them under.
    grammar = GrammarMasks.for_model(config.base_model) if config.train_constrained else None

    # ---- the loop: take turns, training whichever model has a batch ready
    turns = Turns(lineages)
    done = 0
    while not stop.is_set() and turns.waiting(config):
        lineage = turns.wait_for_batch(store, config, owner, stop)
        if lineage is None:
            break
        # The others' claims go back to `ready`: this step may outlast leases that nobody renews meanwhile.
        # The loop claims them again (oldest first) when it next polls those models.
        give_back(store, turns.others(lineage), owner)
        turns.trained(lineage)
        group_ids, lineage.claimed, lineage.deadline = lineage.claimed, [], None
        if train_one_step(store, gateway, config, lineage, group_ids, owner, device, pad_id, grammar, tracker, tracer):
            done += 1
            lineage.done += 1
    give_back(store, turns.line, owner)  # stopped while waiting: what was claimed is trained by the next run
    tell(Order("stop"))
    return done


def train_one_step(
    store: TrainerStore,
    gateway: ArtClient,
    config: TrainConfig,
    lineage: Lineage,
    group_ids: list[str],
    owner: str,
    device: torch.device,
    pad_id: int,
    grammar: GrammarMasks | None,
    tracker: Tracker,
    tracer: Tracer | None = None,
) -> bool:
    """One step of one model on its claimed groups; True once committed (served, its groups trained)."""
    started = time.time_ns()  # the step's span (with tracing on) runs from here to its commit
    step = lineage.step + 1

    # ---- data: the groups' trajectories, advantages, the trainable sequences
    data, dropped = load_step_data(store, store.groups(group_ids), config, step, grammar)
    for group_id, reason in dropped.items():
        store.drop(group_id, owner, reason)
        console.print(f"[yellow]{lineage.name}: dropped group {group_id}: {reason}[/yellow]")
    if not data.group_ids:
        return False
    if not data.sequences:  # every advantage was 0 (or no token trainable): no new adapter
        store.finish_without_update(data.group_ids, owner, lineage.step)
        console.print(f"[yellow]{lineage.name}: {len(data.group_ids)} groups without learning signal: no step[/yellow]")
        return False

    # ---- train and save (the other ranks train the same step with us)
    tell(Order("train", lineage.name, data))
    metrics = train_step(lineage.policy, lineage.optimizer, data, config, device, pad_id)
    path = save_checkpoint(lineage.policy.model, lineage.optimizer, config, lineage.name, step, metrics)
    if config.pause_before_commit:
        time.sleep(config.pause_before_commit)
    # Every rank is still here: one that died since the step's gradients were summed fails this barrier, and the
    # launcher restarts the group, which trains these groups again; the step is not committed.
    distributed.barrier()
    store.renew(data.group_ids, owner, config.lease_seconds)  # a long step must not lose its claim just before

    # ---- commit: the gateway serves it and marks its groups trained, or nothing of this step survives
    failure = commit(store, gateway, lineage.name, step, path, data.group_ids, owner, metrics)
    step_span(tracer, lineage.name, step, metrics, started, failure)
    if failure is not None:
        # The previous adapter keeps serving; the groups go back to `ready` and the model and optimizer
        # back to the last committed step.
        console.print(f"[red]{lineage.name} step {step} failed: {failure}[/red]")
        store.release(data.group_ids, owner)
        shutil.rmtree(path, ignore_errors=True)
        tell(Order("restore", lineage.name, committed=lineage.committed))  # every rank goes back
        lineage.policy, lineage.optimizer = restore(config, device, lineage.committed)
        time.sleep(FAILED_STEP_PAUSE_SECONDS)
        return False

    # ---- log
    lineage.step, lineage.committed = step, store.last_committed(lineage.name)
    console.print(_metrics_table(lineage.name, step, metrics))
    tracker.step(lineage.name, step, metrics, path)
    return True


def commit(
    store: TrainerStore,
    gateway: ArtClient,
    name: str,
    step: int,
    path: Path,
    group_ids: list[str],
    owner: str,
    metrics: StepMetrics,
) -> str | None:
    """Commit through the gateway; None on success, else why not. A lost answer is checked in the store."""
    load = AdapterLoad(step=step, path=str(path.resolve()), group_ids=group_ids, lease_owner=owner, metrics=metrics)
    try:
        gateway.load_adapter(name, load)
        return None
    except Exception as exc:
        committed = store.last_committed(name)
        if committed is not None and committed.step == step:
            return None  # the gateway committed; only its answer was lost
        return str(exc)


def lease_owner(store: TrainerStore, config: TrainConfig) -> str:
    """Who this trainer's claims belong to. A restarted process group first gives back what its dead attempt
    claimed (its lease would keep it for --lease-seconds), before the resume point is read, so a commit that
    attempt left in flight either shows in that point or finds its groups no longer its own."""
    if not distributed.active():
        return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    owner = distributed.owner()
    released = store.release_earlier_attempts(config.models, distributed.owner_prefix(), owner)
    if released:
        console.print(f"[yellow]gave back {len(released)} groups claimed by the previous attempt[/yellow]")
    return owner


def _metrics_table(name: str, step: int, metrics: StepMetrics) -> Table:
    table = Table(title=f"{name} step {step}", show_header=False, box=None)
    for key in (
        "loss",
        "reward_mean",
        "reward_std",
        "zero_signal_group_fraction",
        "kl",
        "grad_norm",
        "ratio_mean",
        "clip_fraction",
    ):
        table.add_row(key, f"{getattr(metrics, key):.4f}")
    for key in ("groups", "trainable_tokens", "staleness"):
        table.add_row(key, str(getattr(metrics, key)))
    if metrics.constrained_tokens:
        ratio = metrics.constrained_ratio_mean
        table.add_row("constrained tokens", f"{metrics.constrained_tokens} (ratio {ratio:.4f})")
    table.add_row("tokens/s", f"{metrics.trainable_tokens_per_second:.0f}")
    table.add_row("step seconds", f"{metrics.step_seconds:.2f}")
    return table
