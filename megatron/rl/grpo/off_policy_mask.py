"""Off-policy sequence masking, OPSM (DeepSeek-AI 2025, "DeepSeek-V3.2", arXiv 2512.02556, its
equation 9; TRL ``off_policy_mask_threshold``, slime ``--use-opsm --opsm-delta``).

A sequence i is taken out of the policy loss when its advantage is negative *and* the policy has
drifted from the one that sampled it by more than delta:

    KL_i = (1/n_i) sum_t m_it ( log pi_sampling(y_it) - log pi_theta(y_it) )
    M_i  = 0 if A_i < 0 and KL_i > delta, else 1
    loss_it = M_i * (IS-weighted surrogate)_it + terms_it

pi_sampling is the engine's per-token logprob of the sampled token (the behaviour policy, as
TRL takes vLLM's logprobs): with forced lag L > 0 it measures the lag's drift and the
train/inference mismatch together. pi_theta is the current policy, recomputed by every forward
(no gradient through the mask). The mask multiplies the surrogate only: the additive terms (the
reference KL, the entropy bonus) stay, and the denominators of the aggregation do not change
(as in TRL and the paper, where M_i sits inside the unchanged normalisation). A sequence without
loss tokens has KL_i = 0 and is neither kept nor masked in the metric.

Metric: ``opsm_masked_sequence_fraction``, the share of sequences with loss tokens that were
masked (each micro-batch's forward counts; with ``--grpo-iterations`` > 1 every pass counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUMS = ("opsm/masked_sequences", "opsm/sequences")
"""The raw sums ``off_policy_keep`` reports (added over micro-batches and ranks, then ``metrics``)."""


@dataclass(frozen=True)
class OffPolicyMask:
    """OPSM's threshold."""

    threshold: float
    """delta: sequences with a negative advantage and KL_i > delta are masked."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.threshold) and self.threshold >= 0):
            raise ValueError(f"threshold must be finite and >= 0, got {self.threshold}")


def sequence_kl(
    trainer_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """(B,) KL_i: the mean over each row's loss tokens of log pi_sampling - log pi_theta (0 for a
    row without loss tokens), without gradient."""
    with torch.no_grad():
        tokens = mask.sum(dim=1).clamp(min=1)
        return ((sampling_logprobs - trainer_logprobs.detach()) * mask).sum(dim=1) / tokens


def off_policy_keep(
    trainer_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: OffPolicyMask,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(B,) M_i as the logprobs' dtype (1 keep, 0 masked) and the raw metric sums, from (B, T)
    logprobs and loss mask and (B,) advantages."""
    with torch.no_grad():
        kl = sequence_kl(trainer_logprobs, sampling_logprobs, mask)
        keep = (advantages >= 0) | (kl <= config.threshold)  # (B,)
        has_tokens = mask.sum(dim=1) > 0
        sums = {
            "opsm/masked_sequences": (~keep & has_tokens).sum().double(),
            "opsm/sequences": has_tokens.sum().double(),
        }
    return keep.to(trainer_logprobs.dtype), sums


def metrics(sums: dict[str, float]) -> dict[str, float]:
    """``opsm_masked_sequence_fraction`` from the global sums."""
    return {
        "opsm_masked_sequence_fraction": sums["opsm/masked_sequences"]
        / max(sums["opsm/sequences"], 1.0)
    }
