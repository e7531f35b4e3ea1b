"""trainer.loss against values worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from trainer.loss import LossConfig, compute_advantages, grpo_loss

NEG_INF = float("-inf")
NAN = float("nan")


def _close(actual: float | None, expected: float) -> None:
    assert actual is not None
    assert actual == pytest.approx(expected, abs=1e-6)


# -----------------------------------------------------------------------------
# compute_advantages

# Three groups, interleaved to exercise the indexing:
#   group 0: rewards 1, 1, 3, 3 -> mean 2, centred -1, -1, 1, 1, population std 1
#   group 1: rewards 0, 0       -> all equal, advantage 0
#   group 2: rewards 4, 8       -> mean 6, centred -2, 2, population std 2
# Whole batch: mean 20/8 = 2.5, squared deviations 2.25+0.25+6.25+2.25+0.25+30.25+6.25+2.25 = 50,
# population std sqrt(50/8) = 2.5.
REWARDS = [1.0, 4.0, 0.0, 1.0, 3.0, 8.0, 0.0, 3.0]
GROUPS = [0, 2, 1, 0, 0, 2, 1, 0]


@pytest.mark.parametrize(
    ("scale", "expected"),
    [
        ("none", [-1.0, -2.0, 0.0, -1.0, 1.0, 2.0, 0.0, 1.0]),
        # centred / group std (1 for group 0, 2 for group 2)
        ("group", [-1.0, -1.0, 0.0, -1.0, 1.0, 1.0, 0.0, 1.0]),
        # centred by the *group* mean, divided by the batch std 2.5; centring by the batch
        # mean 2.5 instead would give e.g. (1 - 2.5) / 2.5 = -0.6 for the first entry.
        ("batch", [-0.4, -0.8, 0.0, -0.4, 0.4, 0.8, 0.0, 0.4]),
    ],
)
def test_advantages_for_each_scale(scale: str, expected: list[float]) -> None:
    advantages = compute_advantages(torch.tensor(REWARDS), torch.tensor(GROUPS), scale=scale)  # type: ignore[arg-type]
    torch.testing.assert_close(advantages, torch.tensor(expected), atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_group_gives_exact_zeros(scale: str) -> None:
    # In float32, 0.9 - (0.9 + 0.9 + 0.9) / 3 = 6e-8, not 0; divided by (std ~ 0) + 1e-6 that
    # would become a spurious advantage of ~0.06.
    rewards = torch.tensor([0.9, 0.9, 0.9, 0.0, 1.0])
    advantages = compute_advantages(rewards, torch.tensor([0, 0, 0, 1, 1]), scale=scale)  # type: ignore[arg-type]
    assert torch.equal(advantages[:3], torch.zeros(3))
    assert advantages[3] < 0 < advantages[4]


def test_all_equal_batch_with_zero_eps_is_zero_not_nan() -> None:
    advantages = compute_advantages(torch.tensor([2.0, 2.0]), torch.tensor([0, 0]), scale="batch", eps=0.0)
    assert torch.equal(advantages, torch.zeros(2))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scale": "std"},
        {"eps": -1.0},
        {"group_index": torch.tensor([0.0, 1.0])},  # not long
        {"group_index": torch.tensor([0, 1, 1])},  # wrong length
        {"group_index": torch.tensor([0, -1])},
    ],
)
def test_advantages_reject_bad_input(kwargs: dict) -> None:
    args = {"rewards": torch.tensor([1.0, 2.0]), "group_index": torch.tensor([0, 1])} | kwargs
    with pytest.raises(ValueError):
        compute_advantages(**args)


# -----------------------------------------------------------------------------
# LossConfig


@pytest.mark.parametrize(
    "kwargs",
    [
        {"epsilon_low": 1.0},
        {"epsilon_low": -0.1},
        {"epsilon_high": -0.1},
        {"tis_cap": 1.1},  # below 1 + epsilon_high = 1.28
        {"normalization": "mean"},
        {"normalization": "dr_grpo", "max_completion_tokens": 0},
        {"max_completion_tokens": 10},  # only meaningful for dr_grpo
        {"beta": -0.1},
        {"beta": NAN},
    ],
)
def test_config_rejects_out_of_range_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LossConfig(**kwargs)


def test_config_accepts_boundary_values() -> None:
    LossConfig(epsilon_low=0.0, epsilon_high=0.0, tis_cap=1.0)
    LossConfig(tis_cap=None, normalization="dr_grpo", max_completion_tokens=1, beta=0.0)


# -----------------------------------------------------------------------------
# grpo_loss: a packed batch
#
#   row 0: [prompt, traj0, traj0, prompt, traj1]
#   row 1: [traj0 (its second turn), prompt of traj2, prompt of traj2, pad, pad]
#
# Trajectory 0 spans both rows with 3 trained tokens, trajectory 1 has 1, trajectory 2 has
# none (its advantage 5 must not count anywhere). Off the mask, sampled logprobs are -inf and
# new logprobs NaN, so anything that leaks from there shows up as inf/NaN.
ADVANTAGES = [1.0, -2.0, 5.0]
MASK = [[False, True, True, False, True], [True, False, False, False, False]]
TRAJECTORY = [[-1, 0, 0, -1, 1], [0, 2, 2, -1, -1]]


def _packed(ratios: list[list[float]], **config: object) -> tuple[torch.Tensor, object]:
    """(new_logprobs leaf, result) for per-token ratios (ignored off the mask)."""
    mask = torch.tensor(MASK)
    sampled = torch.full((2, 5), -1.5)
    new = sampled + torch.tensor(ratios).log()
    new = torch.where(mask, new, NAN).requires_grad_()
    sampled = torch.where(mask, sampled, NEG_INF)
    result = grpo_loss(new, sampled, torch.tensor(TRAJECTORY), torch.tensor(ADVANTAGES), mask, LossConfig(**config))
    return new, result


# Ratios inside the clip window [0.8, 1.28]: traj0 has 1.2, 0.9 (row 0) and 1.0 (row 1), traj1 1.1.
RATIOS = [[1.0, 1.2, 0.9, 1.0, 1.1], [1.0, 1.0, 1.0, 1.0, 1.0]]


def test_ratio_one_gives_minus_mean_advantage() -> None:
    # Token loss is -A: traj0 mean -1, traj1 mean 2 -> (-1 + 2) / 2 = 0.5, i.e. -mean(A) over the
    # trajectories with tokens. (Counting traj2 would give -(1 - 2 + 5) / 3.)
    _, result = _packed([[1.0] * 5] * 2)
    _close(result.loss.item(), 0.5)
    _close(result.ratio_mean, 1.0)
    assert result.clip_fraction == 0.0
    assert result.kl is None
    # dapo over tokens instead: -(1 + 1 + 1 - 2) / 4 = -0.25
    _, result = _packed([[1.0] * 5] * 2, normalization="dapo")
    _close(result.loss.item(), -0.25)


# Token losses -r * A: traj0 -1.2, -0.9, -1.0 (sum -3.1), traj1 -(1.1 * -2) = 2.2. Total -0.9.
@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # mean per trajectory, then over trajectories: (-3.1 / 3 + 2.2) / 2 = (-31 + 66) / 60 = 7/12
        ({"normalization": "grpo"}, 7 / 12),
        # over tokens: -0.9 / 4
        ({"normalization": "dapo"}, -0.225),
        # 2 trajectories * longest (traj0, 3 tokens): -0.9 / 6
        ({"normalization": "dr_grpo"}, -0.15),
        # 2 trajectories * 10: -0.9 / 20
        ({"normalization": "dr_grpo", "max_completion_tokens": 10}, -0.045),
    ],
)
def test_normalizations_on_packed_batch(config: dict, expected: float) -> None:
    new, result = _packed(RATIOS, **config)
    _close(result.loss.item(), expected)
    _close(result.policy_loss, expected)
    _close(result.ratio_mean, (1.2 + 0.9 + 1.0 + 1.1) / 4)
    assert result.clip_fraction == 0.0
    assert result.num_tokens == 4
    assert result.num_trajectories == 2
    result.loss.backward()
    assert new.grad is not None and torch.isfinite(new.grad).all()


def test_grpo_gradient_weights_each_trajectory_equally() -> None:
    # d(-r A / (n_traj_tokens * n_trajectories)) / d new = -A r / (n_traj_tokens * 2), as dr/dnew = r:
    # traj0 (3 tokens, A 1): -1.2/6, -0.9/6, -1.0/6; traj1 (1 token, A -2): 2 * 1.1 / 2 = 1.1.
    new, result = _packed(RATIOS)
    result.loss.backward()
    expected = torch.tensor([[0.0, -0.2, -0.15, 0.0, 1.1], [-1 / 6, 0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(new.grad, expected)


def test_dr_grpo_rejects_trajectory_longer_than_max_completion_tokens() -> None:
    with pytest.raises(ValueError, match="max_completion_tokens"):
        _packed(RATIOS, normalization="dr_grpo", max_completion_tokens=2)  # traj0 has 3


# -----------------------------------------------------------------------------
# grpo_loss: clipping and truncated importance sampling


def _per_token(ratios: list[float], advantages: list[float], config: LossConfig) -> tuple[torch.Tensor, object]:
    """One row, each token its own trajectory, so grpo's loss is the plain mean over tokens."""
    n = len(ratios)
    sampled = torch.full((1, n), -2.0)
    new = (sampled + torch.tensor([ratios]).log()).requires_grad_()
    result = grpo_loss(
        new,
        sampled,
        torch.arange(n).unsqueeze(0),
        torch.tensor(advantages),
        torch.ones(1, n, dtype=torch.bool),
        config,
    )
    return new, result


