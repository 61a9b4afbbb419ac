"""The GRPO policy loss: clipped surrogate with asymmetric clipping and token-level averaging.

Variant: GRPO (Shao et al. 2024) without a KL term, with DAPO's decoupled clip range
(``eps_lower`` / ``eps_upper``, "clip-higher") and DAPO's token-level normalization (every
generated token of the global batch weighs the same). The ratio is taken against the logprobs the
inference engine recorded when sampling (the behaviour policy), so with forced lag L > 0 the same
ratio is the importance-sampling correction for the L-step-old policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GRPOLossConfig:
    """Clipping of the GRPO surrogate."""

    clamp_eps_lower: float = 0.2
    """Ratios below 1 - eps_lower are clipped (for negative advantages)."""
    clamp_eps_upper: float = 0.28
    """Ratios above 1 + eps_upper are clipped (for positive advantages)."""


@dataclass(frozen=True)
class LossInputs:
    """Typed inputs of the policy loss for one micro-batch."""

    trainer_logprobs: torch.Tensor
    """(B, T) log pi_theta(token), differentiable."""
    inference_logprobs: torch.Tensor
    """(B, T) log pi_behaviour(token) recorded by the engine at sampling time."""
    advantages: torch.Tensor
    """(B,) one advantage per sequence."""
    loss_mask: torch.Tensor
    """(B, T) 1.0 on generated tokens, 0.0 on prompt, padding and placeholder rows."""


@dataclass(frozen=True)
class LossOutput:
    """Sum-reduced loss and statistics of one micro-batch (divide by the global token count)."""

    loss_sum: torch.Tensor
    """Scalar: -sum over masked tokens of the clipped surrogate."""
    clipped_tokens: torch.Tensor
    """Scalar: tokens whose surrogate was clipped."""
    ratio_sum: torch.Tensor
    """Scalar: sum over masked tokens of pi_theta / pi_behaviour."""
    mismatch_kl_sum: torch.Tensor
    """Scalar: sum of the k3 estimate of KL(behaviour || theta), a lag/mismatch diagnostic."""


def grpo_loss(inputs: LossInputs, config: GRPOLossConfig) -> LossOutput:
    """Per-token clipped surrogate, summed over masked tokens.

    loss_t = -min(r_t * A, clip(r_t, 1 - eps_lower, 1 + eps_upper) * A),
    r_t = exp(logp_theta_t - logp_behaviour_t).
    """
    mask = inputs.loss_mask  # (B, T)
    log_ratio = (inputs.trainer_logprobs - inputs.inference_logprobs) * mask  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = inputs.advantages[:, None]  # (B, 1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - config.clamp_eps_lower, 1.0 + config.clamp_eps_upper) * adv
    surrogate = torch.minimum(unclipped, clipped)  # (B, T)
    with torch.no_grad():
        was_clipped = ((clipped < unclipped) & (mask > 0)).sum()
        k3 = ratio - 1.0 - log_ratio  # (B, T), >= 0
    return LossOutput(
        loss_sum=-(surrogate * mask).sum(),
        clipped_tokens=was_clipped.float(),
        ratio_sum=(ratio.detach() * mask).sum(),
        mismatch_kl_sum=(k3 * mask).sum(),
    )
