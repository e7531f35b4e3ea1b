"""A step's data: the claimed groups' trajectories as training sequences, with their advantages.

Groups too stale, or unreadable, are dropped (never trained); tokens sampled under a grammar get that grammar's
masks, rebuilt from the recorded request (trainer/grammar.py), or are trained as context.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from store.errors import NotFound
from store.groups import GroupRow
from store.trajectories import Trajectory
from trainer.batch import StepData, TrainSequence, sequences_from_trajectory
from trainer.config import TrainConfig
from trainer.grammar import GrammarMasks
from trainer.loss import compute_advantages
from trainer.store_view import TrainerStore

log = logging.getLogger("artgw.trainer")


def load_step_data(
    store: TrainerStore,
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
            loaded = store.trajectories(group.members)
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
                    sampled, prompt = list(sequence.token_ids[start:end]), list(sequence.token_ids[:start])
                    rows = grammar.for_call(call.grammar_request, sampled, prompt)
                except ValueError as exc:
                    log.warning("call %s: its grammar does not match its tokens, trained as context: %s", call_id, exc)
            if rows is None:
                untrained.add(call_id)
            else:
                masks[call_id] = rows
    return masks, untrained
