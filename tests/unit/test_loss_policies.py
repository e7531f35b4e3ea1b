"""CISPO and GSPO against hand-computed values, and exact accumulation: the losses and gradients of a batch's
parts, each given the whole batch's totals, add up to those of the batch at once, for every loss x normalization.
"""

import itertools
import math

import pytest
import torch

from trainer.loss import (
    LossConfig,
    batch_totals,
    compute_advantages,
    grpo_loss,
    trajectory_log_ratio_sums,
)

# One trajectory of two trained tokens: new probabilities 0.5 and 0.2, both sampled at 0.4,
# so the token ratios are 0.5 / 0.4 = 1.25 and 0.2 / 0.4 = 0.5. Clip window [0.8, 1.28].
NEW = [math.log(0.5), math.log(0.2)]
SAMPLED = [math.log(0.4), math.log(0.4)]


def _one_trajectory(policy: str, advantage: float, **config: object):
    new = torch.tensor([NEW], dtype=torch.float64, requires_grad=True)
    result = grpo_loss(
        new,
        torch.tensor([SAMPLED], dtype=torch.float64),
        torch.zeros(1, 2, dtype=torch.long),
        torch.tensor([advantage], dtype=torch.float64),
        torch.ones(1, 2, dtype=torch.bool),
        LossConfig(policy=policy, **config),  # type: ignore[arg-type]
    )
    result.loss.backward()
    assert new.grad is not None
    return result, new.grad[0].tolist()


def test_cispo_hand_values() -> None:
    # Weights sg(clip(r)) = [1.25, 0.8]: the second ratio 0.5 is clipped up to 0.8 but, unlike PPO, still
    # carries a gradient. Loss = -(1.25 * log 0.5 + 0.8 * log 0.2) / 2 = -(-0.866434 - 1.287550) / 2.
    result, grad = _one_trajectory("cispo", 1.0)
    assert float(result.loss.detach()) == pytest.approx(1.076992, abs=1e-6)
    assert grad == pytest.approx([-1.25 / 2, -0.8 / 2])  # -w A / 2 tokens
    assert result.clip_fraction == pytest.approx(0.5)
    assert result.ratio_mean == pytest.approx((1.25 + 0.5) / 2)


def test_cispo_negative_advantage_is_bounded_by_the_clip() -> None:
    # A = -1: gradient +w / 2; the 1.25 weight is inside the window, 0.5 clipped to 0.8.
    result, grad = _one_trajectory("cispo", -1.0)
    assert float(result.loss.detach()) == pytest.approx(-1.076992, abs=1e-6)
    assert grad == pytest.approx([1.25 / 2, 0.8 / 2])


def test_gspo_hand_values_unclipped() -> None:
    # Sequence ratio s = exp((log 1.25 + log 0.5) / 2) = sqrt(0.625) = 0.790569; A = +1 takes
    # min(s, clip(s) = 0.8) = s, unclipped. Per-token loss -s, grpo mean -s. Gradient of -s w.r.t. each
    # new logprob: -s / 2 (the mean's derivative).
    result, grad = _one_trajectory("gspo", 1.0)
    s = math.sqrt(0.625)
    assert float(result.loss.detach()) == pytest.approx(-s, abs=1e-9)
    assert grad == pytest.approx([-s / 2, -s / 2])
    assert result.clip_fraction == 0.0
    assert result.ratio_mean == pytest.approx(s)  # every token reports its sequence's ratio


def test_gspo_clips_the_whole_sequence() -> None:
    # A = -1: min(-s, -clip(s)) = min(-0.790569, -0.8) = -0.8: the clip bound is picked for the whole
    # trajectory, so the loss is 0.8 and no token gets a gradient.
    result, grad = _one_trajectory("gspo", -1.0)
    assert float(result.loss.detach()) == pytest.approx(0.8)
    assert grad == [0.0, 0.0]
    assert result.clip_fraction == 1.0


def test_gspo_ratio_differs_from_token_ratios() -> None:
    # The same tokens under PPO: min(1.25, 1.25) and min(0.5, 0.8) = 0.5 -> loss -(1.25 + 0.5) / 2.
    result, _ = _one_trajectory("ppo", 1.0)
    assert float(result.loss.detach()) == pytest.approx(-0.875)


@pytest.mark.parametrize("policy", ["cispo", "gspo"])
def test_all_zero_mask_gives_zero_loss_and_zero_gradient(policy: str) -> None:
    new = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    result = grpo_loss(
        new,
        torch.tensor([[-1.0, float("nan")]]),
        torch.full((1, 2), -1, dtype=torch.long),
        torch.tensor([1.0]),
        torch.zeros(1, 2, dtype=torch.bool),
        LossConfig(policy=policy),  # type: ignore[arg-type]
    )
    result.loss.backward()
    assert float(result.loss.detach()) == 0.0 and result.num_tokens == 0 and result.num_trajectories == 0
    assert new.grad is not None and torch.equal(new.grad, torch.zeros(1, 2))


