"""`artgw train`: the GRPO sidecar. Claims ready groups, trains a LoRA step on their recorded tokens,
writes a checkpoint, has the gateway serve it, and only then are the groups trained.

Reads top to bottom: config → store and resume → models → optimizers → the loop. A step always runs in
the same order: claim → load trajectories → advantages → pack → forward/backward per micro-batch →
clip → optimizer step → checkpoint → commit through the gateway → log.

Several models (`--model a --model b`): each is a `Lineage` of its own (LoRA, optimizer state, step
counter, resume point, CHECKPOINTS/<model>/), and the loop takes turns: it polls every model for
claimable groups, trains the first whose batch is ready, then puts that model at the back of the line.
Groups are claimed per model, so a step never mixes models; with one model this is the plain loop.

Exactly once, per model: a step counts only when the gateway has loaded its adapter and, in the same
store transaction, marked its groups trained (see store/adapters.py). A trainer that dies before that
leaves its groups' leases to expire; on restart each model resumes from its own newest *committed*
checkpoint and deletes any newer, uncommitted one, so no group is trained twice or lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import resource
import shutil
import signal
import socket
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import httpx
import msgspec
import torch
from opentelemetry.trace import Tracer
from rich.console import Console
from rich.table import Table
from sqlalchemy.ext.asyncio import AsyncEngine
from torch import Tensor

from store.adapters import AdapterRow, committed_steps, last_committed_step
from store.errors import NotFound
from store.groups import (
    GroupRow,
    claim_groups,
    drop_groups,
    finish_without_update,
    load_groups,
    release_earlier_attempts,
    release_groups,
    renew_lease,
)
from store.provide import open_store
from store.rollouts import RolloutReader
from store.tracing import traced
from store.trajectories import Trajectory
from store.types import StepMetrics
from trainer import distributed
from trainer.batch import PackedBatch, TrainSequence, pack_sequences, sequences_from_trajectory
from trainer.config import TrainConfig
from trainer.grammar import GrammarMasks
from trainer.logprobs import policy_token_logprobs
from trainer.loss import batch_totals, compute_advantages, grpo_loss, trajectory_log_ratio_sums
from trainer.tracing import step_span
from trainer.tracking import Tracker, tracking

log = logging.getLogger("artgw.trainer")
console = Console(stderr=True)


# -----------------------------------------------------------------------------
# the data of one step


@dataclass(frozen=True)
class StepData:
    group_ids: list[str]
    sequences: list[TrainSequence]  # every trainable sequence, trajectory index into `advantages`
    advantages: torch.Tensor  # (N,) one per trajectory
    rewards: list[float]
    zero_signal_groups: int  # groups whose rewards were all equal: no gradient
    zero_advantage_trajectories: int  # skipped: their advantage is 0
    staleness: int  # steps between the oldest adapter that sampled a rollout and the one being trained


async def load_step_data(
    rollouts: RolloutReader,
    groups: list[GroupRow],
    config: TrainConfig,
    current_step: int,
    grammar: GrammarMasks | None = None,
) -> tuple[StepData, dict[str, str]]:
    """The claimed groups as training sequences; returns (data, {group id: why it is dropped untrained}).

    Tokens sampled under a grammar are trained under the same grammar's masks, rebuilt by `grammar` from the
    recorded request; without it (or with --no-train-constrained, or a grammar it cannot rebuild) they are context.
    """
    all_rewards, group_index, trajectories, steps_seen = [], [], [], []
    dropped: dict[str, str] = {}
    kept: list[GroupRow] = []
    for group in groups:
        try:
            loaded = [await rollouts.get(m.rollout_id, choice=m.choice) for m in group.members]
        except NotFound as exc:  # checked when the group was made; only a store edited by hand gets here
            dropped[group.id] = f"unreadable: {exc}"
            continue
        steps = [s for t in loaded for seq in t.sequences for s in seq.steps if s is not None]
        if steps and current_step - min(steps) >= config.max_staleness > 0:
            dropped[group.id] = f"stale: sampled {config.max_staleness} or more steps ago"
            continue
        kept.append(group)
        steps_seen += steps
        for member, trajectory in zip(group.members, loaded, strict=True):
            assert member.reward is not None, "claimed groups are ready: every reward is known"
            all_rewards.append(member.reward)
            group_index.append(len(kept) - 1)
            trajectories.append(trajectory)

    rewards = torch.tensor(all_rewards, dtype=torch.float32)  # (N,)
    advantages = (
        compute_advantages(rewards, torch.tensor(group_index), scale=config.scale_rewards)
        if all_rewards
        else torch.zeros(0)
    )
    sequences: list[TrainSequence] = []
    zero = 0
    for i, trajectory in enumerate(trajectories):
        if advantages[i] == 0:
            zero += 1  # no gradient: skip its tokens entirely
            continue
        if config.mask_truncated and any(
            c.finish_reasons[c.choice or 0] == "length"
            for c in trajectory.calls
            if c.status == "ok" and c.choice is not None
        ):
            continue  # a completion cut by the length limit: its reward judged an unfinished answer
        masks, untrained = constrained_masks(trajectory, grammar if config.train_constrained else None)
        sequences += [
            s for s in sequences_from_trajectory(i, trajectory.sequences, untrained, masks) if any(s.sampled_mask)
        ]
    zero_groups = sum(1 for g in kept if len({m.reward for m in g.members}) == 1)
    data = StepData(
        group_ids=[g.id for g in kept],
        sequences=sequences,
        advantages=advantages,
        rewards=all_rewards,
        zero_signal_groups=zero_groups,
        zero_advantage_trajectories=zero,
        staleness=current_step - 1 - min(steps_seen) if steps_seen else 0,
    )
    return data, dropped


def constrained_masks(trajectory: Trajectory, grammar: GrammarMasks | None) -> tuple[dict[str, Tensor], set[str]]:
    """({call id: grammar masks of its sampled tokens}, {ids of constrained calls left untrained}).

    A call whose grammar cannot be rebuilt, or whose tokens the rebuilt grammar rejects, is context: its
    tokens' recorded logprobs are masked ones that the trainer could not reproduce.
    """
    constrained = {c.id: c for c in trajectory.calls if c.constrained}
    masks: dict[str, Tensor] = {}
    untrained: set[str] = set()
    for sequence in trajectory.sequences:
        for call_id, (start, end) in zip(sequence.call_ids, sequence.sampled_spans, strict=True):
            call = constrained.get(call_id)
            if call is None:
                continue
            rows = None
            if grammar is not None and call.grammar_request is not None:
                try:
                    rows = grammar.for_call(call.grammar_request, list(sequence.token_ids[start:end]))
                except ValueError as exc:
                    log.warning("call %s: its grammar does not match its tokens, trained as context: %s", call_id, exc)
            if rows is None:
                untrained.add(call_id)
            else:
                masks[call_id] = rows
    return masks, untrained


# -----------------------------------------------------------------------------
# model, optimizer, checkpoints


def pick_device(config: TrainConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def load_policy(config: TrainConfig, device: torch.device, adapter_dir: Path | None):  # -> PeftModel
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    # bf16 where the device does it well, fp32 on CPU.
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    base = AutoModelForCausalLM.from_pretrained(config.base_model, dtype=dtype, attn_implementation="sdpa")
    if config.gradient_checkpointing:
        base.gradient_checkpointing_enable()
        base.enable_input_require_grads()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
    else:
        lora = LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=list(config.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, lora)
    return model.to(device)


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=config.learning_rate, betas=(config.beta1, config.beta2), weight_decay=config.weight_decay
    )


def checkpoint_dir(config: TrainConfig, name: str, step: int) -> Path:
    return config.checkpoints / name / str(step)


def save_checkpoint(model, optimizer, config: TrainConfig, name: str, step: int, metrics: StepMetrics) -> Path:
    out = checkpoint_dir(config, name, step)
    tmp = out.with_name(f".{step}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # adapter_config.json + adapter_model.safetensors: what vLLM loads
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    saved = {"model": name, "step": step, "metrics": msgspec.to_builtins(metrics), "config": config.to_json()}
    (tmp / "step.json").write_text(json.dumps(saved, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # a checkpoint dir is complete or absent
    return out


def discard_uncommitted(config: TrainConfig, name: str, committed: int) -> list[int]:
    """`name`'s checkpoints newer than its last committed step never served: their groups will be trained again."""
    root = config.checkpoints / name
    dropped = []
    for path in root.glob("*") if root.exists() else []:
        name = path.name.lstrip(".").removesuffix(".tmp")
        if name.isdigit() and (int(name) > committed or path.name.endswith(".tmp")):
            shutil.rmtree(path, ignore_errors=True)
            dropped.append(int(name))
    return sorted(dropped)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# -----------------------------------------------------------------------------
