"""What tests/unit/test_train_step.py runs in each of several gloo processes (spawned: this module is imported
anew there): one training step under DistributedDataParallel, or rank 0 giving orders that the others follow."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from trainer.batch import StepData, TrainSequence


def step_data(vocab: int, trajectories: int = 6) -> StepData:
    """`trajectories` trajectories (groups of two), each of one to three sequences of 6-20 tokens."""
    rng = random.Random(7)
    sequences = []
    for trajectory in range(trajectories):
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(6, 20)
            sampled = [0] * 3 + [rng.random() < 0.8 for _ in range(n - 3)]
            sequences.append(
                TrainSequence(
                    token_ids=[rng.randrange(3, vocab) for _ in range(n)],
                    sampled_mask=[int(s) for s in sampled],
                    # Off-policy by up to +-1 nat around a typical tiny-model logprob: some ratios get clipped.
                    logprobs=[-7.0 + rng.uniform(-1, 1) if s else None for s in sampled],
                    trajectory=trajectory,
                )
            )
    rewards = [1.0, 0.0, 0.3, 0.9, 0.5, 0.2][:trajectories]
    return StepData(
        group_ids=[f"g{g}" for g in range((trajectories + 1) // 2)],
        sequences=sequences,
        advantages=torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0][:trajectories]),
        rewards=rewards,
        zero_signal_groups=0,
        zero_advantage_trajectories=0,
        staleness=0,
    )


def lora_of(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def one_step(model_dir: Path, data: StepData, options: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor], bool]:
    """One train_step on a fresh float64 LoRA, in this process (a process group's rank, or alone): (metrics, LoRA,
    whether DDP did the summing)."""
    from trainer import distributed
    from trainer.config import TrainConfig
    from trainer.model import Policy, load_policy, make_optimizer
    from trainer.step import train_step

    device = torch.device("cpu")
    config = TrainConfig(base_model=str(model_dir), db="sqlite+aiosqlite:///unused", **options)
    torch.manual_seed(0)  # the same fresh LoRA every time
    model = load_policy(config, device, None).double()
    distributed.broadcast_parameters(model)
    policy = Policy.of(model, config, device)
    metrics = train_step(policy, make_optimizer(model, config), data, config, device, pad_id=0)
    return metrics, lora_of(model), isinstance(policy.logprobs, torch.nn.parallel.DistributedDataParallel)


Job = tuple[str, StepData, dict[str, Any]]  # mode ("step" or "orders"), the batch, TrainConfig options


def worker(rank: int, world: int, rendezvous: str, model_dir: str, jobs: list[Job], out: str) -> None:
    """One rank doing `jobs` in order, each saved to `out % (job, rank)`: mode "step" (one_step under DDP) or
    "orders" (rank 0 trains, restores, trains again and stops; the others `follow`). One process group for all:
    a pair of processes costs ~12 s of CPU to start (torch, transformers and peft imported), a job well under 1."""
    from trainer import distributed

    # A file to meet at, not a TCP port: no other test can take it between choosing and binding.
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    clean = False
    try:
        for index, (mode, data, options) in enumerate(jobs):
            saved = out % (index, rank)
            if mode == "step":
                metrics, lora, ddp = one_step(Path(model_dir), data, options)
                torch.save({"loss": metrics.loss, "grad_norm": metrics.grad_norm, "lora": lora, "ddp": ddp}, saved)
            else:
                follow_orders(rank, model_dir, data, options, saved)
        clean = True
    finally:
        distributed.destroy(clean)  # as the trainer's own ranks leave (trainer/distributed.py _worker)


def follow_orders(rank: int, model_dir: str, data: StepData, options: dict, saved: str) -> None:
    """Rank 0 trains, restores, trains again and stops; the others `follow`."""
    from trainer import distributed
    from trainer.checkpoints import restore
    from trainer.config import TrainConfig
    from trainer.lineage import open_lineage
    from trainer.ranks import Order, follow, tell
    from trainer.step import train_step

    config = TrainConfig(base_model=model_dir, db="sqlite+aiosqlite:///unused", **options)
    device = torch.device("cpu")
    if rank > 0:  # a follower that missed an order would leave rank 0 waiting in a collective: a hang
        torch.save({"steps": follow(config)}, saved)
        return
    torch.manual_seed(config.seed)
    distributed.share({"m": (0, None)})
    lineage = open_lineage(config, device, "m", 0, None)
    for order in ("train", "restore", "train"):
        if order == "restore":
            tell(Order("restore", "m", committed=None))
            lineage.policy, lineage.optimizer = restore(config, device, None)
            continue
        tell(Order("train", "m", data))
        train_step(lineage.policy, lineage.optimizer, data, config, device, pad_id=0)
        distributed.barrier()
    tell(Order("stop"))
    torch.save({"steps": 2}, saved)
