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
import json
import logging
import math
import os
import resource
import shutil
import socket
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
import torch
from rich.console import Console
from rich.table import Table
from sqlalchemy.ext.asyncio import AsyncEngine

from store.adapters import AdapterRow, last_committed_step
from store.errors import NotFound
from store.groups import (
    GroupRow,
    claim_groups,
    drop_groups,
    finish_without_update,
    load_groups,
    release_groups,
    renew_lease,
)
from store.provide import open_store
from store.rollouts import RolloutReader
from store.types import StepMetrics
from trainer.batch import TrainSequence, pack_sequences, sequences_from_trajectory
from trainer.config import TrainConfig
from trainer.loss import compute_advantages, grpo_loss, token_logprobs

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
    rollouts: RolloutReader, groups: list[GroupRow], config: TrainConfig, current_step: int
) -> tuple[StepData, dict[str, str]]:
    """The claimed groups as training sequences; returns (data, {group id: why it is dropped untrained})."""
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
        constrained = set() if config.train_constrained else {c.id for c in trajectory.calls if c.constrained}
        sequences += [s for s in sequences_from_trajectory(i, trajectory.sequences, constrained) if any(s.sampled_mask)]
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
    """Forward/backward over the packed batch in micro-batches, clip, step. Returns the step's metrics."""
    loss_config = config.loss()
    started = time.monotonic()
    width = max(config.pack_tokens_per_row, max(len(s.token_ids) for s in data.sequences))
    batch = pack_sequences(data.sequences, max_tokens_per_row=width, pad_id=pad_id)
    advantages = data.advantages.to(device)
    rows = batch.input_ids.shape[0]
    total_tokens = max(batch.trainable_tokens, 1)
    n_trajectories = max(len({int(s.trajectory) for s in data.sequences}), 1)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0}
    for start in range(0, rows, config.rows_per_micro_batch):
        sl = slice(start, start + config.rows_per_micro_batch)
        input_ids = batch.input_ids[sl].to(device)  # (b, T)
        position_ids = batch.position_ids[sl].to(device)  # (b, T)
        attention_mask = batch.attention_mask[sl].to(device)  # (b, 1, T, T)
        labels = batch.labels[sl].to(device)  # (b, T)
        mask = batch.loss_mask[sl].to(device)  # (b, T)
        if not mask.any():
            continue
        logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask).logits
        new_logprobs = token_logprobs(logits.float(), labels)  # (b, T)
        ref_logprobs = None
        if loss_config.beta > 0:
            with torch.no_grad(), model.disable_adapter():  # the base model is the reference policy
                ref_logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask).logits
                ref_logprobs = token_logprobs(ref_logits.float(), labels)
        result = grpo_loss(
            new_logprobs,
            batch.sampled_logprobs[sl].to(device),
            batch.token_trajectory[sl].to(device),
            advantages,
            mask,
            loss_config,
            ref_logprobs=ref_logprobs,
        )
        # Weigh micro-batches by their share of what the normalization averages over.
        if loss_config.normalization == "grpo":
            share = result.num_trajectories / n_trajectories
        else:
            share = result.num_tokens / total_tokens
        (result.loss * share).backward()
        sums["loss"] += float(result.loss.detach()) * share
        sums["policy_loss"] += result.policy_loss * share
        sums["kl"] += (result.kl or 0.0) * share
        sums["clip_fraction"] += result.clip_fraction * share
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip if config.grad_clip > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = time.monotonic() - started
    return StepMetrics(
        **sums,
        grad_norm=float(grad_norm),
        reward_mean=statistics.fmean(data.rewards) if data.rewards else 0.0,
        reward_std=statistics.pstdev(data.rewards) if data.rewards else 0.0,
        groups=len(data.group_ids),
        zero_signal_group_fraction=data.zero_signal_groups / max(len(data.group_ids), 1),
        zero_advantage_trajectories=data.zero_advantage_trajectories,
        trainable_tokens=batch.trainable_tokens,
        padding_tokens=batch.padding_tokens,
        rows=rows,
        trainable_tokens_per_second=batch.trainable_tokens / seconds if seconds > 0 else 0.0,
        step_seconds=seconds,
        staleness=data.staleness,
        peak_memory_mb=peak_memory_mb(device),
        group_ids=data.group_ids,
    )


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
    """A model's policy and optimizer as its committed step left them (a fresh LoRA before step 1)."""
    adapter = Path(committed.path) if committed is not None else None
    model = load_policy(config, device, adapter)
    optimizer = make_optimizer(model, config)
    if adapter is not None and (adapter / "optimizer.pt").exists():
        optimizer.load_state_dict(torch.load(adapter / "optimizer.pt", map_location=device))
    return model, optimizer


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
                    )
                if lineage.ready(config):
                    return lineage
            counts = ", ".join(f"{lin.name} {len(lin.claimed)}/{config.groups_per_step}" for lin in lineages)
            status.update(f"[bold]groups claimed: {counts}[/bold]")
            held = [group_id for lineage in lineages for group_id in lineage.claimed]
            if held:  # keep what we hold alive while waiting for more
                async with store.begin() as conn:
                    await renew_lease(conn, held, owner, config.lease_seconds)
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
    for key in ("loss", "reward_mean", "reward_std", "zero_signal_group_fraction", "kl", "grad_norm"):
        table.add_row(key, f"{getattr(metrics, key):.4f}")
    for key in ("groups", "trainable_tokens", "staleness"):
        table.add_row(key, str(getattr(metrics, key)))
    table.add_row("tokens/s", f"{metrics.trainable_tokens_per_second:.0f}")
    table.add_row("step seconds", f"{metrics.step_seconds:.2f}")
    return table