# one optimizer step


def train_step(model, optimizer, data: StepData, config: TrainConfig, device: torch.device, pad_id: int) -> StepMetrics:
    """Forward/backward over the packed batch in micro-batches, clip, step. Returns the step's metrics.

    Exact for any --micro-batch-rows, --pack-tokens-per-row and number of processes: the loss's normalizers
    (BatchTotals) are counted once over the whole batch, so the parts' gradients add up to the whole batch's.
    Under torch.distributed every process packs the same batch, trains its share of the rows (split by tokens),
    and the gradients are summed across processes before the clip: every process then takes the same step.
    """
    loss_config = config.loss()
    started = time.monotonic()
    width = max(config.pack_tokens_per_row, max(len(s.token_ids) for s in data.sequences))
    batch = pack_sequences(data.sequences, max_tokens_per_row=width, pad_id=pad_id)
    advantages = data.advantages.to(device)
    n = advantages.shape[0]
    own_rows = rows_of_process(batch, distributed.rank(), distributed.world_size())
    micro_batches = split_micro_batches(
        own_rows, batch.input_ids.shape[1], config.micro_batch_rows, config.pack_tokens_per_row
    )
    bitmask = batch.allowed_bitmask.to(device) if batch.allowed_bitmask is not None else None

    def logprobs(rows: list[int]) -> Tensor:  # (b, T) log pi(label) of these rows, 0 off the loss mask
        return policy_token_logprobs(
            model,
            batch.input_ids[rows].to(device),
            batch.position_ids[rows].to(device),
            batch.attention_mask[rows].to(device),
            batch.labels[rows].to(device),
            batch.loss_mask[rows].to(device),
            chunk_size=config.logprob_chunk_tokens,
            allowed_index=batch.allowed_index[rows].to(device) if bitmask is not None else None,
            allowed_bitmask=bitmask,
        )

    model.train()
    optimizer.zero_grad(set_to_none=True)
    totals = batch_totals(batch.token_trajectory.to(device), batch.loss_mask.to(device), n)
    if loss_config.policy == "gspo":  # each trajectory's sequence ratio, over all its rows, before any update
        log_ratio_sums = torch.zeros(n, dtype=torch.float64, device=device)
        with torch.no_grad():
            for rows in micro_batches:
                log_ratio_sums += trajectory_log_ratio_sums(
                    logprobs(rows),
                    batch.sampled_logprobs[rows].to(device),
                    batch.token_trajectory[rows].to(device),
                    batch.loss_mask[rows].to(device),
                    n,
                )
        sum_over_processes(log_ratio_sums)
        counts = totals.tokens_per_trajectory
        totals = dataclasses.replace(totals, sequence_log_ratio=log_ratio_sums / counts.clamp(min=1))

    # loss, policy_loss, kl, clipped tokens, sum of ratios, constrained tokens, sum of their ratios
    sums = torch.zeros(7, dtype=torch.float64)
    for rows in micro_batches:
        mask = batch.loss_mask[rows].to(device)  # (b, T)
        if not mask.any():
            continue
        sampled = batch.sampled_logprobs[rows].to(device)  # (b, T)
        new_logprobs = logprobs(rows)  # (b, T)
        ref_logprobs = None
        if loss_config.beta > 0:
            with torch.no_grad(), model.disable_adapter():  # the base model is the reference policy
                ref_logprobs = logprobs(rows)
        result = grpo_loss(
            new_logprobs,
            sampled,
            batch.token_trajectory[rows].to(device),
            advantages,
            mask,
            loss_config,
            ref_logprobs=ref_logprobs,
            totals=totals,
        )
        result.loss.backward()  # with the whole batch's totals, the parts' losses add up: no weighting
        with torch.no_grad():
            constrained = mask & (batch.allowed_index[rows].to(device) >= 0)
            token_ratio = (new_logprobs.detach().double() - sampled.double()).exp()
            sums += torch.tensor(
                [
                    float(result.loss.detach()),
                    result.policy_loss,
                    result.kl or 0.0,
                    result.clip_fraction * result.num_tokens,
                    result.ratio_mean * result.num_tokens,
                    float(constrained.sum()),
                    float(token_ratio[constrained].sum()),
                ],
                dtype=torch.float64,
            )
    params = [p for p in model.parameters() if p.requires_grad]
    sum_gradients_over_processes(params)
    sum_over_processes(sums)
    loss, policy_loss, kl, clipped, ratio_sum, constrained_tokens, constrained_ratio_sum = sums.tolist()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip if config.grad_clip > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = time.monotonic() - started
    trained = max(batch.trainable_tokens, 1)
    return StepMetrics(
        loss=loss,
        policy_loss=policy_loss,
        kl=kl,
        clip_fraction=clipped / trained,
        ratio_mean=ratio_sum / trained if batch.trainable_tokens else 1.0,
        constrained_tokens=int(constrained_tokens),
        constrained_ratio_mean=constrained_ratio_sum / constrained_tokens if constrained_tokens else 1.0,
        grad_norm=float(grad_norm),
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


def sum_gradients_over_processes(params: list[torch.nn.Parameter]) -> None:
    """Every process's gradients become their sum over processes: one flat all-reduce."""
    if distributed.world_size() == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    sum_over_processes(flat)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


# -----------------------------------------------------------------------------
# talking to the gateway


def commit_through_gateway(
    config: TrainConfig, name: str, step: int, path: Path, group_ids: list[str], owner: str, metrics: StepMetrics
) -> None:
    """Ask the gateway to serve the adapter as `name`@`step`; it marks the groups trained in the same transaction."""
    headers = {"Authorization": f"Bearer {config.admin_key}"} if config.admin_key else {}
    answer = httpx.post(
        f"{config.gateway.rstrip('/')}/v1/art/models/{quote(name, safe='')}/adapters",
        json={
            "step": step,
            "path": str(path.resolve()),
            "group_ids": group_ids,
            "lease_owner": owner,
            "metrics": msgspec.to_builtins(metrics),
        },
        headers=headers,
        timeout=300,
    )
    if not answer.is_success:
        raise RuntimeError(f"gateway refused {name} step {step} ({answer.status_code}): {answer.text[:500]}")


# -----------------------------------------------------------------------------
# one line of adapters per trainable model


@dataclass
class Lineage:
    """One trainable model's own line of adapters: nothing in it is shared with another model."""

    name: str  # the trainable model: groups are claimed for it, its adapters serve as NAME@K
    model: Any  # PeftModel: its LoRA, on a base copy of its own
    optimizer: torch.optim.Optimizer
    step: int  # its newest committed step; the next one is step + 1
    committed: AdapterRow | None  # that step's row: where a failed step goes back to (None: the base model)
    claimed: list[str] = field(default_factory=list)  # groups claimed for its next step, not yet trained
    deadline: float | None = None  # monotonic time after which min_groups_per_step is enough; None: not waiting
    done: int = 0  # steps committed by this run (for --max-steps)

    def ready(self, config: TrainConfig) -> bool:
        """A full batch, or a small one once it has waited max_wait_seconds."""
        assert self.deadline is not None, "only a waiting lineage can be ready"
        if len(self.claimed) >= config.groups_per_step:
            return True
        return len(self.claimed) >= config.min_groups_per_step and time.monotonic() >= self.deadline

    def finished(self, config: TrainConfig) -> bool:
        return config.max_steps is not None and self.done >= config.max_steps


def restore(
    config: TrainConfig, device: torch.device, committed: AdapterRow | None
) -> tuple[Any, torch.optim.Optimizer]:
    """A model's policy and optimizer as its committed step left them (a fresh LoRA before step 1). An optimizer
    state that does not load starts fresh, with a warning: the adapter is what matters."""
    adapter = Path(committed.path) if committed is not None else None
    model = load_policy(config, device, adapter)
    distributed.broadcast_parameters(model)  # several processes: every rank starts the step from rank 0's
    optimizer = make_optimizer(model, config)
    if adapter is not None and (adapter / "optimizer.pt").exists():
        try:
            optimizer.load_state_dict(torch.load(adapter / "optimizer.pt", map_location=device))
        except Exception as exc:  # a damaged file: torch raises whatever its unpickler met
            warning = f"[yellow]{adapter}/optimizer.pt does not load ({_one_line(exc)}): optimizer state fresh"
            console.print(warning, soft_wrap=True)
            optimizer = make_optimizer(model, config)
    return model, optimizer


def unreadable(adapter: Path) -> str | None:
    """Why a checkpoint's adapter cannot be loaded (a config that isn't JSON, weights missing or cut short), or
    None. Every tensor is read: a truncated file passes a header check."""
    from safetensors import safe_open

    try:
        if not isinstance(json.loads((adapter / "adapter_config.json").read_text()), dict):
            return "adapter_config.json is not a JSON object"
        with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as weights:
            for key in weights.keys():
                weights.get_tensor(key)
    except Exception as exc:  # OSError, JSONDecodeError, SafetensorError, ...: all say "not this checkpoint"
        return _one_line(exc)
    return None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


async def resume_point(store: AsyncEngine, name: str) -> tuple[int, AdapterRow | None]:
    """Where a model's training resumes: the number of its newest committed step (the next step is one more),
    and the newest committed step whose checkpoint loads (None: the base weights). A damaged or missing
    checkpoint is skipped with a one-line warning, never a traceback."""
    async with store.connect() as conn:
        rows = await committed_steps(conn, name)
    for row in rows:
        problem = unreadable(Path(row.path))
        if problem is None:
            return rows[0].step, row
        warning = f"[yellow]{name}: step {row.step}'s checkpoint {row.path} does not load ({problem})"
        console.print(warning, soft_wrap=True)
    if rows:
        console.print(f"[yellow]{name}: no committed checkpoint loads; resuming from the base weights", soft_wrap=True)
    return (rows[0].step if rows else 0), None


# -----------------------------------------------------------------------------
# the loop


async def wait_for_batch(
    store: AsyncEngine, config: TrainConfig, lineages: list[Lineage], owner: str, stop: asyncio.Event
) -> Lineage | None:
    """Poll each model in turn, claiming its groups, until one has a batch: groups_per_step groups, or at least
    min_groups_per_step once its max_wait_seconds have passed. None once stopped."""
    for lineage in lineages:
        if lineage.deadline is None:  # its wait starts now, as each of its steps ends
            lineage.deadline = time.monotonic() + config.max_wait_seconds
    names = ", ".join(lineage.name for lineage in lineages)
    with console.status(f"[bold]waiting for ready groups of {names}[/bold]") as status:
        while not stop.is_set():
            for lineage in lineages:
                async with store.begin() as conn:
                    lineage.claimed += await claim_groups(
                        conn,
                        model=lineage.name,
                        owner=owner,
                        lease_seconds=config.lease_seconds,
                        limit=config.groups_per_step - len(lineage.claimed),
                        now=time.time(),
                    )
                if lineage.ready(config):
                    return lineage
            counts = ", ".join(f"{lin.name} {len(lin.claimed)}/{config.groups_per_step}" for lin in lineages)
            status.update(f"[bold]groups claimed: {counts}[/bold]")
            held = [group_id for lineage in lineages for group_id in lineage.claimed]
            if held:  # keep what we hold alive while waiting for more
                async with store.begin() as conn:
                    await renew_lease(conn, held, owner, config.lease_seconds, now=time.time())
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass
    return None


async def give_back(store: AsyncEngine, lineages: list[Lineage], owner: str) -> None:
    """Return the groups claimed by these lineages to `ready`: nothing holds a claim it is not renewing."""
    for lineage in lineages:
        if lineage.claimed:
            async with store.begin() as conn:
                await release_groups(conn, lineage.claimed, owner)
            lineage.claimed = []


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


def main(config: TrainConfig) -> int:
    """`run` until done or SIGINT/SIGTERM, which let the step in hand finish (or fail) cleanly: what `artgw train`
    runs, in each of its processes. Returns the number of committed steps."""

    async def until_stopped() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)  # ranks > 0 ignore it: they stop when rank 0 says so
        return await run(config, stop)

    return asyncio.run(until_stopped())


