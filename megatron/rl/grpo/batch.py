"""From ordered ``RolloutGroup``s to the padded tensors of one GRPO training step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from megatron.rl.grpo.advantages.compute import AdvantageConfig, advantage_metrics, advantages
from megatron.rl.grpo.overlong import OverlongConfig, shape_rewards
from megatron.rl.wire import RolloutGroup, TokenRollout


@dataclass(frozen=True)
class GlobalCounts:
    """What a data-parallel shard knows of the global batch it is cut from."""

    rows: int
    loss_tokens: int
    """Generated tokens that carry loss in the whole global batch (the loss's denominator)."""
    trained_tokens: int
    """Real (non-padding) input positions in the whole global batch."""
    loss_sequences: int | None = None
    """Rows with at least one loss token in the whole global batch (the denominator of the
    per-sequence loss aggregations); None: not counted."""


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
    routed_experts: torch.Tensor | None = None
    """(B, T, L * k) int16 experts the engine's MoE routers chose at each input position (every
    MoE layer's top-k, layer-major), -1 where nothing was recorded; None: no row has a record
    (``megatron/rl/models/routing_replay.py``)."""
    global_counts: GlobalCounts | None = None
    """Set on one data-parallel rank's shard of a global batch (its rows only); None when the
    batch is the whole global batch."""

    @property
    def num_rows(self) -> int:
        """Rollouts in the batch."""
        return self.input_ids.shape[0]

    @property
    def num_loss_tokens(self) -> int:
        """Generated tokens that carry loss."""
        return int(self.loss_mask.sum())

    @property
    def is_shard(self) -> bool:
        """Whether this is one data-parallel rank's shard (``global_counts`` is set)."""
        return self.global_counts is not None

    @property
    def global_loss_tokens(self) -> int:
        """Loss tokens of the whole global batch (of this batch, when it is not a shard)."""
        return (
            self.num_loss_tokens if self.global_counts is None else self.global_counts.loss_tokens
        )

    @property
    def num_loss_sequences(self) -> int:
        """Rows with at least one loss token."""
        return int((self.loss_mask.sum(dim=1) > 0).sum())

    @property
    def global_loss_sequences(self) -> int:
        """Rows with loss tokens in the whole global batch (of this batch, when not a shard)."""
        if self.global_counts is None:
            return self.num_loss_sequences
        if self.global_counts.loss_sequences is None:
            raise ValueError("this shard's global counts lack the global batch's loss sequences")
        return self.global_counts.loss_sequences

    @property
    def global_trained_tokens(self) -> int:
        """Real input positions of the whole global batch (of this batch, when not a shard)."""
        if self.global_counts is None:
            return int(self.lengths.sum())
        return self.global_counts.trained_tokens

    def as_shard(self, counts: GlobalCounts) -> TrainBatch:
        """These rows as a data-parallel shard of a global batch with ``counts``."""
        return replace(self, global_counts=counts)

    def rows(self, start: int, stop: int, trim: bool = True) -> TrainBatch:
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
            routed_experts=_rows_of(self.routed_experts, slice(start, stop), width),
        )

    def select(self, rows: torch.Tensor) -> TrainBatch:
        """The rows of index tensor ``rows`` (in that order), at the batch's full width."""
        return TrainBatch(
            input_ids=self.input_ids[rows],
            target_ids=self.target_ids[rows],
            loss_mask=self.loss_mask[rows],
            inference_logprobs=self.inference_logprobs[rows],
            advantages=self.advantages[rows],
            temperature=self.temperature[rows],
            lengths=self.lengths[rows],
            routed_experts=None if self.routed_experts is None else self.routed_experts[rows],
        )


def _rows_of(routes: torch.Tensor | None, rows: slice, width: int) -> torch.Tensor | None:
    """``routes[rows, :width]`` (None stays None)."""
    return None if routes is None else routes[rows, :width]


SAMPLE_FIELDS = (
    "tokens",
    "loss_mask",
    "inference_logprobs",
    "temperature",
    "reward",
    "routed_experts",
)
"""Fields of one rollout as a sample (``rollout_sample``); ``advantages`` is added per group."""
TRAIN_FIELDS = (
    "tokens",
    "loss_mask",
    "inference_logprobs",
    "temperature",
    "advantages",
    "routed_experts",
)
"""The fields ``rows_from_samples`` builds training rows from."""


def rollout_sample(rollout: TokenRollout) -> dict[str, torch.Tensor]:
    """One rollout as unpadded per-sample tensors, aligned with ``rows_from_samples``' rows.

    ``tokens`` (n + 1,) int64 is the trajectory (inputs ``[:-1]``, targets ``[1:]``), or empty for
    a row that carries nothing (a placeholder, fewer than two tokens); ``loss_mask`` (n,) bool
    marks generated targets; ``inference_logprobs`` (generated,) float32 their logprobs;
    ``temperature`` float32 and ``reward`` float64 are scalars; ``routed_experts`` (n * L * k,)
    int16 the engine's experts at each input position, flattened (empty when not recorded).
    """
    r = rollout
    empty = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool), torch.zeros(0)
    tokens, loss_mask, logprobs = empty
    routes = torch.zeros(0, dtype=torch.int16)
    if not r.is_placeholder:
        if r.generation_mask and r.generation_mask[0]:
            raise ValueError(f"rollout {r.env_id}/{r.problem_id} starts with a generated token")
        if len(r.tokens) >= 2:
            tokens = torch.tensor(r.tokens)
            loss_mask = torch.tensor(r.generation_mask[1:])  # aligned with targets
            logprobs = torch.tensor(r.logprobs, dtype=torch.float32)
            if r.routed_experts:
                routes = torch.tensor(r.routed_experts, dtype=torch.int16).view(-1)  # (n * L * k,)
    return {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "inference_logprobs": logprobs,
        "temperature": torch.tensor(r.temperature, dtype=torch.float32),
        "reward": torch.tensor(r.reward, dtype=torch.float64),
        "routed_experts": routes,
    }


