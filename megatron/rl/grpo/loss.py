"""The GRPO policy loss: clipped surrogate with asymmetric clipping and token-level averaging.

Variant: GRPO (Shao et al. 2024) with DAPO's decoupled clip range (``eps_lower`` / ``eps_upper``,
"clip-higher") and DAPO's token-level normalization (every generated token of the global batch
weighs the same). Per token:

    loss_t = -w_t * min(r_t A, clip(r_t, 1 - eps_lower, 1 + eps_upper) A)
             + beta * k3_t(theta, ref) - entropy_weight * H_t

* Default (none of the optional inputs): r_t = pi_theta / pi_inference, the ratio against the
  logprobs the inference engine recorded when sampling (the behaviour policy), so with forced lag
  L > 0 the same ratio is the importance-sampling correction for the L-step-old policy; w_t = 1.
* ``old_logprobs`` given (``--grpo-iterations`` > 1 or the IS correction): r_t = pi_theta / pi_old
  with pi_old the trainer's pre-update policy, and ``is_weights`` w_t = min(pi_old / pi_inference,
  C) correct for the train/inference mismatch (``importance.py``).
* ``ref_logprobs`` and ``kl_beta`` > 0: the k3 penalty towards the reference policy (``kl.py``).
* ``entropy`` and ``entropy_weight`` != 0: an entropy bonus (``entropy.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron.rl.grpo.kl import reference_kl


@dataclass(frozen=True)
class GRPOLossConfig:
    """Clipping of the GRPO surrogate and the weights of its optional terms."""

    clamp_eps_lower: float = 0.2
    """Ratios below 1 - eps_lower are clipped (for negative advantages)."""
    clamp_eps_upper: float = 0.28
    """Ratios above 1 + eps_upper are clipped (for positive advantages)."""
    kl_beta: float = 0.0
    """beta: weight of the k3 KL penalty towards the reference policy (needs ``ref_logprobs``)."""
    entropy_weight: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss; needs ``entropy``)."""


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
    old_logprobs: torch.Tensor | None = None
    """(B, T) log pi_old (trainer, pre-update): the ratio's denominator when given."""
    is_weights: torch.Tensor | None = None
    """(B, T) importance weights multiplying the surrogate (no gradient); None: 1."""
    ref_logprobs: torch.Tensor | None = None
    """(B, T) log pi_ref of the reference policy (no gradient); needed when kl_beta > 0."""
    entropy: torch.Tensor | None = None
    """(B, T) differentiable policy entropy; needed when entropy_weight != 0."""


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
    """Scalar: sum of the k3 estimate of KL(denominator || theta), a lag/mismatch diagnostic."""
    ref_kl_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    """Scalar: sum of the k3 estimate of KL(theta || ref) (0 without ``ref_logprobs``)."""
    entropy_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    """Scalar: sum of the policy entropy (0 without ``entropy``)."""


def grpo_loss(inputs: LossInputs, config: GRPOLossConfig) -> LossOutput:
    """Per-token GRPO loss (module docstring), summed over masked tokens."""
    mask = inputs.loss_mask  # (B, T)
    old = inputs.inference_logprobs if inputs.old_logprobs is None else inputs.old_logprobs
    log_ratio = (inputs.trainer_logprobs - old) * mask  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = inputs.advantages[:, None]  # (B, 1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - config.clamp_eps_lower, 1.0 + config.clamp_eps_upper) * adv
    surrogate = torch.minimum(unclipped, clipped)  # (B, T)
    with torch.no_grad():
        was_clipped = ((clipped < unclipped) & (mask > 0)).sum()
        k3 = ratio - 1.0 - log_ratio  # (B, T), >= 0
    extras = _penalties(inputs, config)
    if inputs.is_weights is None and extras is None:
        loss_sum = -(surrogate * mask).sum()
    else:
        weighted = surrogate if inputs.is_weights is None else inputs.is_weights * surrogate
        per_token = -weighted if extras is None else extras[0] - weighted  # (B, T)
        loss_sum = (per_token * mask).sum()
    return LossOutput(
        loss_sum=loss_sum,
        clipped_tokens=was_clipped.float(),
        ratio_sum=(ratio.detach() * mask).sum(),
        mismatch_kl_sum=(k3 * mask).sum(),
        **({} if extras is None else extras[1]),
    )


def _penalties(
    inputs: LossInputs, config: GRPOLossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """(B, T) KL penalty minus entropy bonus and their masked sums; None when both are off."""
    use_kl = config.kl_beta != 0.0
    use_entropy = config.entropy_weight != 0.0
    if use_kl and inputs.ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs ref_logprobs")
    if use_entropy and inputs.entropy is None:
        raise ValueError("entropy_weight != 0 needs entropy")
    if not (use_kl or use_entropy):
        return None
    mask = inputs.loss_mask
    term = torch.zeros_like(inputs.trainer_logprobs)  # (B, T)
    sums: dict[str, torch.Tensor] = {}
    if use_kl:
        kl = reference_kl(inputs.trainer_logprobs, inputs.ref_logprobs, mask)  # (B, T)
        term = term + config.kl_beta * kl
        sums["ref_kl_sum"] = (kl.detach() * mask).sum()
    if use_entropy:
        entropy = inputs.entropy * mask  # (B, T)
        term = term - config.entropy_weight * entropy
        sums["entropy_sum"] = entropy.detach().sum()
    return term, sums