@dataclass(frozen=True)
class Order:
    """What rank 0 tells the other ranks to do next (several processes only)."""

    kind: Literal["train", "restore", "stop"]
    model: str = ""
    data: StepData | None = None  # "train": the step's batch, the same on every rank
    committed: AdapterRow | None = None  # "restore": the step to go back to (None: a fresh LoRA)


async def run(config: TrainConfig, stop: asyncio.Event | None = None) -> int:
    """Train until stopped (or every model has max_steps); returns the number of committed steps, all models."""
    if not distributed.is_lead():
        return await follow(config)  # ranks > 0 never open the store: rank 0 tells them what to train
    # StoreMissing if the gateway has not made it yet. The trainer is on no client's path: it waits out a
    # store stall (30 s a lock) rather than fail a step.
    async with open_store(config.db, wait_seconds=30.0) as store:
        # --wandb-project: one W&B run, finished however the loop ends; OTEL_EXPORTER_OTLP_ENDPOINT: a span per step
        with tracking(config) as tracker, traced("artgw-trainer", "artgw.trainer") as tracer:
            rollouts = RolloutReader(store.engine)
            return await train(config, store.engine, rollouts, stop or asyncio.Event(), tracker, tracer)


async def train(
    config: TrainConfig,
    store: AsyncEngine,
    rollouts: RolloutReader,
    stop: asyncio.Event,
    tracker: Tracker,
    tracer: Tracer | None = None,
) -> int:
    """The loop of the one process, or of rank 0 (which alone claims, checkpoints and commits); `tracker` hears
    of every committed step."""
    torch.manual_seed(config.seed)  # several processes: every rank builds the same fresh LoRA
    device = pick_device(config)
    if distributed.active():
        owner = distributed.owner()
        # A restarted group: what the dead attempt claimed is given back now (its lease would keep it for
        # --lease-seconds), before the resume point is read, so a commit it left in flight either shows in
        # that point or finds its groups no longer its own.
        async with store.begin() as conn:
            released = await release_earlier_attempts(conn, config.models, distributed.owner_prefix(), owner)
        if released:
            console.print(f"[yellow]gave back {len(released)} groups claimed by the previous attempt[/yellow]")
    else:
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    console.print(f"[bold]artgw train[/bold] base={config.base_model} device={device} owner={owner}{_process_line()}")

    # ---- resume and models, one lineage per model: each from its own newest committed step, never from an
    # uncommitted checkpoint. Memory: each lineage loads a base copy of its own, simple and fine for a few
    # small models; PEFT's several adapters on one base (set_adapter per step) would share it.
    resume_points = distributed.share({name: await resume_point(store, name) for name in config.models})
    lineages: list[Lineage] = []
    for name, (step, committed) in resume_points.items():
        discarded = discard_uncommitted(config, name, step)
        if discarded:
            console.print(f"[yellow]{name}: discarded uncommitted checkpoints {discarded}[/yellow]")
        lineages.append(_lineage(config, device, name, step, committed))
        trainable = sum(p.numel() for p in lineages[-1].model.parameters() if p.requires_grad)
        weights = f"step {committed.step}" if committed is not None else "the base"
        console.print(f"  model={name} resume_step={step} weights={weights} trainable_params={trainable:,}")
    pad_id = _pad_id(config)
    # Built once: tokens sampled under a grammar are scored under the masks vLLM sampled them under.
    grammar = GrammarMasks.for_model(config.base_model) if config.train_constrained else None

    # ---- the loop: take turns, training whichever model has a batch ready
    done = 0
    while not stop.is_set():
        waiting = [lineage for lineage in lineages if not lineage.finished(config)]
        if not waiting:
            break
        lineage = await wait_for_batch(store, config, waiting, owner, stop)
        if lineage is None:
            break
        # The others' claims go back to `ready`: this step may outlast leases that nobody renews meanwhile.
        # The loop claims them again (oldest first) when it next polls those models.
        await give_back(store, [other for other in lineages if other is not lineage], owner)
        # Taking turns: this model goes to the back of the line, so a busy model cannot starve the others.
        lineages.remove(lineage)
        lineages.append(lineage)
        group_ids, lineage.claimed, lineage.deadline = lineage.claimed, [], None
        if await train_one_step(
            store, rollouts, config, lineage, group_ids, owner, device, pad_id, grammar, tracker, tracer
        ):
            done += 1
            lineage.done += 1
    await give_back(store, lineages, owner)  # stopped while waiting: what was claimed is trained by the next run
    distributed.share(Order("stop"))
    return done