def test_clipping_high_and_low() -> None:
    # token  A   r     unclipped  clipped (to [0.8, 1.28])  min     loss   clip active
    # t0    +1  1.5    1.5        1.28                      1.28   -1.28   yes
    # t1    -1  0.5   -0.5       -0.8                      -0.8     0.8    yes
    # t2    +1  0.5    0.5        0.8                       0.5    -0.5    no (r*A is lower)
    # t3    -1  1.7   -1.7       -1.28                     -1.7     1.7    no
    # t4    +1  1.25   1.25       1.25                      1.25   -1.25   no (inside clip-higher)
    # loss (-1.28 + 0.8 - 0.5 + 1.7 - 1.25) / 5 = -0.53 / 5
    ratios, advantages = [1.5, 0.5, 0.5, 1.7, 1.25], [1.0, -1.0, 1.0, -1.0, 1.0]
    new, result = _per_token(ratios, advantages, LossConfig())
    _close(result.loss.item(), -0.106)
    _close(result.clip_fraction, 2 / 5)
    _close(result.ratio_mean, (1.5 + 0.5 + 0.5 + 1.7 + 1.25) / 5)
    # Clipped tokens get no gradient; the others -A r / 5.
    result.loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 0.0, -0.1, 0.34, -0.25]]))

    # With a symmetric 0.2, t4 is clipped to 1.2 and t0 to 1.2 as well:
    # (-1.2 + 0.8 - 0.5 + 1.7 - 1.2) / 5 = -0.4 / 5
    _, result = _per_token(ratios, advantages, LossConfig(epsilon_high=0.2, tis_cap=2.0))
    _close(result.loss.item(), -0.08)
    _close(result.clip_fraction, 3 / 5)


