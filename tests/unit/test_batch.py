"""trainer.batch on hand-built tool-calling trajectories: masks, packing layout, and a real model's logits."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from store.trajectories import SPLIT_RERENDERED, assemble
from tests.conftest import make_call
from trainer import batch as batch_module
from trainer.batch import PackedBatch, TrainSequence, pack_sequences, sequences_from_trajectory
from trainer.loss import LossConfig, grpo_loss

PAD = 0
F, T_ = False, True  # short names keep the expected bool rows aligned with the token rows

USER = {"role": "user", "content": "weather in Paris?"}
TOOL_CALL_REPLY = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
ANSWER = {"role": "assistant", "content": "sunny"}


def seq(token_ids: list[int], sampled_mask: list[int], trajectory: int = 0) -> TrainSequence:
    """A sequence whose sampled token at position k has logprob -k/10 (so every value is distinct)."""
    logprobs = [-k / 10 if m else None for k, m in enumerate(sampled_mask)]
    return TrainSequence(token_ids, sampled_mask, logprobs, trajectory)


def test_public_api_is_pinned() -> None:
    assert sorted(batch_module.__all__) == [
        "PackedBatch",
        "TrainSequence",
        "pack_sequences",
        "sequences_from_trajectory",
    ]


# -----------------------------------------------------------------------------
# masks


def test_masks_sit_exactly_on_sampled_tokens_of_a_two_turn_tool_call() -> None:
    # Turn 1: prompt [1, 2, 3] -> sampled tool call [10, 11, 12].
    # Turn 2: + tool result [4, 5] as context -> sampled answer [13, 14].
    turn1 = make_call("a", 1, [USER], [1, 2, 3], (TOOL_CALL_REPLY, [10, 11, 12], [-0.1, -0.2, -0.3]))
    turn2 = make_call(
        "b", 2, [USER, TOOL_CALL_REPLY, TOOL_RESULT], [1, 2, 3, 10, 11, 12, 4, 5], (ANSWER, [13, 14], [-0.4, -0.5])
    )
    trajectory = assemble("r", [turn1, turn2])
    sequences = sequences_from_trajectory(3, trajectory.sequences)
    assert sequences == [
        TrainSequence(
            token_ids=[1, 2, 3, 10, 11, 12, 4, 5, 13, 14],
            sampled_mask=[0, 0, 0, 1, 1, 1, 0, 0, 1, 1],
            logprobs=[None, None, None, -0.1, -0.2, -0.3, None, None, -0.4, -0.5],
            trajectory=3,
        )
    ]

    batch = pack_sequences(sequences, max_tokens_per_row=16, pad_id=PAD)
    assert batch.input_ids.tolist() == [[1, 2, 3, 10, 11, 12, 4, 5, 13, 14]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    # Position t predicts t + 1: position 2 (the last prompt token) predicts the first sampled token 10.
    assert batch.labels.tolist() == [[2, 3, 10, 11, 12, 4, 5, 13, 14, PAD]]
    assert batch.loss_mask.tolist() == [[F, F, T_, T_, T_, F, F, T_, T_, F]]
    expected_logprobs = torch.tensor([[0, 0, -0.1, -0.2, -0.3, 0, 0, -0.4, -0.5, 0]], dtype=torch.float32)
    assert torch.equal(batch.sampled_logprobs, expected_logprobs)  # also checks the dtype: float32
    assert batch.token_trajectory.tolist() == [[-1, -1, 3, 3, 3, -1, -1, 3, 3, -1]]
    assert (batch.num_sequences, batch.trainable_tokens, batch.padding_tokens, batch.truncated_sequences) == (
        1,
        5,
        0,
        0,
    )
    assert batch.placements == ((0, 0),)
    assert batch.attention_mask.shape == (1, 1, 10, 10)
    assert torch.equal(batch.attention_mask[0, 0], torch.ones(10, 10, dtype=torch.bool).tril())


def test_two_packed_sequences_share_no_loss_positions_or_attention() -> None:
    # B's first token is marked sampled: a plain shift over the row would train A's last token
    # (3) to predict it (7). Nothing in B precedes it, so it is never trained.
    a = seq([1, 2, 3], [0, 1, 1], trajectory=0)
    b = seq([7, 8], [1, 1], trajectory=1)
    batch = pack_sequences([a, b], max_tokens_per_row=5, pad_id=PAD)
    assert batch.input_ids.tolist() == [[1, 2, 3, 7, 8]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert batch.labels.tolist() == [[2, 3, PAD, 8, PAD]]
    assert batch.loss_mask.tolist() == [[T_, T_, F, T_, F]]
    assert batch.sampled_logprobs[0].tolist() == pytest.approx([-0.1, -0.2, 0.0, -0.1, 0.0])
    assert batch.token_trajectory.tolist() == [[0, 0, -1, 1, -1]]
    assert batch.attention_mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    assert batch.placements == ((0, 0), (0, 3))
    assert (batch.trainable_tokens, batch.padding_tokens) == (3, 0)


def test_padding_is_accounted_for_and_attends_only_to_itself() -> None:
    batch = pack_sequences([seq([1, 2, 3, 4], [0, 1, 1, 1]), seq([5, 6, 7], [0, 0, 1])], max_tokens_per_row=4, pad_id=9)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 9]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]
    assert batch.labels.tolist() == [[2, 3, 4, 9], [6, 7, 9, 9]]
    assert batch.loss_mask.tolist() == [[T_, T_, T_, F], [F, T_, F, F]]
    assert batch.token_trajectory[1].tolist() == [-1, 0, -1, -1]
    assert batch.attention_mask[1, 0].int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [0, 0, 0, 1],  # padding: only the diagonal, so no query row is all False
    ]
    assert bool(batch.attention_mask.any(dim=-1).all())
    assert (batch.trainable_tokens, batch.padding_tokens, batch.truncated_sequences) == (4, 1, 0)


def test_split_trajectory_maps_every_sequence_to_one_trajectory_index() -> None:
    turn1 = make_call("a", 1, [USER], [1, 2], (TOOL_CALL_REPLY, [10, 11], [-0.1, -0.2]))
    # The template re-rendered the tool call with other tokens (20, 21): the gateway starts a second sequence.
    turn2 = make_call("b", 2, [USER, TOOL_CALL_REPLY, TOOL_RESULT], [1, 2, 20, 21, 4], (ANSWER, [13], [-0.3]))
    trajectory = assemble("r", [turn1, turn2])
    assert [s.split_reason for s in trajectory.sequences] == [None, SPLIT_RERENDERED]

    sequences = sequences_from_trajectory(5, trajectory.sequences)
    assert [s.trajectory for s in sequences] == [5, 5]
    batch = pack_sequences(sequences, max_tokens_per_row=16, pad_id=PAD)
    # FFD puts the 6-token second sequence first.
    assert batch.input_ids.tolist() == [[1, 2, 20, 21, 4, 13, 1, 2, 10, 11]]
    assert batch.token_trajectory.tolist() == [[-1, -1, -1, -1, 5, -1, -1, 5, 5, -1]]
    assert batch.trainable_tokens == trajectory.trainable_tokens == 3

    # The loss sees one trajectory of 3 tokens: grpo's per-trajectory mean weighs the pieces together.
    result = grpo_loss(
        batch.sampled_logprobs,  # ratio 1 everywhere
        batch.sampled_logprobs,
        batch.token_trajectory,
        torch.tensor([0, 0, 0, 0, 0, 2.0]),
        batch.loss_mask,
        LossConfig(),
    )
    assert (result.num_trajectories, result.num_tokens) == (1, 3)
    assert float(result.loss) == pytest.approx(-2.0)  # mean over the trajectory's 3 tokens of -(1 * 2)


def test_untrained_calls_become_context_in_every_sequence() -> None:
    """The tool call was sampled under a grammar (its logprobs are not the model's): only the answer trains."""
    turn1 = make_call("a", 1, [USER], [1, 2], (TOOL_CALL_REPLY, [10, 11], [-0.1, -0.2]))
    turn2 = make_call("b", 2, [USER, TOOL_CALL_REPLY, TOOL_RESULT], [1, 2, 10, 11, 4], (ANSWER, [13], [-0.3]))
    again = [USER, TOOL_CALL_REPLY, TOOL_RESULT, ANSWER, {"role": "user", "content": "and Rome?"}]
    turn3 = make_call("c", 3, again, [1, 2, 30, 4, 13, 6], (ANSWER, [14, 15], [-0.4, -0.5]))
    trajectory = assemble("r", [turn1, turn2, turn3])  # turn 3's prompt re-rendered turn 1: a second sequence
    assert [s.call_ids for s in trajectory.sequences] == [["a", "b"], ["c"]]

    first, second = sequences_from_trajectory(0, trajectory.sequences, untrained_calls={"a", "c"})
    assert first.token_ids == [1, 2, 10, 11, 4, 13]
    assert first.sampled_mask == [0, 0, 0, 0, 0, 1]  # a's 10, 11 are context now; b's 13 still trains
    assert second.sampled_mask == [0, 0, 0, 0, 0, 0, 0, 0]
    assert first.logprobs == [None, None, -0.1, -0.2, None, -0.3]  # kept as recorded; the mask decides
    everything = sequences_from_trajectory(0, trajectory.sequences)
    assert [s.sampled_mask for s in everything] == [[0, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0, 1, 1]]


# -----------------------------------------------------------------------------
# layout


def test_first_fit_decreasing_layout() -> None:
    # Longest first: 7 -> row 0 (1 free); 5 -> row 1 (3 free); 4 -> row 2 (4 free); 3 -> row 1 (0 free);
    # 2 -> row 2 (2 free); 1 -> row 0 (0 free). Plain first-fit in input order would instead give
    # rows [3, 5], [7, 1], [2, 4].
    lengths = [3, 7, 5, 2, 4, 1]
    sequences = [seq([10 * (i + 1) + k for k in range(n)], [0] * n) for i, n in enumerate(lengths)]
    batch = pack_sequences(sequences, max_tokens_per_row=8, pad_id=PAD)
    assert batch.input_ids.tolist() == [
        [20, 21, 22, 23, 24, 25, 26, 60],  # sequences 1 and 5
        [30, 31, 32, 33, 34, 10, 11, 12],  # sequences 2 and 0
        [50, 51, 52, 53, 40, 41, PAD, PAD],  # sequences 4 and 3
    ]
    assert batch.placements == ((1, 5), (0, 0), (1, 0), (2, 4), (2, 0), (0, 7))
    assert batch.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 5, 6, 0],
        [0, 1, 2, 3, 4, 0, 1, 2],
        [0, 1, 2, 3, 0, 1, 0, 0],
    ]
    assert (batch.num_sequences, batch.padding_tokens, batch.trainable_tokens) == (6, 2, 0)


