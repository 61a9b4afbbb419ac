"""Sequence-level logprob error between the trainer and the inference engine (NeMo-RL's
``seq_mult_prob_error`` and its ``grpo.seq_logprob_error_threshold`` masking).

Per sequence i, over its generated tokens t (loss mask m_it = 1):

    e_i = sum_t m_it * exp(|log pi_train(y_t) - log pi_inference(y_t)|) / sum_t m_it

the mean multiplicative probability error: 1 where the two logprobs agree, 2 where every token's
probability is off by a factor of 2 either way. pi_train is the trainer's policy at the first
forward of the batch (pi_old: before the batch's first update), pi_inference the logprobs the
engine recorded when it sampled. A sequence without generated tokens (a placeholder, a group
dropped by dynamic sampling) has no error and is left out of every statistic.

With a threshold X, sequences with e_i > X are masked out of the loss: the token-mean loss is then
normalised over the tokens of the sequences that remain. The advantages are not recomputed (the
masked sequences still count in their group's baseline), as in NeMo-RL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqLogprobErrorConfig:
    """Sequence-level logprob error: its metrics, and masking above a threshold."""

    threshold: float | None = None
    """X: mask sequences whose error exceeds X (None: measure only)."""

    def __post_init__(self) -> None:
        if self.threshold is not None and not (math.isfinite(self.threshold)):
            raise ValueError(f"threshold must be finite, got {self.threshold}")
        if self.threshold is not None and self.threshold < 1.0:
            raise ValueError(
                f"threshold must be >= 1 (a sequence's error is >= 1), got {self.threshold}"
            )


@dataclass(frozen=True)
class SeqLogprobErrors:
    """What the error decided for a batch: the rows kept in the loss and the metrics."""

    keep: torch.Tensor
    """(B,) bool: False for the rows masked out of the loss."""
    metrics: dict[str, float]
    """``seq_mult_prob_error_{min,mean,max}`` and, with a threshold, the same ``_after_mask``,
    ``seq_logprob_error_masked_sequences`` and ``seq_logprob_error_masked_rewarded_fraction``."""


def sequence_error_sums(
    trainer_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) float64 sums over each row's generated tokens of exp(|trainer - inference|), and
    (B,) float64 counts of those tokens, from (B, T) tensors."""
    with torch.no_grad():
        m = mask.double()
        delta = (trainer_logprobs.double() - inference_logprobs.double()).abs() * m  # (B, T)
        return (torch.exp(delta) * m).sum(dim=1), m.sum(dim=1)


def _stats(name: str, values: torch.Tensor) -> dict[str, float]:
    """min/mean/max of ``values`` (all 0 when empty, as NeMo-RL logs them)."""
    if values.numel() == 0:
        return {f"{name}_min": 0.0, f"{name}_mean": 0.0, f"{name}_max": 0.0}
    return {
        f"{name}_min": float(values.min()),
        f"{name}_mean": float(values.mean()),
        f"{name}_max": float(values.max()),
    }


def seq_logprob_errors(
    error_sums: torch.Tensor,
    token_counts: torch.Tensor,
    rewards: torch.Tensor,
    config: SeqLogprobErrorConfig,
) -> SeqLogprobErrors:
    """The rows to keep and the metrics, from the (B,) sums of ``sequence_error_sums`` (added
    over micro-batches and ranks) and the (B,) rewards of the rows."""
    valid = token_counts > 0  # (B,)
    errors = torch.where(valid, error_sums / token_counts.clamp(min=1), torch.ones_like(error_sums))
    metrics = _stats("seq_mult_prob_error", errors[valid])
    keep = torch.ones_like(valid)
    if config.threshold is None:
        return SeqLogprobErrors(keep, metrics)
    masked = valid & (errors > config.threshold)  # (B,)
    keep = ~masked
    count = int(masked.sum())
    rewarded = int((rewards[masked] > 0).sum())
    metrics.update(_stats("seq_mult_prob_error_after_mask", errors[valid & keep]))
    metrics["seq_logprob_error_masked_sequences"] = count
    metrics["seq_logprob_error_masked_rewarded_fraction"] = rewarded / count if count else 0.0
    return SeqLogprobErrors(keep, metrics)
