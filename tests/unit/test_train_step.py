"""trainer.train.train_step on the tiny model: the update does not depend on how the batch is cut.

Trajectories of several sequences land in different rows and micro-batches; with the loss's normalizers
counted over the whole batch, `--micro-batch-rows` and `--pack-tokens-per-row` change neither the step's
metrics nor the adapter, for every loss x normalization. The model runs in float64 so that what is compared
is the arithmetic of the step, not float32 rounding (Adam's first step divides each gradient by its own
magnitude, which would amplify rounding in near-zero gradients).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.step_ranks import Job, one_step, worker
from tests.step_ranks import step_data as _step_data
from trainer.batch import StepData
from trainer.step import split_micro_batches

LAYOUTS = [
    {"micro_batch_rows": 1, "pack_tokens_per_row": 24},  # a row per micro-batch, narrow rows
    {"micro_batch_rows": 3, "pack_tokens_per_row": 40},
    {"micro_batch_rows": 3, "pack_tokens_per_row": 12},  # longer sequences widen the rows: fewer rows per pass
    {"micro_batch_rows": 64, "pack_tokens_per_row": 512},  # the whole batch at once
]


def _run(tiny_model: Path, data: StepData, **options: object):
    metrics, lora, _ = one_step(tiny_model, data, {"learning_rate": 1e-2, **options})
    return metrics, lora


# The two-process cases: several micro-batches on each process, and one row (the second process has none).
DDP_LOSSES = ("ppo", "gspo")
DDP_LAYOUTS = {
    6: {"micro_batch_rows": 1, "pack_tokens_per_row": 24},
    1: {"micro_batch_rows": 1, "pack_tokens_per_row": 512},
}


def _options(loss: str, trajectories: int) -> dict[str, Any]:
    return {"learning_rate": 1e-2, "loss_name": loss, **DDP_LAYOUTS[trajectories]}


@pytest.fixture(scope="module")
def two_ranks(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], list[dict]]:
    """What each of two gloo processes (tests/step_ranks.py `worker`) saved for every two-process job of this
    file, by job: one pair of processes for all (each pair costs ~12 s of CPU to start)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model).vocab_size
    jobs: dict[tuple[str, ...], Job] = {
        ("step", loss, str(n)): ("step", _step_data(vocab, n), _options(loss, n))
        for loss in DDP_LOSSES
        for n in DDP_LAYOUTS
    }
    jobs[("orders",)] = ("orders", _step_data(vocab), {"learning_rate": 1e-2})
    tmp = tmp_path_factory.mktemp("ranks")
    out = str(tmp / "job%d-rank%d.pt")
    args = (2, str(tmp / "rendezvous"), str(tiny_model), list(jobs.values()), out)
    torch.multiprocessing.spawn(worker, args=args, nprocs=2, join=True)
    return {key: [torch.load(out % (index, rank)) for rank in range(2)] for index, key in enumerate(jobs)}


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


@pytest.mark.parametrize("loss", DDP_LOSSES)
@pytest.mark.parametrize("trajectories", DDP_LAYOUTS)
def test_two_processes_take_the_step_one_takes(
    tiny_model: Path, two_ranks: dict[tuple[str, ...], list[dict]], loss: str, trajectories: int
) -> None:
    """DistributedDataParallel (its gradient sum) over 2 gloo processes gives the one-process step, on each."""
    from transformers import AutoConfig

    data = _step_data(AutoConfig.from_pretrained(tiny_model).vocab_size, trajectories)
    alone, alone_lora, alone_ddp = one_step(tiny_model, data, _options(loss, trajectories))
    ranks = two_ranks[("step", loss, str(trajectories))]
    assert not alone_ddp and all(rank["ddp"] for rank in ranks)
    assert alone.grad_norm > 0
    for rank in ranks:
        assert rank["loss"] == pytest.approx(alone.loss, abs=1e-9)
        assert rank["grad_norm"] == pytest.approx(alone.grad_norm, rel=1e-9)
        for name, tensor in rank["lora"].items():
            torch.testing.assert_close(tensor, alone_lora[name], rtol=0, atol=1e-9, msg=name)


def test_the_other_ranks_follow_rank_0s_orders(two_ranks: dict[tuple[str, ...], list[dict]]) -> None:
    """Rank 0 orders train, restore, train, stop (trainer/ranks.py); rank 1 follows each and returns."""
    assert [rank["steps"] for rank in two_ranks[("orders",)]] == [2, 2]


@pytest.mark.parametrize(
    ("setting", "threshold", "expected"),
    [("auto", None, False), ("auto", 1, True), ("on", None, True), ("off", 1, False)],
)
def test_gradient_checkpointing_is_on_from_the_size_auto_names(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, setting: str, threshold: int | None, expected: bool
) -> None:
    """auto: on for a base of GRADIENT_CHECKPOINTING_FROM parameters or more (the tiny model is far below; a
    threshold of 1 puts it above)."""
    from trainer import model as model_module
    from trainer.config import TrainConfig

    if threshold is not None:
        monkeypatch.setattr(model_module, "GRADIENT_CHECKPOINTING_FROM", threshold)
    config = TrainConfig(base_model=str(tiny_model), db="x", gradient_checkpointing=setting)
    policy = model_module.load_policy(config, torch.device("cpu"), None)
    assert policy.get_base_model().is_gradient_checkpointing is expected