def test_longest_row_sets_the_width() -> None:
    batch = pack_sequences([seq([1, 2], [0, 1]), seq([3, 4, 5], [0, 1, 1])], max_tokens_per_row=100, pad_id=PAD)
    assert batch.input_ids.tolist() == [[3, 4, 5, 1, 2]]
    assert batch.padding_tokens == 0


def test_truncation_keeps_the_prefix_and_is_counted() -> None:
    long = seq([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1, 1], trajectory=0)
    exact = seq([7, 8, 9, 10], [0, 1, 1, 1], trajectory=1)  # exactly max_tokens_per_row: not truncated
    batch = pack_sequences([long, exact], max_tokens_per_row=4, pad_id=PAD)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4], [7, 8, 9, 10]]
    # The kept prefix's last token (4) would predict the dropped 5: no label, no loss.
    assert batch.labels.tolist() == [[2, 3, 4, PAD], [8, 9, 10, PAD]]
    assert batch.loss_mask.tolist() == [[F, T_, T_, F], [T_, T_, T_, F]]
    assert batch.sampled_logprobs[0].tolist() == pytest.approx([0.0, -0.2, -0.3, 0.0])
    assert (batch.truncated_sequences, batch.trainable_tokens, batch.padding_tokens) == (1, 5, 0)


