"""trainer.train.train_step on the tiny model: the update does not depend on how the batch is cut.

Trajectories of several sequences land in different rows and micro-batches; with the loss's normalizers
counted over the whole batch, `--micro-batch-rows` and `--pack-tokens-per-row` change neither the step's
metrics nor the adapter, for every loss x normalization. The model runs in float64 so that what is compared
is the arithmetic of the step, not float32 rounding (Adam's first step divides each gradient by its own
magnitude, which would amplify rounding in near-zero gradients).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from trainer.batch import TrainSequence
from trainer.config import TrainConfig
from trainer.data import StepData
from trainer.model import Policy, load_policy, make_optimizer
from trainer.step import split_micro_batches, train_step

DEVICE = torch.device("cpu")
LAYOUTS = [
    {"micro_batch_rows": 1, "pack_tokens_per_row": 24},  # a row per micro-batch, narrow rows
    {"micro_batch_rows": 3, "pack_tokens_per_row": 40},
    {"micro_batch_rows": 3, "pack_tokens_per_row": 12},  # longer sequences widen the rows: fewer rows per pass
    {"micro_batch_rows": 64, "pack_tokens_per_row": 512},  # the whole batch at once
]


def _step_data(vocab: int) -> StepData:
    """Six trajectories (three groups of two), each of one to three sequences of 6-20 tokens."""
    rng = random.Random(7)
    sequences = []
    for trajectory in range(6):
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
    rewards = [1.0, 0.0, 0.3, 0.9, 0.5, 0.2]
    return StepData(
        group_ids=["g0", "g1", "g2"],
        sequences=sequences,
        advantages=torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0]),
        rewards=rewards,
        zero_signal_groups=0,
        zero_advantage_trajectories=0,
        staleness=0,
    )


def _run(tiny_model: Path, data: StepData, **options: object):
    options = {"learning_rate": 1e-2, **options}
    config = TrainConfig(base_model=str(tiny_model), db="sqlite+aiosqlite:///unused", **options)
    torch.manual_seed(0)  # the same fresh LoRA every time
    model = load_policy(config, DEVICE, None).double()
    optimizer = make_optimizer(model, config)
    metrics = train_step(Policy.of(model, config, DEVICE), optimizer, data, config, DEVICE, pad_id=0)
    lora = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return metrics, lora


@pytest.mark.parametrize("loss", ["ppo", "cispo", "gspo"])
@pytest.mark.parametrize("normalization", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_and_packing_do_not_change_the_update(tiny_model: Path, loss: str, normalization: str) -> None:
    from transformers import AutoConfig

    data = _step_data(AutoConfig.from_pretrained(tiny_model).vocab_size)
    runs = [_run(tiny_model, data, loss_name=loss, normalization=normalization, **layout) for layout in LAYOUTS]
    (reference, reference_lora), others = runs[-1], runs[:-1]
    assert reference.rows < runs[0][0].rows  # the layouts really differ
    assert reference.grad_norm > 0 and reference.trainable_tokens > 0
    for metrics, lora in others:
        for name in ("loss", "policy_loss", "clip_fraction", "ratio_mean", "grad_norm"):
            assert getattr(metrics, name) == pytest.approx(getattr(reference, name), abs=1e-6), name
        assert metrics.trainable_tokens == reference.trainable_tokens
        for name, tensor in lora.items():
            torch.testing.assert_close(tensor, reference_lora[name], rtol=0, atol=1e-6, msg=name)
    untrained = _run(tiny_model, data, loss_name=loss, normalization=normalization, learning_rate=1e-12)[1]
    moved = max(float((untrained[name] - tensor).abs().max()) for name, tensor in reference_lora.items())
    assert moved > 1e-3  # the step really moves the adapter, far beyond the tolerance above


def test_the_update_depends_on_the_loss(tiny_model: Path) -> None:
    """The comparison above could pass if every loss did nothing: different losses must give different adapters."""
    from transformers import AutoConfig

    data = _step_data(AutoConfig.from_pretrained(tiny_model).vocab_size)
    ppo, cispo = (_run(tiny_model, data, loss_name=loss)[1] for loss in ("ppo", "cispo"))
    assert any(not torch.allclose(ppo[name], cispo[name]) for name in ppo)


def test_micro_batches_hold_at_most_rows_times_width_positions() -> None:
    rows = list(range(8))
    # Rows as wide as --pack-tokens-per-row: --micro-batch-rows rows per pass.
    assert split_micro_batches(rows, 512, 4, 512) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_micro_batches(rows, 300, 4, 512) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # narrower: never more rows
    # A 640-token sequence widened every row: 8 x 640 would exceed 8 x 512 positions, so 6 rows per pass.
    assert split_micro_batches(rows, 640, 8, 512) == [[0, 1, 2, 3, 4, 5], [6, 7]]
    # A row wider than the whole budget still trains, alone.
    assert split_micro_batches([3, 5], 5000, 8, 512) == [[3], [5]]
    assert split_micro_batches([], 512, 8, 512) == []
    with pytest.raises(ValueError, match="must be >= 1"):
        split_micro_batches(rows, 512, 0, 512)
