"""Several training processes: rank 0 alone claims groups, saves checkpoints and commits; it tells the other ranks
what to do next with an `Order`, and they `follow`.

Every order is a collective (trainer/distributed.py `share`), made by every rank alike: rank 0 in the loop
(trainer/train.py), the others here. A step's data goes with its order, so ranks > 0 never open the store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from store.adapters import AdapterRow
from trainer import distributed
from trainer.batch import StepData
from trainer.checkpoints import restore
from trainer.config import TrainConfig
from trainer.console import console
from trainer.lineage import open_lineage
from trainer.model import pad_token_id, pick_device
from trainer.step import train_step


@dataclass(frozen=True)
class Order:
    """What rank 0 tells the other ranks to do next."""

    kind: Literal["train", "restore", "stop"]
    model: str = ""
    data: StepData | None = None  # "train": the step's batch, the same on every rank
    committed: AdapterRow | None = None  # "restore": the step to go back to (None: a fresh LoRA)


def tell(order: Order) -> None:
    """Rank 0: every other rank does `order` next (nothing to tell in one process)."""
    distributed.share(order)


def follow(config: TrainConfig) -> int:
    """Ranks > 0: the same models as rank 0, then each step it orders, until it says stop; returns the steps
    trained."""
    torch.manual_seed(config.seed)
    device = pick_device(config)
    console.print(f"[bold]artgw train[/bold] device={device}{process_line()}: following rank 0")
    resume_points: dict[str, tuple[int, AdapterRow | None]] = distributed.share(None)
    # In rank 0's order: restore() broadcasts each model's parameters, a collective every rank calls alike.
    lineages = {name: open_lineage(config, device, name, *point) for name, point in resume_points.items()}
    pad_id = pad_token_id(config)
    steps = 0
    while (order := distributed.share(None)).kind != "stop":
        lineage = lineages[order.model]
        if order.kind == "restore":
            lineage.policy, lineage.optimizer = restore(config, device, order.committed)
            continue
        assert order.data is not None, "a train order carries its step's data"
        train_step(lineage.policy, lineage.optimizer, order.data, config, device, pad_id)
        distributed.barrier()  # rank 0 has written the step's checkpoint
        steps += 1
    return steps


def process_line() -> str:
    """' rank R/W pid P' under torch.distributed (the crash tests find a rank's process by it), else ''."""
    if not distributed.active():
        return ""
    return f" rank {distributed.rank()}/{distributed.world_size()} pid {os.getpid()}"
