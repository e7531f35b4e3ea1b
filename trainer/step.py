"""One optimizer step of one model: pack → check → (gspo: sequence ratios) → forward/backward per micro-batch →
sum over processes → clip → optimizer step → the step's figures, read from the device once.

Exact for any --micro-batch-rows, --pack-tokens-per-row and number of processes: the loss's normalizers
(BatchTotals) are counted once over the whole batch, so the parts' gradients add up to the whole batch's. Under
torch.distributed every process packs the same batch, trains its share of the rows (split by tokens), and
DistributedDataParallel sums the gradients (trainer/model.py) during the last micro-batch's backward pass, so
every process takes the same step.

Nothing here waits for the device before the step's end: the values the checks need are read on the host
batch, the batch goes to the device without waiting (`non_blocking`: a plain `.to()` of host memory waits for
the work queued before it), and the figures of each micro-batch add up as tensors.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any

import torch
from torch import Tensor

from store.types import StepMetrics
from trainer import distributed
from trainer.batch import PackedBatch, StepData, pack_sequences
from trainer.config import TrainConfig
from trainer.loss import batch_totals, grpo_loss, trajectory_log_ratio_sums
from trainer.model import Policy, peak_memory_mb

# The step's figures, summed over micro-batches and processes in one float64 tensor (this order).
FIGURES = ("loss", "policy_loss", "kl", "clipped", "ratio_sum", "constrained_tokens", "constrained_ratio_sum")


def train_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    data: StepData,
    config: TrainConfig,
    device: torch.device,
    pad_id: int,
) -> StepMetrics:
    """Forward/backward over the packed batch in micro-batches, clip, step. Returns the step's metrics."""
    loss_config = config.loss()
    started = time.monotonic()
    width = max(config.pack_tokens_per_row, max(len(s.token_ids) for s in data.sequences))
    batch = pack_sequences(data.sequences, max_tokens_per_row=width, pad_id=pad_id)  # (R, T) rows, on the host
    n = data.advantages.shape[0]
    check_labels(batch, policy.model.get_output_embeddings().weight.shape[0])
    totals = batch_totals(batch.token_trajectory, batch.loss_mask, n)  # (N,) counted and checked on the host
    loss_config.check_totals(totals)
    totals = dataclasses.replace(
        totals, tokens_per_trajectory=totals.tokens_per_trajectory.to(device, non_blocking=True)
    )
    advantages = data.advantages.to(device, non_blocking=True)  # (N,)
    own_rows = rows_of_process(batch, distributed.rank(), distributed.world_size())
    micro_batches = split_micro_batches(own_rows, width, config.micro_batch_rows, config.pack_tokens_per_row)
    # A process with no rows (fewer rows than processes) still runs one pass, on a row it does not train
    # (nothing of it is trained): DDP sums the gradients in a backward pass that every process makes.
    idle = not micro_batches
    if idle:
        micro_batches = [[0]]
    bitmask = batch.allowed_bitmask.to(device, non_blocking=True) if batch.allowed_bitmask is not None else None

    def inputs(rows: list[int]) -> dict[str, Any]:  # what TokenLogprobs takes, for these rows
        return {
            "input_ids": batch.input_ids[rows].to(device, non_blocking=True),  # (b, T)
            "position_ids": batch.position_ids[rows].to(device, non_blocking=True),  # (b, T)
            "attention_mask": batch.attention_mask[rows].to(device, non_blocking=True),  # (b, 1, T, T)
            "labels": batch.labels[rows].to(device, non_blocking=True),  # (b, T)
            "positions": batch.loss_mask[rows] & (not idle),  # (b, T) on the host: the tokens scored
            "allowed_index": batch.allowed_index[rows].to(device, non_blocking=True) if bitmask is not None else None,
            "allowed_bitmask": bitmask,
        }

    policy.model.train()
    optimizer.zero_grad(set_to_none=True)
    if loss_config.policy == "gspo":  # each trajectory's sequence ratio, over all its rows, before any update
        log_ratio_sums = torch.zeros(n, dtype=torch.float64, device=device)  # (N,)
        with torch.no_grad():
            for rows in micro_batches:
                x = inputs(rows)
                log_ratio_sums += trajectory_log_ratio_sums(
                    policy.logprobs(**x),
                    batch.sampled_logprobs[rows].to(device, non_blocking=True),
                    batch.token_trajectory[rows].to(device, non_blocking=True),
                    x["positions"].to(device, non_blocking=True),
                    n,
                )
                del x
        sum_over_processes(log_ratio_sums)
        counts = totals.tokens_per_trajectory
        totals = dataclasses.replace(totals, sequence_log_ratio=log_ratio_sums / counts.clamp(min=1))

    sums = torch.zeros(len(FIGURES), dtype=torch.float64, device=device)
    for i, rows in enumerate(micro_batches):
        x = inputs(rows)
        mask = x["positions"].to(device, non_blocking=True)  # (b, T)
        sampled = batch.sampled_logprobs[rows].to(device, non_blocking=True)  # (b, T)
        constrained = mask & (x["allowed_index"] >= 0) if bitmask is not None else torch.zeros_like(mask)  # (b, T)
        with policy.accumulating(last=i == len(micro_batches) - 1):
            new_logprobs = policy.logprobs(**x)  # (b, T)
            ref_logprobs = None
            if loss_config.beta > 0:
                with torch.no_grad(), policy.model.disable_adapter():  # the base model is the reference policy
                    ref_logprobs = policy.logprobs(**x)
            del x  # the inputs (the (b, 1, T, T) mask above all) are not held through the backward pass
            result = grpo_loss(
                new_logprobs,
                sampled,
                batch.token_trajectory[rows].to(device, non_blocking=True),
                advantages,
                mask,
                loss_config,
                ref_logprobs=ref_logprobs,
                totals=totals,
            )
            result.loss.backward()  # with the whole batch's totals, the parts' losses add up: no weighting
        with torch.no_grad():
            token_ratio = (new_logprobs.detach().double() - sampled.double()).exp()  # (b, T)
            kl = result.kl if result.kl is not None else result.policy_loss.new_zeros(())
            figures = (result.loss.detach(), result.policy_loss, kl, result.clipped_tokens, result.ratio_sum)
            sums += torch.stack(
                [
                    *(f.double() for f in figures),
                    constrained.sum().double(),
                    torch.where(constrained, token_ratio, 0.0).sum(),
                ]
            )
        # Nothing of this micro-batch outlives it: the next one's inputs and activations take its place.
        del mask, sampled, new_logprobs, ref_logprobs, result, constrained, token_ratio
    sum_over_processes(sums)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip if config.grad_clip > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # The step's one read of the device: every figure at once, once the update is done.
    values = dict(zip((*FIGURES, "grad_norm"), torch.cat([sums, grad_norm.double().view(1)]).tolist(), strict=True))
    seconds = time.monotonic() - started
    trained = max(batch.trainable_tokens, 1)
    constrained_tokens = int(values["constrained_tokens"])
    return StepMetrics(
        loss=values["loss"],
        policy_loss=values["policy_loss"],
        kl=values["kl"],
        clip_fraction=values["clipped"] / trained,
        ratio_mean=values["ratio_sum"] / trained if batch.trainable_tokens else 1.0,
        constrained_tokens=constrained_tokens,
        constrained_ratio_mean=values["constrained_ratio_sum"] / constrained_tokens if constrained_tokens else 1.0,
        grad_norm=values["grad_norm"],
        reward_mean=statistics.fmean(data.rewards) if data.rewards else 0.0,
        reward_std=statistics.pstdev(data.rewards) if data.rewards else 0.0,
        groups=len(data.group_ids),
        zero_signal_group_fraction=data.zero_signal_groups / max(len(data.group_ids), 1),
        zero_advantage_trajectories=data.zero_advantage_trajectories,
        trainable_tokens=batch.trainable_tokens,
        padding_tokens=batch.padding_tokens,
        rows=batch.input_ids.shape[0],
        trainable_tokens_per_second=batch.trainable_tokens / seconds if seconds > 0 else 0.0,
        step_seconds=seconds,
        staleness=data.staleness,
        peak_memory_mb=peak_memory_mb(device),
        group_ids=data.group_ids,
    )