@pytest.mark.parametrize("policy", ["ppo", "cispo", "gspo"])
def test_zero_variance_group_gives_no_gradient(policy: str) -> None:
    # Two trajectories of one group with equal rewards: advantage exactly 0, so no gradient whatever the ratios.
    advantages = compute_advantages(torch.tensor([0.7, 0.7]), torch.tensor([0, 0]))
    assert advantages.tolist() == [0.0, 0.0]
    new = torch.tensor([[-0.3, -2.0, -0.9]], requires_grad=True)
    result = grpo_loss(
        new,
        torch.tensor([[-0.5, -1.0, -0.1]]),
        torch.tensor([[0, 0, 1]]),
        advantages,
        torch.ones(1, 3, dtype=torch.bool),
        LossConfig(policy=policy),  # type: ignore[arg-type]
    )
    result.loss.backward()
    assert new.grad is not None and torch.equal(new.grad, torch.zeros(1, 3))


def test_config_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="policy must be one of"):
        LossConfig(policy="reinforce")  # type: ignore[arg-type]


# -----------------------------------------------------------------------------
# exact accumulation


def _batch(seed: int):
    """Six rows of 9 positions holding 5 trajectories, two of which span several rows, with masked gaps."""
    g = torch.Generator().manual_seed(seed)
    rows, width, n = 6, 9, 5
    trajectory = torch.tensor(
        [
            [0, 0, 0, 0, 1, 1, 1, 1, 1],
            [0, 0, 0, 2, 2, 2, 2, 2, 2],
            [3, 3, 3, 3, 3, 3, 1, 1, 1],
            [4, 4, 4, 4, 4, 4, 4, 4, 4],
            [0, 0, 1, 1, 1, 1, 3, 3, 3],
            [2, 2, 2, 2, 4, 4, 4, 4, 4],
        ]
    )
    mask = torch.rand(rows, width, generator=g) > 0.25
    token_trajectory = torch.where(mask, trajectory, -1)
    sampled = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    # New logprobs within +-0.5 of the sampled ones: some ratios inside the clip window, some outside.
    new = sampled + (torch.rand(rows, width, generator=g, dtype=torch.float64) - 0.5)
    ref = sampled + (torch.rand(rows, width, generator=g, dtype=torch.float64) - 0.5) * 0.2
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    return new, sampled, token_trajectory, advantages, mask, ref


CASES = list(
    itertools.product(
        ["ppo", "cispo", "gspo"],
        [
            {"normalization": "grpo"},
            {"normalization": "dapo"},
            {"normalization": "dr_grpo"},
            {"normalization": "dr_grpo", "max_completion_tokens": 20},
        ],
        [0.0, 0.1],
    )
)


@pytest.mark.parametrize(("policy", "normalization", "beta"), CASES)
@pytest.mark.parametrize("parts", [[[0], [1], [2], [3], [4], [5]], [[0, 3], [1, 4, 5], [2]], [[5, 1, 2, 3], [0, 4]]])
def test_parts_add_up_to_the_whole_batch(policy: str, normalization: dict, beta: float, parts: list) -> None:
    new, sampled, token_trajectory, advantages, mask, ref = _batch(seed=len(parts))
    config = LossConfig(policy=policy, beta=beta, **normalization)  # type: ignore[arg-type]
    n = advantages.shape[0]

    whole_new = new.clone().requires_grad_(True)
    whole = grpo_loss(whole_new, sampled, token_trajectory, advantages, mask, config, ref_logprobs=ref)
    whole.loss.backward()

    # The totals, as the trainer builds them: token counts from the masks, gspo's log ratios summed over the parts.
    log_ratio_sums = sum(
        trajectory_log_ratio_sums(new[rows], sampled[rows], token_trajectory[rows], mask[rows], n) for rows in parts
    )
    counts = batch_totals(token_trajectory, mask, n).tokens_per_trajectory
    totals = batch_totals(token_trajectory, mask, n, sequence_log_ratio=log_ratio_sums / counts.clamp(min=1))
    part_new = new.clone().requires_grad_(True)
    loss_sum, policy_sum, kl_sum = 0.0, 0.0, 0.0
    for rows in parts:
        part = grpo_loss(
            part_new[rows], sampled[rows], token_trajectory[rows], advantages, mask[rows], config,
            ref_logprobs=ref[rows], totals=totals,
        )  # fmt: skip
        part.loss.backward()
        loss_sum += float(part.loss.detach())
        policy_sum += part.policy_loss
        kl_sum += part.kl or 0.0

    assert loss_sum == pytest.approx(float(whole.loss), abs=1e-6)
    assert policy_sum == pytest.approx(whole.policy_loss, abs=1e-6)
    assert kl_sum == pytest.approx(whole.kl, abs=1e-6)
    assert whole_new.grad is not None and part_new.grad is not None
    assert whole_new.grad.abs().sum() > 0  # the case trains something
    torch.testing.assert_close(part_new.grad, whole_new.grad, rtol=0, atol=1e-6)


def test_parts_without_totals_do_not_add_up() -> None:
    # The bug this guards against: each part normalized by its own counts. Trajectory 0 spans rows 0, 1 and 4.
    new, sampled, token_trajectory, advantages, mask, _ = _batch(seed=1)
    config = LossConfig()
    whole = grpo_loss(new, sampled, token_trajectory, advantages, mask, config)
    parts = sum(
        float(grpo_loss(new[[r]], sampled[[r]], token_trajectory[[r]], advantages, mask[[r]], config).loss)
        for r in range(6)
    )
    assert abs(parts - float(whole.loss)) > 1e-3