async def follow(config: TrainConfig) -> int:
    """Ranks > 0: the same models as rank 0, then each step it orders, until it says stop; returns the steps
    trained. Never touches the store: rank 0 sends each step's data."""
    torch.manual_seed(config.seed)
    device = pick_device(config)
    console.print(f"[bold]artgw train[/bold] device={device}{_process_line()}: following rank 0")
    resume_points: dict[str, tuple[int, AdapterRow | None]] = distributed.share(None)
    # In rank 0's order: restore() broadcasts each model's parameters, a collective every rank calls alike.
    lineages = {name: _lineage(config, device, name, *point) for name, point in resume_points.items()}
    pad_id = _pad_id(config)
    steps = 0
    while (order := distributed.share(None)).kind != "stop":
        lineage = lineages[order.model]
        if order.kind == "restore":
            lineage.model, lineage.optimizer = restore(config, device, order.committed)
            continue
        train_step(lineage.model, lineage.optimizer, order.data, config, device, pad_id)
        distributed.barrier()  # rank 0 has written the step's checkpoint
        steps += 1
    return steps


def _process_line() -> str:
    """' rank R/W pid P' under torch.distributed (the crash tests find a rank's process by it), else ''."""
    if not distributed.active():
        return ""
    return f" rank {distributed.rank()}/{distributed.world_size()} pid {os.getpid()}"


