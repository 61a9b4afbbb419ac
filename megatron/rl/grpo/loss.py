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
* ``terms``: additive per-token terms, one module each in ``terms/`` (the k3 penalty towards the
  reference policy ``beta * k3_t``, the entropy bonus ``-entropy_weight * H_t``, ...); each
  reports its metric by name.

Metrics travel by name: ``LossOutput.metric_sums()`` maps each metric to its sum over the
micro-batch's loss tokens; the trainer adds them over micro-batches and ranks in a fixed key order
and divides by the global number of loss tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron.rl.grpo.loss_inputs import LossInputs
from megatron.rl.grpo.terms.base import LossTerm


@dataclass(frozen=True)
class GRPOLossConfig:
    """Clipping of the GRPO surrogate and the weights of its optional terms."""

    clamp_eps_lower: float
    """Ratios below 1 - eps_lower are clipped (for negative advantages)."""
    clamp_eps_upper: float
    """Ratios above 1 + eps_upper are clipped (for positive advantages)."""
    terms: tuple[LossTerm, ...] = ()
    """Additive per-token terms (reference KL, entropy bonus, ...), applied in ``name`` order."""

    def requires(self, name: str) -> bool:
        """Whether a term reads the optional input ``name`` (``ref_logprobs``, ``entropy``)."""
        return any(name in term.requires for term in self.terms)


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
    term_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """Scalar sum over masked tokens of each term's metric, by term name."""

    def metric_sums(self) -> dict[str, torch.Tensor]:
        """Every reported sum by metric name (detached): the loss, the surrogate's statistics
        (``clip_fraction``, ``ratio_mean``, ``mismatch_kl``) and each term's metric."""
        return {
            "loss": self.loss_sum.detach(),
            "clip_fraction": self.clipped_tokens,
            "ratio_mean": self.ratio_sum,
            "mismatch_kl": self.mismatch_kl_sum,
            **self.term_sums,
        }


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
    extras = _terms(inputs, config)
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
        term_sums={} if extras is None else extras[1],
    )


def _terms(
    inputs: LossInputs, config: GRPOLossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """(B, T) sum of the terms and each term's masked metric sum; None without terms."""
    if not config.terms:
        return None
    mask = inputs.loss_mask
    total = torch.zeros_like(inputs.trainer_logprobs)  # (B, T)
    sums: dict[str, torch.Tensor] = {}
    for term in sorted(config.terms, key=lambda t: t.name):
        value = term.compute(inputs)
        total = total + value.per_token
        sums[term.name] = (value.metric.detach() * mask).sum()
    return total, sums