# -----------------------------------------------------------------------------
# validation


@pytest.mark.parametrize(
    ("token_ids", "sampled_mask", "logprobs", "trajectory", "match"),
    [
        ([], [], [], 0, "must not be empty"),
        ([1, 2], [0, 1], [None], 0, "same length"),
        ([1, 2], [0], [None, -0.1], 0, "same length"),
        ([1, 2], [0, 1], [None, None], 0, r"logprobs\[1\] of a sampled token"),
        ([1, 2], [0, 1], [None, math.nan], 0, r"logprobs\[1\] of a sampled token"),
        ([1, 2], [0, 1], [None, -math.inf], 0, r"logprobs\[1\] of a sampled token"),
        ([1, 2], [0, 2], [None, -0.1], 0, r"sampled_mask\[1\] must be 0 or 1"),
        ([1, 2], [0, True], [None, -0.1], 0, r"sampled_mask\[1\] must be 0 or 1"),
        ([1, -2], [0, 1], [None, -0.1], 0, r"token_ids\[1\] must be an int >= 0"),
        ([1, 2], [0, 1], [None, -0.1], -1, "trajectory must be an int >= 0"),
    ],
)
def test_invalid_sequences_are_rejected(
    token_ids: list[Any], sampled_mask: list[Any], logprobs: list[Any], trajectory: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        TrainSequence(token_ids, sampled_mask, logprobs, trajectory)


def test_context_logprobs_are_ignored() -> None:
    # The gateway stores None on context; a float there is harmless and does not reach the batch.
    batch = pack_sequences([TrainSequence([1, 2, 3], [0, 0, 1], [-9.0, None, -0.5], 0)], max_tokens_per_row=4, pad_id=0)
    assert batch.sampled_logprobs.tolist() == [[0.0, -0.5, 0.0]]


@pytest.mark.parametrize(
    ("sequences", "kwargs", "match"),
    [
        ([], {"max_tokens_per_row": 4, "pad_id": 0}, "sequences must not be empty"),
        ([seq([1], [0])], {"max_tokens_per_row": 0, "pad_id": 0}, "max_tokens_per_row must be an int >= 1"),
        ([seq([1], [0])], {"max_tokens_per_row": 4, "pad_id": -1}, "pad_id must be an int >= 0"),
        ([{"token_ids": [1]}], {"max_tokens_per_row": 4, "pad_id": 0}, r"sequences\[0\] must be a TrainSequence"),
    ],
)
def test_invalid_packing_arguments_are_rejected(sequences: list[Any], kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pack_sequences(sequences, **kwargs)


# -----------------------------------------------------------------------------
# a real model: packed logits equal per-sequence logits


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa", dtype=torch.float32).eval()


def _packed_logprobs(model: Any, batch: PackedBatch, attention_mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(batch.input_ids, position_ids=batch.position_ids, attention_mask=attention_mask).logits
    assert bool(torch.isfinite(logits).all())  # padding positions included
    return _gathered(logits, batch.labels)  # (B, T)


def test_packed_logprobs_equal_per_sequence_logprobs_of_a_real_model(model: Any) -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    sequences = []
    for i, n in enumerate([9, 5, 12, 3, 7]):
        ids = torch.randint(0, vocab, (n,), generator=generator).tolist()
        mask = [0] * (n // 2) + [1] * (n - n // 2)  # prompt, then completion
        sequences.append(seq(ids, mask, trajectory=i))
    # FFD: 12 + 3 | 9 + 7 | 5 -> rows of 15, 16 and 5 tokens: packing and padding both exercised.
    batch = pack_sequences(sequences, max_tokens_per_row=16, pad_id=PAD)
    assert batch.placements == ((1, 0), (2, 0), (0, 0), (0, 12), (1, 9))
    assert batch.padding_tokens == 1 + 0 + 11

    packed = _packed_logprobs(model, batch, batch.attention_mask)  # (B, T)
    causal_only = torch.ones(16, 16, dtype=torch.bool).tril().expand(3, 1, 16, 16)  # (B, 1, T, T)
    leaky = _packed_logprobs(model, batch, causal_only)  # later sequences in a row see earlier ones

    for s, (row, start) in zip(sequences, batch.placements, strict=True):
        ids = torch.tensor([s.token_ids])  # (1, n)
        with torch.no_grad():
            alone = _gathered(model(ids).logits[:, :-1], ids[:, 1:])[0]  # (n - 1,)
        n = len(s.token_ids)
        span = slice(start, start + n - 1)  # positions with a label inside the sequence
        # Every predicting position of the sequence is compared; the loss_mask ones are among them.
        assert batch.loss_mask[row, span].tolist() == [bool(m) for m in s.sampled_mask[1:]]
        torch.testing.assert_close(packed[row, span], alone, atol=1e-5, rtol=0)
        if start > 0:  # the control: without the block-diagonal mask, the packed sequence's logits change
            assert not torch.allclose(leaky[row, span], alone, atol=1e-3)


def _gathered(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] from the full logits: the reference the trainer's chunked path must equal."""
    return logits.log_softmax(dim=-1).gather(dim=-1, index=token_ids.unsqueeze(-1)).squeeze(-1)