def _lineage(config: TrainConfig, device: torch.device, name: str, step: int, committed: AdapterRow | None) -> Lineage:
    """A model's lineage at `step` (its newest committed), with the weights of `committed` (its newest that
    loads; None: the base)."""
    model, optimizer = restore(config, device, committed)
    return Lineage(name, model, optimizer, step, committed)


def _pad_id(config: TrainConfig) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.base_model)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


async def train_one_step(
    store: AsyncEngine,
    rollouts: RolloutReader,
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
    async with store.connect() as conn:
        groups = await load_groups(conn, group_ids)
    step = lineage.step + 1
    data, dropped = await load_step_data(rollouts, groups, config, step, grammar)
    for group_id, reason in dropped.items():
        async with store.begin() as conn:
            await drop_groups(conn, [group_id], owner, reason)
        console.print(f"[yellow]{lineage.name}: dropped group {group_id}: {reason}[/yellow]")
    if not data.group_ids:
        return False
    if not data.sequences:  # every advantage was 0 (or no token trainable): no new adapter
        async with store.begin() as conn:
            await finish_without_update(conn, data.group_ids, owner, lineage.step)
        console.print(f"[yellow]{lineage.name}: {len(data.group_ids)} groups without learning signal: no step[/yellow]")
        return False
    distributed.share(Order("train", lineage.name, data))  # the other ranks train this step with us
    metrics = train_step(lineage.model, lineage.optimizer, data, config, device, pad_id)
    path = save_checkpoint(lineage.model, lineage.optimizer, config, lineage.name, step, metrics)
    if config.pause_before_commit:
        await asyncio.sleep(config.pause_before_commit)
    # Every rank is still here: one that died since the step's gradients were summed fails this barrier, and the
    # launcher restarts the group, which trains these groups again; the step is not committed.
    distributed.barrier()
    async with store.begin() as conn:  # a long step must not lose its claim just before the commit
        await renew_lease(conn, data.group_ids, owner, config.lease_seconds, now=time.time())
    failure = await commit_step(store, config, lineage.name, step, path, data.group_ids, owner, metrics)
    step_span(tracer, lineage.name, step, metrics, started, failure)
    if failure is not None:
        # The previous adapter keeps serving; the groups go back to `ready` and the model and optimizer
        # back to the last committed step, so nothing of this step survives.
        console.print(f"[red]{lineage.name} step {step} failed: {failure}[/red]")
        async with store.begin() as conn:
            await release_groups(conn, data.group_ids, owner)
        shutil.rmtree(path, ignore_errors=True)
        distributed.share(Order("restore", lineage.name, committed=lineage.committed))  # every rank goes back
        lineage.model, lineage.optimizer = restore(config, device, lineage.committed)
        await asyncio.sleep(2.0)
        return False
    lineage.step = step
    lineage.committed = await _committed(store, lineage.name)
    console.print(_metrics_table(lineage.name, step, metrics))
    tracker.step(lineage.name, step, metrics, path)
    return True


async def _committed(store: AsyncEngine, name: str) -> AdapterRow | None:
    async with store.connect() as conn:
        return await last_committed_step(conn, name)


async def commit_step(
    store: AsyncEngine,
    config: TrainConfig,
    name: str,
    step: int,
    path: Path,
    group_ids: list[str],
    owner: str,
    metrics: StepMetrics,
) -> str | None:
    """Commit through the gateway; None on success, else why not. A lost answer is checked in the store."""
    try:
        commit_through_gateway(config, name, step, path, group_ids, owner, metrics)
        return None
    except Exception as exc:
        committed = await _committed(store, name)
        if committed is not None and committed.step == step:
            return None  # the gateway committed; only its answer was lost
        return str(exc)
