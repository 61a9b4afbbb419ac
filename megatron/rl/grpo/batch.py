"""From ordered ``RolloutGroup``s to the padded tensors of one GRPO training step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.rl.grpo.advantages import group_advantages
from megatron.rl.wire import RolloutGroup


@dataclass(frozen=True)
class TrainBatch:
    """Next-token-prediction tensors of a batch of rollouts (row b = one rollout).

    Inputs are ``tokens[:, :-1]`` of each trajectory and targets ``tokens[:, 1:]``; every
    per-token tensor below is aligned with the targets.
    """

    input_ids: torch.Tensor
    """(B, T) int64 inputs, right-padded with ``pad_id``."""
    target_ids: torch.Tensor
    """(B, T) int64 next tokens."""
    loss_mask: torch.Tensor
    """(B, T) float32, 1.0 where the target is a generated token of a non-placeholder rollout."""
    inference_logprobs: torch.Tensor
    """(B, T) float32 behaviour logprobs of generated targets (0 elsewhere)."""
    advantages: torch.Tensor
    """(B,) float32 group-normalized advantages."""
    temperature: torch.Tensor
    """(B,) float32 sampling temperature of each rollout."""
    lengths: torch.Tensor
    """(B,) int64 number of real (non-padding) input positions."""

    @property
    def num_rows(self) -> int:
        """Rollouts in the batch."""
        return self.input_ids.shape[0]

    @property
    def num_loss_tokens(self) -> int:
        """Generated tokens that carry loss."""
        return int(self.loss_mask.sum())

    def rows(self, start: int, stop: int, trim: bool = True) -> "TrainBatch":
        """Rows [start, stop), trimmed to their own longest sequence (or, without ``trim``, at
        the batch's full width)."""
        width = self.input_ids.shape[1]
        if trim:
            width = max(1, int(self.lengths[start:stop].max())) if stop > start else 1
        return TrainBatch(
            input_ids=self.input_ids[start:stop, :width],
            target_ids=self.target_ids[start:stop, :width],
            loss_mask=self.loss_mask[start:stop, :width],
            inference_logprobs=self.inference_logprobs[start:stop, :width],
            advantages=self.advantages[start:stop],
            temperature=self.temperature[start:stop],
            lengths=self.lengths[start:stop],
        )

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        """The rows of index tensor ``rows`` (in that order), at the batch's full width."""
        return TrainBatch(
            input_ids=self.input_ids[rows],
            target_ids=self.target_ids[rows],
            loss_mask=self.loss_mask[rows],
            inference_logprobs=self.inference_logprobs[rows],
            advantages=self.advantages[rows],
            temperature=self.temperature[rows],
            lengths=self.lengths[rows],
        )


def build_train_batch(groups: list[RolloutGroup], pad_id: int) -> TrainBatch:
    """Advantages per group, then one padded row per rollout in (group, rollout) order.

    Placeholder rollouts (environment errors) stay as rows so that batch shapes and data-parallel
    shards do not depend on failures, but they carry no loss and do not enter group statistics.
    """
    rollouts = [r for g in groups for r in g.rollouts]
    sizes = {len(g.rollouts) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"all groups must have the same size, got sizes {sorted(sizes)}")
    k = sizes.pop()
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64).view(-1, k)
    valid = torch.tensor([not r.is_placeholder for r in rollouts]).view(-1, k)
    advantages = group_advantages(rewards, valid).view(-1)  # (B,)

    width = max(1, max(len(r.tokens) for r in rollouts) - 1)
    rows = len(rollouts)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    target_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(rows, width)
    old_logprobs = torch.zeros(rows, width)
    lengths = torch.zeros(rows, dtype=torch.long)
    for b, r in enumerate(rollouts):
        if r.is_placeholder:
            continue
        if r.generation_mask and r.generation_mask[0]:
            raise ValueError(f"rollout {r.env_id}/{r.problem_id} starts with a generated token")
        if len(r.tokens) < 2:
            continue
        n = len(r.tokens) - 1
        tokens = torch.tensor(r.tokens)
        input_ids[b, :n] = tokens[:-1]
        target_ids[b, :n] = tokens[1:]
        generated = torch.tensor(r.generation_mask[1:])  # aligned with targets
        loss_mask[b, :n] = generated.float()
        old_logprobs[b, :n][generated] = torch.tensor(r.logprobs, dtype=torch.float32)
        lengths[b] = n
    return TrainBatch(
        input_ids=input_ids,
        target_ids=target_ids,
        loss_mask=loss_mask,
        inference_logprobs=old_logprobs,
        advantages=advantages,
        temperature=torch.tensor([r.temperature for r in rollouts], dtype=torch.float32),
        lengths=lengths,
    )
