"""GRPO advantages and loss: pure functions of tensors and a frozen config.

The trainer packs trajectories into rows: one row may hold several sequences and one
trajectory (a multi-turn conversation) may span several rows. Everything here works on
that packed layout through a per-token trajectory index, so nothing has to be unpacked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = [
    "AdvantageScale",
    "BatchTotals",
    "LossConfig",
    "LossResult",
    "Normalization",
    "PolicyLoss",
    "batch_totals",
    "compute_advantages",
    "grpo_loss",
    "trajectory_log_ratio_sums",
]

Normalization = Literal["grpo", "dr_grpo", "dapo"]
PolicyLoss = Literal["ppo", "cispo", "gspo"]
AdvantageScale = Literal["group", "batch", "none"]


# -----------------------------------------------------------------------------
# config and result


@dataclass(frozen=True)
class LossConfig:
    epsilon_low: float = 0.2  # PPO clip below: ratio >= 1 - epsilon_low
    epsilon_high: float = 0.28  # clip above (DAPO's clip-higher): ratio <= 1 + epsilon_high
    tis_cap: float | None = 2.0  # truncated importance sampling cap C on the unclipped ratio; None = off
    normalization: Normalization = "grpo"  # how token losses are averaged, see _normalize
    max_completion_tokens: int | None = None  # dr_grpo's constant denominator; None = longest trajectory
    beta: float = 0.0  # KL(pi || ref) weight, k3 estimator; 0 = off (no ref forward needed)
    policy: PolicyLoss = "ppo"  # the per-token surrogate, see _surrogate

    def __post_init__(self) -> None:
        # `not x >= 0` rather than `x < 0` so NaN is rejected too.
        if not 0.0 <= self.epsilon_low < 1.0:
            raise ValueError(
                f"epsilon_low must be in [0, 1) so the lower clip bound 1 - epsilon_low stays positive, "
                f"got {self.epsilon_low}"
            )
        if not self.epsilon_high >= 0.0:
            raise ValueError(f"epsilon_high must be >= 0, got {self.epsilon_high}")
        if self.tis_cap is not None and not self.tis_cap >= 1.0 + self.epsilon_high:
            # A smaller cap would truncate positive-advantage tokens inside the clip range,
            # silently replacing PPO's clip with the cap.
            raise ValueError(
                f"tis_cap must be None (off) or >= 1 + epsilon_high = {1.0 + self.epsilon_high}, got {self.tis_cap}"
            )
        if self.normalization not in get_args(Normalization):
            raise ValueError(f"normalization must be one of {get_args(Normalization)}, got {self.normalization!r}")
        if self.max_completion_tokens is not None:
            if self.normalization != "dr_grpo":
                raise ValueError(
                    "max_completion_tokens only applies to normalization='dr_grpo', "
                    f"got normalization={self.normalization!r}"
                )
            if self.max_completion_tokens < 1:
                raise ValueError(f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}")
        if not self.beta >= 0.0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.policy not in get_args(PolicyLoss):
            raise ValueError(f"policy must be one of {get_args(PolicyLoss)}, got {self.policy!r}")

    def check_totals(self, totals: BatchTotals) -> None:
        """dr_grpo's constant denominator must bound every trajectory's trained tokens (reads the counts: once a
        batch)."""
        if self.normalization == "dr_grpo" and self.max_completion_tokens is not None:
            longest = int(totals.tokens_per_trajectory.max()) if totals.tokens_per_trajectory.numel() else 0
            if longest > self.max_completion_tokens:
                raise ValueError(
                    f"a trajectory has {longest} masked tokens > max_completion_tokens = "
                    f"{self.max_completion_tokens}; dr_grpo's denominator must bound every trajectory"
                )


@dataclass(frozen=True, eq=False)  # eq=False: tensors don't compare to a bool
class LossResult:
    """The loss and its figures, each a 0-dim tensor on the loss's device: reading one (`float()`) waits for the
    device, so a training loop adds them up as tensors and reads them once per step."""

    loss: Tensor  # differentiable w.r.t. new_logprobs; policy_loss + beta * kl
    policy_loss: Tensor  # the clipped surrogate part, normalized like the loss (detached, as the rest)
    kl: Tensor | None  # k3 estimate of KL(pi || ref), normalized like the loss; None without ref_logprobs
    clipped_tokens: Tensor  # masked tokens where the clip bound was the active term
    ratio_sum: Tensor  # sum of exp(new - sampled) over masked tokens
    num_tokens: Tensor  # masked (trained) tokens
    num_trajectories: Tensor  # trajectories with at least one masked token

    @property
    def clip_fraction(self) -> Tensor:
        """The fraction of masked tokens where the clip bound was active (0 without any)."""
        return self.clipped_tokens / self.num_tokens.clamp(min=1)

    @property
    def ratio_mean(self) -> Tensor:
        """The mean importance ratio over masked tokens (1 without any)."""
        return torch.where(self.num_tokens > 0, self.ratio_sum / self.num_tokens.clamp(min=1), 1.0)


# -----------------------------------------------------------------------------
# advantages


def compute_advantages(
    rewards: Tensor,
    group_index: Tensor,
    scale: AdvantageScale = "group",
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages, (G,) -> (G,).

    Each reward minus the mean reward of its group (trajectories answering the same prompt),
    then "group": divided by the group's population std (GRPO); "batch": by the population std
    of all rewards in the batch (steadier with small groups); "none": not scaled (Dr. GRPO).
    A group whose rewards are all equal carries no signal and gets exactly 0.
    """
    if rewards.ndim != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a 1-D float tensor, got {rewards.dtype} {tuple(rewards.shape)}")
    if group_index.shape != rewards.shape or group_index.dtype != torch.long:
        raise ValueError(
            f"group_index must be a long tensor shaped like rewards {tuple(rewards.shape)}, "
            f"got {group_index.dtype} {tuple(group_index.shape)}"
        )
    if scale not in get_args(AdvantageScale):
        raise ValueError(f"scale must be one of {get_args(AdvantageScale)}, got {scale!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    rewards = rewards.detach()  # advantages are constants of the loss
    if rewards.numel() == 0:
        return rewards.clone()
    if int(group_index.min()) < 0:
        raise ValueError("group_index must be >= 0")

    num_groups = int(group_index.max()) + 1
    zeros = rewards.new_zeros(num_groups)
    count = zeros.index_add(0, group_index, torch.ones_like(rewards)).clamp(min=1)  # (num_groups,)
    mean = zeros.index_add(0, group_index, rewards) / count  # (num_groups,)
    centred = rewards - mean[group_index]  # (G,)
    if scale == "group":
        std = (zeros.index_add(0, group_index, centred.square()) / count).sqrt()  # (num_groups,)
        advantages = centred / (std[group_index] + eps)
    elif scale == "batch":
        advantages = centred / (rewards.std(correction=0) + eps)
    else:
        advantages = centred
    # Rounding leaves e.g. 0.9 - mean(0.9, 0.9, 0.9) = 6e-8 in float32, which dividing by a ~0 std
    # would blow up into a real-looking advantage; an equal-reward group must give exactly 0.
    group_max = zeros.scatter_reduce(0, group_index, rewards, reduce="amax", include_self=False)
    group_min = zeros.scatter_reduce(0, group_index, rewards, reduce="amin", include_self=False)
    flat = (group_max == group_min)[group_index]  # (G,)
    return torch.where(flat, torch.zeros_like(advantages), advantages)


# -----------------------------------------------------------------------------
# loss


@dataclass(frozen=True, eq=False)  # eq=False: tensors don't compare to a bool
class BatchTotals:
    """What the normalizations average over, counted once over the whole step's batch.

    Given to every micro-batch's loss, they make the micro-batch losses (and gradients) add up to the
    loss of the whole batch at once, whatever rows land in which micro-batch or process.
    """

    tokens_per_trajectory: Tensor  # (N,) trained tokens of each trajectory, all rows
    sequence_log_ratio: Tensor | None = None  # (N,) gspo: mean log(new / sampled) of each trajectory, all rows


def batch_totals(
    token_trajectory: Tensor, mask: Tensor, num_trajectories: int, sequence_log_ratio: Tensor | None = None
) -> BatchTotals:
    """The BatchTotals of a batch: token_trajectory and mask (B, T) as for grpo_loss, over *all* its rows.

    Also checks the trajectory index of every masked token (a read of the values: on an accelerator, a wait for
    the device), once for the batch: grpo_loss given these totals trusts its rows' indices.
    """
    _check_trajectory_index(token_trajectory, mask, num_trajectories)
    traj = torch.where(mask, token_trajectory, 0)
    counts = torch.zeros(num_trajectories, dtype=torch.float64, device=mask.device)
    counts = counts.index_add(0, traj.flatten(), mask.flatten().to(torch.float64))
    return BatchTotals(tokens_per_trajectory=counts, sequence_log_ratio=sequence_log_ratio)


def grpo_loss(
    new_logprobs: Tensor,
    sampled_logprobs: Tensor,
    token_trajectory: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: LossConfig,
    ref_logprobs: Tensor | None = None,
    totals: BatchTotals | None = None,
) -> LossResult:
    """The GRPO objective over a packed batch (or one micro-batch of it), with config.policy's surrogate.

    new_logprobs (B, T): log pi(token) under the policy being trained (carries grad).
    sampled_logprobs (B, T): the logprob the inference engine reported when it sampled the token.
    token_trajectory (B, T) long: index into `advantages` of each token's trajectory (ignored off the mask).
    advantages (N,): one per trajectory, e.g. from compute_advantages.
    mask (B, T) bool: True on sampled completion tokens that are trained.
    ref_logprobs (B, T): reference-policy logprobs; required when config.beta > 0.
    totals: the whole batch's BatchTotals when these rows are a part of it (None: these rows are all of it).
        The losses of a batch's parts, each with the batch's totals, sum to the loss of the batch. The checks
        that read values (trajectory indices, dr_grpo's bound) are made where the totals are counted
        (batch_totals, LossConfig.check_totals): nothing here waits for the device.
    """
    _check_inputs(new_logprobs, sampled_logprobs, token_trajectory, advantages, mask, ref_logprobs)
    if config.beta > 0 and ref_logprobs is None:
        raise ValueError(f"config.beta = {config.beta} > 0 needs ref_logprobs")
    n = advantages.shape[0]
    if totals is not None and tuple(totals.tokens_per_trajectory.shape) != (n,):
        raise ValueError(f"totals must count {n} trajectories, got {tuple(totals.tokens_per_trajectory.shape)}")
    whole = totals is None
    if totals is None:  # these rows are the whole batch: counted (and their indices checked) before they index anything
        totals = batch_totals(token_trajectory, mask, n)
        config.check_totals(totals)

    # Upcast: exp() of a bf16 log-ratio is too coarse for a clip window of +-0.2.
    dtype = torch.promote_types(new_logprobs.dtype, torch.float32)
    new = new_logprobs.to(dtype)  # (B, T)
    # Off the mask, replace values before exp() so padding garbage (-inf, NaN) can't reach the
    # loss or its gradient (torch.where sends a zero gradient to the branch it didn't pick).
    log_ratio = torch.where(mask, new - sampled_logprobs.detach().to(dtype), 0.0)  # (B, T)
    traj = torch.where(mask, token_trajectory, 0)  # (B, T), any valid index off the mask
    adv = advantages.detach().to(dtype)[traj]  # (B, T)
    if whole and config.policy == "gspo":  # the whole batch's sequence ratios, from these rows
        totals = dataclasses.replace(totals, sequence_log_ratio=_trajectory_mean(log_ratio.detach(), mask, traj, n))
    tokens_per_traj = totals.tokens_per_trajectory.to(dtype)  # (N,)

    token_loss, ratio, clip_active = _surrogate(new, log_ratio, adv, traj, mask, config, totals)
    policy_loss = _normalize(token_loss, mask, traj, tokens_per_traj, config)
    loss = policy_loss
    kl = None
    if ref_logprobs is not None:
        ref_minus_new = torch.where(mask, ref_logprobs.detach().to(dtype) - new, 0.0)  # (B, T)
        # k3 = r - log r - 1 with r = pi_ref / pi: unbiased for KL(pi || ref) and always >= 0.
        k3 = ref_minus_new.exp() - ref_minus_new - 1.0  # (B, T)
        kl = _normalize(k3, mask, traj, tokens_per_traj, config)
        if config.beta > 0:
            loss = policy_loss + config.beta * kl

    with torch.no_grad():
        here = torch.zeros_like(tokens_per_traj).index_add(0, traj.flatten(), mask.flatten().to(dtype))
        return LossResult(
            loss=loss,
            policy_loss=policy_loss.detach(),
            kl=None if kl is None else kl.detach(),
            clipped_tokens=(clip_active & mask).sum(),
            ratio_sum=torch.where(mask, ratio.detach(), 0.0).sum(),
            num_tokens=mask.sum(),
            num_trajectories=(here > 0).sum(),
        )


def _surrogate(
    new: Tensor, log_ratio: Tensor, adv: Tensor, traj: Tensor, mask: Tensor, config: LossConfig, totals: BatchTotals
) -> tuple[Tensor, Tensor, Tensor]:
    """(per-token loss to minimize, per-token importance ratio, where the clip was active), each (B, T).

    "ppo": -min(r A, clip(r) A) on the token ratio r = pi / pi_sampled, with the unclipped r capped (TIS).
    "cispo": -sg(clip(r)) A log pi: the clipped ratio is a stop-gradient weight, so a clipped token still
        gets a gradient, only a bounded one (MiniMax-M1's CISPO; ART's default loss).
    "gspo": the PPO form on the sequence ratio s = exp(mean log r over the trajectory), clipped per
        trajectory (GSPO). Written per token as s_t = sg(s) pi / sg(pi): its value is s and its gradient
        s grad log pi, the sequence gradient shared out over the tokens, so micro-batches add up.
    """
    ratio = log_ratio.exp()  # (B, T)
    low, high = 1.0 - config.epsilon_low, 1.0 + config.epsilon_high
    if config.policy == "cispo":
        weight = ratio.detach().clamp(low, high)
        clip_active = (ratio < low) | (ratio > high)
        return -(weight * adv * torch.where(mask, new, 0.0)), ratio, clip_active
    if config.policy == "gspo":
        assert totals.sequence_log_ratio is not None, "gspo needs each trajectory's mean log ratio"
        sequence = totals.sequence_log_ratio.detach().to(new.dtype).exp()[traj]  # (B, T)
        ratio = sequence * (log_ratio - log_ratio.detach()).exp()  # value: the sequence ratio
    # TIS: bound the unclipped ratio so a token the sampler found far less likely than the
    # policy does (r >> 1, e.g. engine/trainer numerics mismatch) can't dominate a
    # negative-advantage update, where PPO's min() would otherwise pick r * A unbounded.
    capped = ratio if config.tis_cap is None else ratio.clamp(max=config.tis_cap)
    clipped = ratio.clamp(low, high)
    unclipped_term = capped * adv  # (B, T)
    clipped_term = clipped * adv  # (B, T)
    clip_active = clipped_term < unclipped_term  # the clip bound was picked
    return -torch.minimum(unclipped_term, clipped_term), ratio, clip_active


def _trajectory_mean(values: Tensor, mask: Tensor, traj: Tensor, n: int) -> Tensor:
    """(B, T) -> (N,): the mean of `values` over each trajectory's masked tokens (0 for one without)."""
    sums = values.new_zeros(n).index_add(0, traj.flatten(), torch.where(mask, values, 0.0).flatten())
    counts = values.new_zeros(n).index_add(0, traj.flatten(), mask.flatten().to(values.dtype))
    return sums / counts.clamp(min=1)


def trajectory_log_ratio_sums(
    new_logprobs: Tensor, sampled_logprobs: Tensor, token_trajectory: Tensor, mask: Tensor, n: int
) -> Tensor:
    """(N,) float64: each trajectory's sum of log(new / sampled) over these rows' masked tokens.

    Summed over a batch's parts (micro-batches, processes) and divided by BatchTotals.tokens_per_trajectory,
    this is gspo's sequence_log_ratio.
    """
    traj = torch.where(mask, token_trajectory, 0)
    log_ratio = torch.where(mask, new_logprobs.detach().double() - sampled_logprobs.double(), 0.0)
    return log_ratio.new_zeros(n).index_add(0, traj.flatten(), log_ratio.flatten())


def _normalize(token_values: Tensor, mask: Tensor, traj: Tensor, tokens_per_traj: Tensor, config: LossConfig) -> Tensor:
    """Reduce per-token values (B, T) over masked tokens to a scalar.

    "grpo": mean within each trajectory, then mean over trajectories (every trajectory weighs
    the same, so long ones are down-weighted per token). "dapo": mean over all tokens (every
    token weighs the same). "dr_grpo": sum / (num trajectories * a constant length), which
    removes GRPO's length bias without making the step size depend on the batch's lengths.
    Trajectories without masked tokens don't count. `tokens_per_traj` counts the whole batch, so
    this is the part of the batch's value these rows contribute. With no masked tokens this is 0.0
    that is still connected to the graph, so backward() works and gives zero gradients.
    """
    values = torch.where(mask, token_values, 0.0)  # (B, T)
    num_traj = (tokens_per_traj > 0).sum().clamp(min=1)
    if config.normalization == "grpo":
        per_traj = values.new_zeros(tokens_per_traj.shape).index_add(0, traj.flatten(), values.flatten())
        return (per_traj / tokens_per_traj.clamp(min=1)).sum() / num_traj
    total = values.sum()
    if config.normalization == "dapo":
        return total / tokens_per_traj.sum().clamp(min=1)
    if config.max_completion_tokens is None:
        length = tokens_per_traj.max()
    else:
        length = values.new_tensor(float(config.max_completion_tokens))
    return total / (num_traj * length).clamp(min=1)


def _check_trajectory_index(token_trajectory: Tensor, mask: Tensor, n: int) -> None:
    trained = token_trajectory[mask]
    if trained.numel() > 0 and (int(trained.min()) < 0 or int(trained.max()) >= n):
        raise ValueError(
            f"token_trajectory on masked tokens must be in [0, {n}), "
            f"got values in [{int(trained.min())}, {int(trained.max())}]"
        )


def _check_inputs(
    new_logprobs: Tensor,
    sampled_logprobs: Tensor,
    token_trajectory: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logprobs: Tensor | None,
) -> None:
    if new_logprobs.ndim != 2 or not new_logprobs.is_floating_point():
        raise ValueError(
            f"new_logprobs must be a (B, T) float tensor, got {new_logprobs.dtype} {tuple(new_logprobs.shape)}"
        )
    shape = tuple(new_logprobs.shape)
    same_shape = {
        "sampled_logprobs": sampled_logprobs,
        "token_trajectory": token_trajectory,
        "mask": mask,
        "ref_logprobs": ref_logprobs,
    }
    for name, tensor in same_shape.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have new_logprobs' shape {shape}, got {tuple(tensor.shape)}")
    for name, tensor in (("sampled_logprobs", sampled_logprobs), ("ref_logprobs", ref_logprobs)):
        if tensor is not None and not tensor.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got {tensor.dtype}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
    if token_trajectory.dtype != torch.long:
        raise ValueError(f"token_trajectory must be a long tensor, got {token_trajectory.dtype}")
    if advantages.ndim != 1 or advantages.numel() == 0 or not advantages.is_floating_point():
        raise ValueError(
            f"advantages must be a non-empty 1-D float tensor, got {advantages.dtype} {tuple(advantages.shape)}"
        )