def test_tis_cap_bounds_negative_advantage_huge_ratio() -> None:
    # A = -1, r = 10: PPO's min picks the unclipped r * A; the cap makes it min(10, 2) * -1 = -2
    # (the clipped term is -1.28, larger), so the loss is 2 instead of 10 and the capped token
    # gets no gradient. It isn't the clip bound that acts, so clip_fraction stays 0.
    new, result = _per_token([10.0], [-1.0], LossConfig(tis_cap=2.0))
    _close(result.loss.item(), 2.0)
    assert result.clip_fraction == 0.0
    result.loss.backward()
    assert new.grad is not None and new.grad.item() == 0.0

    # Without the cap: loss -(10 * -1) = 10, gradient -A r = 10.
    new, result = _per_token([10.0], [-1.0], LossConfig(tis_cap=None))
    _close(result.loss.item(), 10.0)
    result.loss.backward()
    assert new.grad is not None
    assert new.grad.item() == pytest.approx(10.0, rel=1e-5)


def test_gradient_matches_analytic() -> None:
    # One trajectory, A = 2, r = 1.1, 0.9 (unclipped): loss = -(2 * 1.1 + 2 * 0.9) / 2 = -2,
    # d loss / d new_i = -A / n_tokens * r_i = -1.1, -0.9.
    sampled = torch.full((1, 2), -2.0)
    new = (sampled + torch.tensor([[1.1, 0.9]]).log()).requires_grad_()
    trajectory, mask = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)
    result = grpo_loss(new, sampled, trajectory, torch.tensor([2.0]), mask, LossConfig())
    _close(result.loss.item(), -2.0)
    result.loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-1.1, -0.9]]))


# -----------------------------------------------------------------------------
# grpo_loss: KL term