def padded_width(groups: list[RolloutGroup]) -> int:
    """The width of the batch's padded rows: its longest trajectory (placeholders too) - 1."""
    return max(1, max(len(r.tokens) for g in groups for r in g.rollouts) - 1)


def batch_advantages(
    groups: list[RolloutGroup], config: AdvantageConfig, rewards: torch.Tensor | None = None
) -> torch.Tensor:
    """(B,) float32 advantages of the rollouts in (group, rollout) order under ``config``'s
    estimator and scale (``megatron/rl/grpo/advantages``).

    ``rewards``: (B,) rewards to use instead of the rollouts' own (shaped ones). Placeholder
    rollouts (environment errors) do not enter group statistics and get 0.
    """
    rollouts = [r for g in groups for r in g.rollouts]
    sizes = {len(g.rollouts) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"all groups must have the same size, got sizes {sorted(sizes)}")
    k = sizes.pop()
    if rewards is None:
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
    rewards = rewards.view(-1, k)
    valid = torch.tensor([not r.is_placeholder for r in rollouts]).view(-1, k)
    return advantages(rewards, valid, config).view(-1)  # (B,)


@dataclass(frozen=True)
class ShapedAdvantages:
    """A batch's advantages after reward shaping, the rows kept out of the loss, the metrics."""

    advantages: torch.Tensor
    """(B,) float32, in (group, rollout) order."""
    masked: torch.Tensor | None
    """(B,) bool rows kept out of the loss (truncated completions); None: none asked for."""
    metrics: dict[str, float]
    """``advantages_*`` and the shaping's (``ShapedRewards.metrics``)."""


def shaped_advantages(
    groups: list[RolloutGroup], config: AdvantageConfig, overlong: OverlongConfig | None
) -> ShapedAdvantages:
    """The advantages of ``groups`` under ``config`` from their rewards after the overlong
    penalty of ``overlong`` (None: the rewards as they are), and its truncated rows."""
    rewards = masked = None
    metrics: dict[str, float] = {}
    if overlong is not None:
        shaped = shape_rewards(groups, overlong)
        rewards, metrics = shaped.rewards, shaped.metrics()
        masked = shaped.masked if overlong.mask_truncated else None
    adv = batch_advantages(groups, config, rewards)
    valid = torch.tensor([not r.is_placeholder for g in groups for r in g.rollouts])
    return ShapedAdvantages(adv, masked, {**advantage_metrics(adv, valid), **metrics})


def rows_from_samples(
    samples: Mapping[str, Sequence[torch.Tensor]], pad_id: int, width: int
) -> TrainBatch:
    """Padded rows of ``width`` from the ``TRAIN_FIELDS`` of samples (one row per sample)."""
    tokens = samples["tokens"]
    rows = len(tokens)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    target_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(rows, width)
    old_logprobs = torch.zeros(rows, width)
    lengths = torch.zeros(rows, dtype=torch.long)
    routes = padded_routes(samples.get("routed_experts"), tokens, width)
    for b, (row, generated, logprobs) in enumerate(
        zip(tokens, samples["loss_mask"], samples["inference_logprobs"])
    ):
        n = len(row) - 1
        if n < 1:
            continue
        input_ids[b, :n] = row[:-1]
        target_ids[b, :n] = row[1:]
        loss_mask[b, :n] = generated.float()
        old_logprobs[b, :n][generated] = logprobs
        lengths[b] = n
    return TrainBatch(
        input_ids=input_ids,
        target_ids=target_ids,
        loss_mask=loss_mask,
        inference_logprobs=old_logprobs,
        advantages=torch.stack(list(samples["advantages"])) if rows else torch.zeros(0),
        temperature=torch.stack(list(samples["temperature"])) if rows else torch.zeros(0),
        lengths=lengths,
        routed_experts=routes,
    )


def padded_routes(
    routes: Sequence[torch.Tensor] | None, tokens: Sequence[torch.Tensor], width: int
) -> torch.Tensor | None:
    """(rows, width, L * k) int16 from each sample's flat (n * L * k,) routes, -1 where a row has
    none or past its n inputs; None when no sample has routes."""
    if routes is None or not any(len(r) for r in routes):
        return None
    sizes = {len(r) // (len(t) - 1) for r, t in zip(routes, tokens) if len(r)}
    if len(sizes) != 1:
        raise ValueError(f"rollouts record routes of different sizes per token: {sorted(sizes)}")
    out = torch.full((len(tokens), width, sizes.pop()), -1, dtype=torch.int16)
    for b, (r, t) in enumerate(zip(routes, tokens)):
        if len(r):
            out[b, : len(t) - 1] = r.view(len(t) - 1, -1)
    return out
