"""Trajectories' token sequences -> packed training rows.

Several sequences share one row ("packing without padding waste"): a block-diagonal causal
attention mask and position ids that restart at 0 keep packed sequences from seeing each
other, so every token gets the logits it would get alone. One trajectory may have several
sequences (the gateway splits when a call does not extend the previous one); they all carry
the trajectory's index, which is how the loss weighs per trajectory across rows.

Everything is aligned for next-token prediction here, once: position t predicts labels[t],
the token at t + 1 of the same sequence, and every per-token tensor describes labels[t].
So the log-probabilities of `labels` (trainer/logprobs.py) feed `grpo_loss` without any further shifting.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
from torch import Tensor

__all__ = ["PackedBatch", "TrainSequence", "pack_sequences", "sequences_from_trajectory"]


# -----------------------------------------------------------------------------
# types


@dataclass(frozen=True)
class TrainSequence:
    """One token sequence of one trajectory."""

    token_ids: list[int]
    sampled_mask: list[int]  # 1: sampled by the model (trainable); 0: context
    logprobs: list[float | None]  # sampling logprob of each sampled token; context entries are ignored
    trajectory: int  # index into the batch's advantages
    # Tokens sampled under a grammar: grammar_bitmask[i] (xgrammar's int32 layout, ceil(V / 32) words) is the
    # allowed-token mask vLLM sampled token_ids[grammar_positions[i]] under; the trainer scores them under it too.
    grammar_positions: tuple[int, ...] = ()
    grammar_bitmask: Tensor | None = None  # (len(grammar_positions), W) int32

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("token_ids must not be empty")
        rows = 0 if self.grammar_bitmask is None else self.grammar_bitmask.shape[0]
        if rows != len(self.grammar_positions) or any(not 0 <= p < n for p in self.grammar_positions):
            raise ValueError(
                f"grammar_positions ({len(self.grammar_positions)}, each in [0, {n})) must index "
                f"grammar_bitmask's {rows} rows"
            )
        if len(self.sampled_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                "token_ids, sampled_mask and logprobs must have the same length, "
                f"got {n}, {len(self.sampled_mask)}, {len(self.logprobs)}"
            )
        if not _is_int(self.trajectory) or self.trajectory < 0:
            raise ValueError(f"trajectory must be an int >= 0, got {self.trajectory!r}")
        for i, (token, sampled, logprob) in enumerate(
            zip(self.token_ids, self.sampled_mask, self.logprobs, strict=True)
        ):
            if not _is_int(token) or token < 0:
                raise ValueError(f"token_ids[{i}] must be an int >= 0, got {token!r}")
            if not _is_int(sampled) or sampled not in (0, 1):
                raise ValueError(f"sampled_mask[{i}] must be 0 or 1, got {sampled!r}")
            # A missing or non-finite logprob on a trained token would turn the importance ratio into NaN/inf.
            if sampled and not (_is_number(logprob) and math.isfinite(logprob)):
                raise ValueError(f"logprobs[{i}] of a sampled token must be a finite float, got {logprob!r}")


@dataclass(frozen=True, eq=False)  # eq=False: tensors don't compare to a bool
class PackedBatch:
    """Packed rows; position t predicts token t + 1. B rows of T tokens."""

    input_ids: Tensor  # (B, T) long, pad_id on padding
    position_ids: Tensor  # (B, T) long, restarting at 0 for each packed sequence; 0 on padding
    attention_mask: Tensor  # (B, 1, T, T) bool, True = may attend: causal and same sequence; padding sees itself
    labels: Tensor  # (B, T) long: the next token of the same sequence; pad_id at a sequence's end and on padding
    loss_mask: Tensor  # (B, T) bool: labels[t] is a sampled token of the same sequence
    sampled_logprobs: Tensor  # (B, T) float32: sampling logprob of labels[t] on loss_mask, 0 elsewhere
    token_trajectory: Tensor  # (B, T) long: trajectory of labels[t] on loss_mask, -1 elsewhere
    allowed_index: Tensor  # (B, T) long: row of allowed_bitmask labels[t] was sampled under; -1: no grammar
    allowed_bitmask: Tensor | None  # (M, W) int32 grammar masks (None: no token sampled under a grammar)
    placements: tuple[tuple[int, int], ...]  # (row, first column) of each input sequence, in input order
    row_tokens: tuple[int, ...]  # tokens (not padding) in each row
    num_sequences: int
    trainable_tokens: int  # loss_mask.sum()
    padding_tokens: int  # positions holding no sequence
    truncated_sequences: int  # sequences longer than max_tokens_per_row, cut to their prefix


@dataclass(frozen=True)
class StepData:
    group_ids: list[str]
    sequences: list[TrainSequence]  # every trainable sequence, trajectory index into `advantages`
    advantages: torch.Tensor  # (N,) one per trajectory
    rewards: list[float]
    zero_signal_groups: int  # groups whose rewards were all equal: no gradient
    zero_advantage_trajectories: int  # skipped: their advantage is 0
    staleness: int  # steps between the oldest adapter that sampled a rollout and the one being trained


# -----------------------------------------------------------------------------
# gateway trajectories -> sequences


def sequences_from_trajectory(
    trajectory_index: int,
    sequences: Sequence[Any],
    untrained_calls: Collection[str] = (),
    grammar_masks: Mapping[str, Tensor] | None = None,
) -> list[TrainSequence]:
    """TrainSequences of one trajectory from objects with token_ids/sampled_mask/logprobs.

    Takes store.trajectories.Sequence (or anything shaped like it). All sequences of a
    split trajectory get the same index: the advantage (and grpo's per-trajectory mean)
    belongs to the trajectory, not to the pieces it was split into. The sampled tokens of
    `untrained_calls` (ids in `call_ids`, located by `sampled_spans`) become context.
    `grammar_masks[call_id]`: the grammar masks a call's tokens were sampled under, one row per sampled token
    (calls sampled under no grammar are not in it).
    """
    out = []
    for s in sequences:
        mask = list(s.sampled_mask)
        positions: list[int] = []
        bitmasks: list[Tensor] = []
        for call_id, (start, end) in zip(s.call_ids, s.sampled_spans, strict=True):
            if call_id in untrained_calls:
                mask[start:end] = [0] * (end - start)
                continue
            rows = (grammar_masks or {}).get(call_id)
            if rows is not None:
                if rows.shape[0] != end - start:
                    raise ValueError(f"call {call_id}: {rows.shape[0]} grammar masks for {end - start} sampled tokens")
                positions += range(start, end)
                bitmasks.append(rows)
        out.append(
            TrainSequence(
                token_ids=list(s.token_ids),
                sampled_mask=mask,
                logprobs=list(s.logprobs),
                trajectory=trajectory_index,
                grammar_positions=tuple(positions),
                grammar_bitmask=torch.cat(bitmasks) if bitmasks else None,
            )
        )
    return out


# -----------------------------------------------------------------------------
# packing


def pack_sequences(sequences: Sequence[TrainSequence], *, max_tokens_per_row: int, pad_id: int) -> PackedBatch:
    """Pack sequences first-fit-decreasing into rows of at most max_tokens_per_row tokens.

    A longer sequence keeps its first max_tokens_per_row tokens (counted in truncated_sequences).
    T is the longest row. A sequence's first token is never trained: nothing in it predicts it.
    """
    if not sequences:
        raise ValueError("sequences must not be empty")
    if not _is_int(max_tokens_per_row) or max_tokens_per_row < 1:
        raise ValueError(f"max_tokens_per_row must be an int >= 1, got {max_tokens_per_row!r}")
    if not _is_int(pad_id) or pad_id < 0:
        raise ValueError(f"pad_id must be an int >= 0, got {pad_id!r}")
    for i, s in enumerate(sequences):
        if not isinstance(s, TrainSequence):
            raise ValueError(f"sequences[{i}] must be a TrainSequence, got {type(s).__name__}")

    lengths = [min(len(s.token_ids), max_tokens_per_row) for s in sequences]
    rows = _first_fit_decreasing(lengths, max_tokens_per_row)
    B, T = len(rows), max(sum(lengths[i] for i in row) for row in rows)

    # Filled as flat Python lists and converted once: per-sequence tensor writes cost more than the copy.
    input_ids = [pad_id] * (B * T)
    position_ids = [0] * (B * T)
    segment = [-1] * (B * T)  # which input sequence each position holds; -1 = padding
    labels = [pad_id] * (B * T)
    loss_mask = [False] * (B * T)
    sampled_logprobs = [0.0] * (B * T)
    token_trajectory = [-1] * (B * T)
    allowed_index = [-1] * (B * T)
    bitmasks: list[Tensor] = []
    bitmask_rows = 0
    placements: list[tuple[int, int]] = [(0, 0)] * len(sequences)
    for r, row in enumerate(rows):
        column = 0
        for i in row:
            s, n = sequences[i], lengths[i]
            placements[i] = (r, column)
            start = r * T + column
            input_ids[start : start + n] = s.token_ids[:n]
            position_ids[start : start + n] = range(n)
            segment[start : start + n] = [i] * n
            # Position t predicts t + 1: the sequence's first n - 1 positions have a label of their own;
            # its last one keeps pad_id rather than the next packed sequence's first token.
            for t in range(n - 1):
                labels[start + t] = s.token_ids[t + 1]
                if s.sampled_mask[t + 1]:
                    loss_mask[start + t] = True
                    # A sampled token's logprob is a number: Sample checked it (its type allows None for context).
                    sampled_logprobs[start + t] = float(s.logprobs[t + 1])  # type: ignore[arg-type]
                    token_trajectory[start + t] = s.trajectory
            # The row of grammar_bitmask for the token at p is the label of position p - 1.
            for i, p in enumerate(s.grammar_positions):
                if 1 <= p < n and s.sampled_mask[p]:
                    allowed_index[start + p - 1] = bitmask_rows + i
            if s.grammar_bitmask is not None:
                bitmasks.append(s.grammar_bitmask)
                bitmask_rows += s.grammar_bitmask.shape[0]
            column += n

    segments = torch.tensor(segment).view(B, T)
    return PackedBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long).view(B, T),
        position_ids=torch.tensor(position_ids, dtype=torch.long).view(B, T),
        attention_mask=_block_causal_mask(segments),
        labels=torch.tensor(labels, dtype=torch.long).view(B, T),
        loss_mask=torch.tensor(loss_mask, dtype=torch.bool).view(B, T),
        sampled_logprobs=torch.tensor(sampled_logprobs, dtype=torch.float32).view(B, T),
        token_trajectory=torch.tensor(token_trajectory, dtype=torch.long).view(B, T),
        allowed_index=torch.tensor(allowed_index, dtype=torch.long).view(B, T),
        allowed_bitmask=torch.cat(bitmasks) if bitmasks else None,
        placements=tuple(placements),
        row_tokens=tuple(sum(lengths[i] for i in row) for row in rows),
        num_sequences=len(sequences),
        trainable_tokens=sum(loss_mask),
        padding_tokens=B * T - sum(lengths),
        truncated_sequences=sum(len(s.token_ids) > max_tokens_per_row for s in sequences),
    )


def _first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` per row: longest first, each into the first row it fits (ties: input order)."""
    assert all(1 <= n <= capacity for n in lengths)
    rows: list[list[int]] = []
    free: list[int] = []  # free[r]: tokens still fitting in rows[r]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # sorted() is stable
        r = next((r for r, room in enumerate(free) if room >= lengths[i]), len(rows))
        if r == len(rows):
            rows.append([])
            free.append(capacity)
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


def _block_causal_mask(segments: Tensor) -> Tensor:
    """(B, T) segment ids (-1 = padding) -> (B, 1, T, T) bool, True where query i may attend key j."""
    T = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    real = (segments >= 0)[:, :, None]  # (B, T, 1): padding is "the same segment" as other padding; exclude it
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # (T, T)
    # The diagonal keeps a padding query from having no key at all: a softmax over no keys is NaN in
    # several attention kernels (torch's CPU math path returns 0 instead), and a NaN hidden state at
    # any position can leak into gradients through the matmuls even where the loss is masked.
    diagonal = torch.eye(T, dtype=torch.bool)  # (T, T)
    return ((same & real & causal) | diagonal)[:, None]  # (B, 1, T, T)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)