def _kl_case(beta: float, with_ref: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    # One trajectory, A = 1, r = 1, ref - new = ln 2 and -ln 2:
    # k3 = e^d - d - 1 -> (2 - ln 2 - 1) + (1/2 + ln 2 - 1) = 0.5 over 2 tokens, kl = 0.25.
    new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    sampled = new.detach().clone().requires_grad_()
    ref = (new.detach() + torch.tensor([[math.log(2), -math.log(2)]])).requires_grad_()
    result = grpo_loss(
        new,
        sampled,
        torch.zeros(1, 2, dtype=torch.long),
        torch.tensor([1.0]),
        torch.ones(1, 2, dtype=torch.bool),
        LossConfig(beta=beta),
        ref_logprobs=ref if with_ref else None,
    )
    return new, sampled, ref, result


def test_kl_term() -> None:
    new, sampled, ref, result = _kl_case(beta=0.1)
    # policy -1 (ratio 1, A 1), loss -1 + 0.1 * 0.25
    _close(result.kl, 0.25)
    _close(result.policy_loss, -1.0)
    _close(result.loss.item(), -0.975)
    result.loss.backward()
    # d/dnew: policy -A r / 2 = -0.5; k3' = 1 - e^(ref - new) -> 1 - 2 = -1 and 1 - 1/2 = 0.5,
    # times beta / 2: -0.05 and 0.025.
    torch.testing.assert_close(new.grad, torch.tensor([[-0.55, -0.475]]))
    # sampled and ref are constants: detached inside.
    assert sampled.grad is None and ref.grad is None


def test_kl_is_reported_but_not_trained_when_beta_is_zero() -> None:
    _, _, _, result = _kl_case(beta=0.0)
    _close(result.kl, 0.25)
    _close(result.loss.item(), -1.0)


def test_beta_needs_ref_logprobs() -> None:
    with pytest.raises(ValueError, match="ref_logprobs"):
        _kl_case(beta=0.1, with_ref=False)


# -----------------------------------------------------------------------------
# grpo_loss: degenerate and bad input


@pytest.mark.parametrize("normalization", ["grpo", "dapo", "dr_grpo"])
def test_all_zero_mask(normalization: str) -> None:
    new = torch.tensor([[-1.0, NAN, -3.0]], requires_grad=True)
    sampled = torch.tensor([[NEG_INF, -1.0, -2.0]])
    result = grpo_loss(
        new,
        sampled,
        torch.full((1, 3), -1),
        torch.tensor([1.0]),
        torch.zeros(1, 3, dtype=torch.bool),
        LossConfig(normalization=normalization, beta=0.1),  # type: ignore[arg-type]
        ref_logprobs=torch.tensor([[0.0, NEG_INF, -1.0]]),
    )
    assert result.loss.item() == 0.0
    assert result.loss.grad_fn is not None
    assert (result.num_tokens, result.num_trajectories) == (0, 0)
    assert (result.clip_fraction, result.ratio_mean, result.kl) == (0.0, 1.0, 0.0)
    result.loss.backward()
    assert new.grad is not None and torch.equal(new.grad, torch.zeros(1, 3))


def _valid_inputs() -> dict:
    return {
        "new_logprobs": torch.zeros(1, 2),
        "sampled_logprobs": torch.zeros(1, 2),
        "token_trajectory": torch.zeros(1, 2, dtype=torch.long),
        "advantages": torch.tensor([1.0]),
        "mask": torch.ones(1, 2, dtype=torch.bool),
        "config": LossConfig(),
    }


def test_valid_inputs_are_accepted() -> None:
    _close(grpo_loss(**_valid_inputs()).loss.item(), -1.0)


@pytest.mark.parametrize(
    "override",
    [
        {"new_logprobs": torch.zeros(2)},
        {"sampled_logprobs": torch.zeros(1, 3)},
        {"mask": torch.ones(1, 2)},  # not bool
        {"token_trajectory": torch.zeros(1, 2)},  # not long
        {"token_trajectory": torch.tensor([[0, 1]])},  # 1 is out of range for one advantage
        {"token_trajectory": torch.tensor([[0, -1]])},  # -1 on a masked token
        {"advantages": torch.ones(1, 1)},
        {"ref_logprobs": torch.zeros(2, 2)},
    ],
)
def test_loss_rejects_bad_input(override: dict) -> None:
    with pytest.raises(ValueError):
        grpo_loss(**(_valid_inputs() | override))
