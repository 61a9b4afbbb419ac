"""Loss aggregation: how the per-token losses of a global batch become one number (verl's
``loss_agg_mode``, TRL's ``loss_type``, NeMo-RL's ``token_level_loss``).

With l_it the per-token loss of sequence i (surrogate, IS weight and loss terms together), m_it
its loss mask, n_i = sum_t m_it its loss tokens and S the sequences of the global batch with
n_i > 0 (a fully masked sequence, such as a placeholder, a group dropped by dynamic sampling or a
row masked by the sequence-level logprob error, is not one of them):

    token-mean               L = sum_i sum_t m_it l_it / sum_i n_i              (DAPO; the default)
    seq-mean-token-mean      L = 1/|S| sum_{i in S} (1/n_i) sum_t m_it l_it     (GRPO paper, GSPO)
    seq-mean-token-sum       L = 1/|S| sum_{i in S} sum_t m_it l_it
    seq-mean-token-sum-norm  L = 1/|S| sum_{i in S} (1/C) sum_t m_it l_it       (Dr. GRPO)

C is a constant (Dr. GRPO, Liu et al. 2025: the generation budget), so a sequence's weight does
not depend on its length.

Independence of the micro-batch and data-parallel sizes: every mode is a sum over sequences (or
tokens) divided by a count of the *global* batch. A micro-batch returns its numerator
(``micro_batch_sum``: its rows' sums, each row whole in one micro-batch), the policy adds the
numerators over micro-batches and ranks and divides by ``denominator`` of the global batch (its
loss tokens, or |S|): the trainer's ``LossFunction.normalizer`` only calls it. Numerator and
denominator are both here, and ``per_sequence`` is the one place that tells the modes apart.

TRL's ``loss_type`` here: ``dapo`` and ``bnpo`` are ``token-mean`` (TRL's bnpo normalises per
local batch, this trainer always over the global batch); ``grpo`` is ``seq-mean-token-mean``
(TRL averages the sequences of each device's micro-batch, then the accumulation steps);
``dr_grpo`` is ``seq-mean-token-sum-norm`` with C = ``max_completion_length`` (TRL divides by
rows x C, rows without tokens included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron.rl.grpo.names import AGG_MODES, DEFAULT_AGG_MODE


class BatchCounts(Protocol):
    """What ``denominator`` reads of a global batch (``TrainBatch``)."""

    @property
    def global_loss_tokens(self) -> int:
        """Loss tokens of the global batch."""

    @property
    def global_loss_sequences(self) -> int:
        """Rows with loss tokens in the global batch."""


@dataclass(frozen=True)
class LossAggregation:
    """One of ``AGG_MODES`` and its constant."""

    mode: str
    """``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``."""
    scale_factor: float | None
    """C of ``seq-mean-token-sum-norm`` (required there, ignored otherwise)."""

    def __post_init__(self) -> None:
        if self.mode not in AGG_MODES:
            raise ValueError(f"mode must be one of {AGG_MODES}, got {self.mode!r}")
        if self.mode == "seq-mean-token-sum-norm":
            c = self.scale_factor
            if c is None or not (math.isfinite(c) and c > 0):
                raise ValueError(f"seq-mean-token-sum-norm needs a scale_factor > 0, got {c}")

    @property
    def per_sequence(self) -> bool:
        """Whether the loss is a mean over sequences (else over tokens)."""
        return self.mode != DEFAULT_AGG_MODE

    def micro_batch_sum(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Scalar numerator of a micro-batch from its (B, T) per-token loss and loss mask."""
        if not self.per_sequence:
            return (per_token * mask).sum()
        row_sums = (per_token * mask).sum(dim=1)  # (B,)
        if self.mode == "seq-mean-token-mean":
            return (row_sums / mask.sum(dim=1).clamp(min=1)).sum()  # empty rows add 0
        if self.mode == "seq-mean-token-sum":
            return row_sums.sum()
        return row_sums.sum() / self.scale_factor

    def denominator(self, batch: BatchCounts) -> int:
        """What the global batch's numerator is divided by: its loss tokens (``token-mean``) or
        its sequences with loss tokens (only read in the per-sequence modes)."""
        return batch.global_loss_sequences if self.per_sequence else batch.global_loss_tokens


TOKEN_MEAN = LossAggregation(DEFAULT_AGG_MODE, None)
"""The default aggregation (``GRPOLossConfig.aggregation``)."""
