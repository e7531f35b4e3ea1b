"""Several models in one trainer: each a `Lineage` of its own (LoRA, optimizer, step counter, claims), and the
turns the loop takes between them.

The loop polls every waiting model for claimable groups and trains the first whose batch is ready (a full batch,
or a small one once it has waited --max-wait-seconds), then puts that model at the back of the line, so a busy
model cannot starve the others. Groups are claimed per model: a step never mixes models. With one model this is
the plain loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from store.adapters import AdapterRow
from trainer import distributed
from trainer.checkpoints import discard_uncommitted, restore, resume_point
from trainer.config import TrainConfig
from trainer.console import console
from trainer.model import Policy
from trainer.stopping import Stop
from trainer.store_view import TrainerStore

POLL_SECONDS = 0.5  # between two rounds of claims while no model has a batch


@dataclass
class Lineage:
    """One trainable model's own line of adapters: nothing in it is shared with another model."""

    name: str  # the trainable model: groups are claimed for it, its adapters serve as NAME@K
    policy: Policy  # its LoRA, on a base copy of its own
    optimizer: torch.optim.Optimizer
    step: int  # its newest committed step; the next one is step + 1
    committed: AdapterRow | None  # that step's row: where a failed step goes back to (None: the base model)
    claimed: list[str] = field(default_factory=list)  # groups claimed for its next step, not yet trained
    deadline: float | None = None  # monotonic time after which min_groups_per_step is enough; None: not waiting
    done: int = 0  # steps committed by this run (for --max-steps)

    def ready(self, config: TrainConfig, now: float) -> bool:
        """A full batch, or a small one once it has waited max_wait_seconds."""
        assert self.deadline is not None, "only a waiting lineage can be ready"
        if len(self.claimed) >= config.groups_per_step:
            return True
        return len(self.claimed) >= config.min_groups_per_step and now >= self.deadline

    def finished(self, config: TrainConfig) -> bool:
        return config.max_steps is not None and self.done >= config.max_steps


class Turns:
    """The line of lineages: who is polled first, who trains next."""

    def __init__(self, lineages: list[Lineage]) -> None:
        self.line = list(lineages)

    def waiting(self, config: TrainConfig) -> list[Lineage]:
        """The lineages still to train, in line order (--max-steps reached: out of the line)."""
        return [lineage for lineage in self.line if not lineage.finished(config)]

    def trained(self, lineage: Lineage) -> None:
        """`lineage` takes its step now: to the back of the line."""
        self.line.remove(lineage)
        self.line.append(lineage)

    def others(self, lineage: Lineage) -> list[Lineage]:
        return [other for other in self.line if other is not lineage]

    def wait_for_batch(self, store: TrainerStore, config: TrainConfig, owner: str, stop: Stop) -> Lineage | None:
        """Poll each waiting model in turn, claiming its groups, until one has a batch. None once stopped."""
        waiting = self.waiting(config)
        for lineage in waiting:
            if lineage.deadline is None:  # its wait starts now, as each of its steps ends
                lineage.deadline = time.monotonic() + config.max_wait_seconds
        names = ", ".join(lineage.name for lineage in waiting)
        with console.status(f"[bold]waiting for ready groups of {names}[/bold]") as status:
            while not stop.is_set():
                for lineage in waiting:
                    limit = config.groups_per_step - len(lineage.claimed)
                    lineage.claimed += store.claim(lineage.name, owner, config.lease_seconds, limit)
                    if lineage.ready(config, time.monotonic()):
                        return lineage
                counts = ", ".join(f"{lin.name} {len(lin.claimed)}/{config.groups_per_step}" for lin in waiting)
                status.update(f"[bold]groups claimed: {counts}[/bold]")
                held = [group_id for lineage in waiting for group_id in lineage.claimed]
                if held:  # keep what we hold alive while waiting for more
                    store.renew(held, owner, config.lease_seconds)
                stop.wait(POLL_SECONDS)
        return None


def give_back(store: TrainerStore, lineages: list[Lineage], owner: str) -> None:
    """Return the groups claimed by these lineages to `ready`: nothing holds a claim it is not renewing."""
    for lineage in lineages:
        if lineage.claimed:
            store.release(lineage.claimed, owner)
            lineage.claimed = []


def open_lineage(
    config: TrainConfig, device: torch.device, name: str, step: int, committed: AdapterRow | None
) -> Lineage:
    """A model's lineage at `step` (its newest committed), with the weights of `committed` (its newest that
    loads; None: the base)."""
    policy, optimizer = restore(config, device, committed)
    return Lineage(name, policy, optimizer, step, committed)


def resume_lineages(config: TrainConfig, store: TrainerStore, device: torch.device) -> list[Lineage]:
    """Each model's lineage as its committed steps left it: from its newest committed checkpoint that loads (newer
    uncommitted ones deleted). Committed steps newer than that one no longer load (trainer/checkpoints.py): their
    update is lost, so their groups go back to `ready` and are trained again into the next step, which builds on
    the checkpoint that loads. (Left `trained`, the lineage would go on without them, silently.) Rank 0's side: the
    other ranks open theirs from what it shares (trainer/ranks.py).

    Memory: each lineage loads a base copy of its own, simple and fine for a few small models; PEFT's several
    adapters on one base (set_adapter per step) would share it."""
    resume_points = distributed.share({name: resume_point(name, store.committed_steps(name)) for name in config.models})
    lineages: list[Lineage] = []
    for name, (step, committed) in resume_points.items():
        discarded = discard_uncommitted(config, name, step)
        if discarded:
            console.print(f"[yellow]{name}: discarded uncommitted checkpoints {discarded}[/yellow]")
        kept = committed.step if committed is not None else 0
        again = store.retrain_lost(name, kept) if kept < step else []
        if again:  # (none on a later start: they were given back by the first)
            lost = f"steps {kept + 1}-{step}" if kept + 1 < step else f"step {step}"
            console.print(
                f"[yellow]{name}: {lost} lost with {'their checkpoints' if kept + 1 < step else 'its checkpoint'}: "
                f"{len(again)} groups they trained are ready again, for step {step + 1}[/yellow]",
                soft_wrap=True,
            )
        lineages.append(open_lineage(config, device, name, step, committed))
        trainable = sum(p.numel() for p in lineages[-1].policy.model.parameters() if p.requires_grad)
        weights = f"step {committed.step}" if committed is not None else "the base"
        console.print(f"  model={name} resume_step={step} weights={weights} trainable_params={trainable:,}")
    return lineages