def check_labels(batch: PackedBatch, vocab: int) -> None:
    """Every trained token is a token of the model's vocabulary (on the host: once a step, no device wait)."""
    trained = batch.labels[batch.loss_mask]
    if trained.numel() and (int(trained.min()) < 0 or int(trained.max()) >= vocab):
        raise ValueError(
            f"trained token ids must be in [0, {vocab}) (the model's vocabulary), got "
            f"{int(trained.min())}..{int(trained.max())}: were these rollouts sampled from another model?"
        )


def rows_of_process(batch: PackedBatch, rank: int, count: int) -> list[int]:
    """The packed rows `rank` of `count` processes trains: the rows dealt longest first to the process with the
    fewest tokens so far (ties: the lowest rank), so every process gets about the same number of tokens."""
    load = [0] * count
    own: list[int] = []
    for row in sorted(range(len(batch.row_tokens)), key=lambda r: -batch.row_tokens[r]):
        to = min(range(count), key=lambda k: (load[k], k))
        load[to] += batch.row_tokens[row]
        if to == rank:
            own.append(row)
    return sorted(own)


def split_micro_batches(rows: list[int], width: int, max_rows: int, row_tokens: int) -> list[list[int]]:
    """`rows` (each `width` positions: the batch's) in consecutive micro-batches of at most `max_rows` rows and
    at most `max_rows` x `row_tokens` positions (never fewer than one row).

    Memory goes with positions, not rows: a sequence longer than --pack-tokens-per-row widens every row of the
    batch, and micro-batches of --micro-batch-rows such rows would hold more than the nominal
    rows x width positions that the two settings promise (8 x 640 instead of 8 x 512: +25% activations).
    """
    if max_rows < 1 or row_tokens < 1 or width < 1:
        raise ValueError(f"max_rows, row_tokens and width must be >= 1, got {max_rows}, {row_tokens}, {width}")
    per_pass = max(1, min(max_rows, max_rows * row_tokens // width))
    return [rows[i : i + per_pass] for i in range(0, len(rows), per_pass)]


def sum_over_processes(values: Tensor) -> None:
    """Sum a tensor in place across the training processes (nothing to do in one process)."""
    if distributed.world_size() > 1:
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.SUM)
