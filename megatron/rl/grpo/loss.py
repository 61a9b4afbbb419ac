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
* ``token_advantages`` given (on-policy distillation, ``distill.py``): A becomes per token,
  A_t = A + a_t, for the per-token surrogates (a variant declares ``TOKEN_ADVANTAGES``); OPSM
  reads each sequence's mean A_t.
* ``terms``: additive per-token terms, one module each in ``terms/`` (the k3 penalty towards the
  reference policy ``beta * k3_t``, the entropy bonus ``-entropy_weight * H_t``, ...); each
  reports its metric by name.

Policy-loss variants (the defaults, ``vanilla`` and ``token-mean`` without the options, are the
above bit for bit):

* ``policy_loss``: the surrogate, one module each in ``policy_loss/`` (``vanilla.py``, the clipped
  min(r_t A, clip(r_t) A) above; GSPO's sequence-level ratio; CISPO's clipped stop-gradient
  weight times log pi_theta; ...), loaded by name;
* ``off_policy_mask``: OPSM's M_i multiplies the weighted surrogate of sequences with a negative
  advantage that drifted too far (``off_policy_mask.py``);
* ``aggregation``: how the per-token losses are summed for the global batch's denominator
  (``aggregation.py``: token-mean, the seq-mean modes, Dr. GRPO's constant);
* the IS weights w_t may be token- or sequence-level, truncated or masked (``importance.py``).

Metrics travel by name: ``LossOutput.metric_sums()`` maps each metric to its sum over the
micro-batch's loss tokens; the trainer adds them over micro-batches and ranks in a fixed key order
and divides by the global number of loss tokens. A variant's per-sequence sums have a ``/`` in
their name (``gspo/ratio``, ``opsm/sequences``) and become metrics through ``variant_metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron.rl.grpo import off_policy_mask as opsm
from megatron.rl.grpo.aggregation import TOKEN_MEAN, LossAggregation
from megatron.rl.grpo.loss_inputs import LossInputs
from megatron.rl.grpo.off_policy_mask import OffPolicyMask
from megatron.rl.grpo.policy_loss import DEFAULT_POLICY_LOSS, load_policy_loss
from megatron.rl.grpo.policy_loss.base import PolicyLoss
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
    policy_loss: str = DEFAULT_POLICY_LOSS
    """The surrogate's variant: a module of ``policy_loss/`` (``vanilla``, ``gspo``, ...)."""
    aggregation: LossAggregation = TOKEN_MEAN
    """How per-token losses are summed (``aggregation.py``)."""
    off_policy_mask: OffPolicyMask | None = None
    """OPSM's threshold (``off_policy_mask.py``); None: no mask."""

    def __post_init__(self) -> None:
        load_policy_loss(self.policy_loss)  # a ValueError names the variants
        if not isinstance(self.aggregation, LossAggregation):
            raise TypeError(f"aggregation must be a LossAggregation, got {self.aggregation!r}")

    def requires(self, name: str) -> bool:
        """Whether a term reads the optional input ``name`` (``ref_logprobs``, ``entropy``)."""
        return any(name in term.requires for term in self.terms)

    @property
    def variant(self) -> PolicyLoss:
        """The surrogate's variant (its module's declarations)."""
        return load_policy_loss(self.policy_loss)

    def sum_keys(self) -> tuple[str, ...]:
        """The names of the metric sums the variants add to ``LossOutput.metric_sums``."""
        keys = self.variant.sums
        if self.off_policy_mask is not None:
            keys += opsm.SUMS
        return keys


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
    variant_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """The variants' own metric sums (``GRPOLossConfig.sum_keys``)."""

    def metric_sums(self) -> dict[str, torch.Tensor]:
        """Every reported sum by metric name (detached): the loss, the surrogate's statistics
        (``clip_fraction``, ``ratio_mean``, ``mismatch_kl``) and each term's metric."""
        return {
            "loss": self.loss_sum.detach(),
            "clip_fraction": self.clipped_tokens,
            "ratio_mean": self.ratio_sum,
            "mismatch_kl": self.mismatch_kl_sum,
            **self.term_sums,
            **self.variant_sums,
        }


def grpo_loss(inputs: LossInputs, config: GRPOLossConfig) -> LossOutput:
    """Per-token GRPO loss (module docstring), summed over masked tokens (or, with a per-sequence
    ``aggregation``, over sequences)."""
    if inputs.token_advantages is not None and not config.variant.token_advantages:
        raise ValueError(
            f"policy loss {config.policy_loss!r} takes one advantage per sequence, not per-token "
            "advantages (on-policy distillation's)"
        )
    mask = inputs.loss_mask  # (B, T)
    old = inputs.inference_logprobs if inputs.old_logprobs is None else inputs.old_logprobs
    surrogate = config.variant.surrogate(
        inputs.trainer_logprobs,
        old,
        inputs.advantage_per_token(),  # (B, 1), or (B, T) with per-token advantages
        mask,
        config.clamp_eps_lower,
        config.clamp_eps_upper,
    )
    with torch.no_grad():
        log_ratio = (inputs.trainer_logprobs - old) * mask  # (B, T)
        ratio = torch.exp(log_ratio)  # (B, T)
        k3 = ratio - 1.0 - log_ratio  # (B, T), >= 0
    variant_sums = surrogate.sums
    weighted = surrogate.per_token  # (B, T)
    if inputs.is_weights is not None:
        weighted = inputs.is_weights * weighted
    if config.off_policy_mask is not None:
        keep, opsm_sums = opsm.off_policy_keep(
            inputs.trainer_logprobs,
            inputs.inference_logprobs,
            inputs.advantage_per_sequence(),
            mask,
            config.off_policy_mask,
        )
        weighted = weighted * keep[:, None]
        variant_sums = {**variant_sums, **opsm_sums}
    extras = _terms(inputs, config)
    per_token = -weighted if extras is None else extras[0] - weighted  # (B, T)
    return LossOutput(
        loss_sum=config.aggregation.micro_batch_sum(per_token, mask),
        clipped_tokens=surrogate.clipped_tokens.float(),
        ratio_sum=(ratio * mask).sum(),
        mismatch_kl_sum=(k3 * mask).sum(),
        term_sums={} if extras is None else extras[1],
        variant_sums=variant_sums,
    )


def variant_metrics(sums: dict[str, float], config: GRPOLossConfig) -> dict[str, float]:
    """The logged metrics of the variants' raw sums (names with ``/``), from the global sums."""
    metrics = config.variant.metrics(sums)
    if config.off_policy_mask is not None:
        metrics = {**metrics, **opsm.metrics(sums)}
    return metrics


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