async def run(config: TrainConfig, stop: asyncio.Event | None = None) -> int:
    """Train until stopped (or every model has max_steps); returns the number of committed steps, all models."""
    # StoreMissing if the gateway has not made it yet. The trainer is on no client's path: it waits out a
    # store stall (30 s a lock) rather than fail a step.
    async with open_store(config.db, wait_seconds=30.0) as store:
        return await train(config, store.engine, RolloutReader(store.engine), stop or asyncio.Event())


async def train(config: TrainConfig, store: AsyncEngine, rollouts: RolloutReader, stop: asyncio.Event) -> int:
    torch.manual_seed(config.seed)
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    device = pick_device(config)
    console.print(f"[bold]artgw train[/bold] base={config.base_model} device={device} owner={owner}")

    # ---- resume and models, one lineage per model: each from its own newest committed step, never from an
    # uncommitted checkpoint. Memory: each lineage loads a base copy of its own, simple and fine for a few
    # small models; PEFT's several adapters on one base (set_adapter per step) would share it.
    lineages: list[Lineage] = []
    for name in config.models:
        committed = await _committed(store, name)
        step = committed.step if committed is not None else 0
        discarded = discard_uncommitted(config, name, step)
        if discarded:
            console.print(f"[yellow]{name}: discarded uncommitted checkpoints {discarded}[/yellow]")
        model, optimizer = restore(config, device, committed)
        lineages.append(Lineage(name, model, optimizer, step, committed))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        console.print(f"  model={name} resume_step={step} trainable_params={trainable:,}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.base_model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

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
        if await train_one_step(store, rollouts, config, lineage, group_ids, owner, device, pad_id):
            done += 1
            lineage.done += 1
    await give_back(store, lineages, owner)  # stopped while waiting: what was claimed is trained by the next run
    return done


async def train_one_step(
    store: AsyncEngine,
    rollouts: RolloutReader,
    config: TrainConfig,
    lineage: Lineage,
    group_ids: list[str],
    owner: str,
    device: torch.device,
    pad_id: int,
) -> bool:
    """One step of one model on its claimed groups; True once committed (served, its groups trained)."""
    async with store.connect() as conn:
        groups = await load_groups(conn, group_ids)
    step = lineage.step + 1
    data, dropped = await load_step_data(rollouts, groups, config, step)
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
    metrics = train_step(lineage.model, lineage.optimizer, data, config, device, pad_id)
    path = save_checkpoint(lineage.model, lineage.optimizer, config, lineage.name, step, metrics)
    if config.pause_before_commit:
        await asyncio.sleep(config.pause_before_commit)
    async with store.begin() as conn:  # a long step must not lose its claim just before the commit
        await renew_lease(conn, data.group_ids, owner, config.lease_seconds)
    failure = await commit_step(store, config, lineage.name, step, path, data.group_ids, owner, metrics)
    if failure is not None:
        # The previous adapter keeps serving; the groups go back to `ready` and the model and optimizer
        # back to the last committed step, so nothing of this step survives.
        console.print(f"[red]{lineage.name} step {step} failed: {failure}[/red]")
        async with store.begin() as conn:
            await release_groups(conn, data.group_ids, owner)
        shutil.rmtree(path, ignore_errors=True)
        lineage.model, lineage.optimizer = restore(config, device, lineage.committed)
        await asyncio.sleep(2.0)
        return False
    lineage.step = step
    lineage.committed = await _committed(store, lineage.name)
    console.print(_metrics_table(lineage.name, step, metrics))
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
