"""Importance-sampling correction of the train/inference mismatch (truncated IS, "TIS").

Rollouts are sampled by the inference engine, whose per-token logprobs differ from the trainer's:
with forced lag L the tokens come from policies up to L updates old, and even at L = 0 the engine's
incremental (KV-cache) forward rounds differently. With the correction on, the PPO ratio is taken
against pi_old, the trainer's own pre-update policy, and each token's surrogate is weighted by

    w_t = min(pi_old(y_t) / pi_inference(y_t), C)        (no gradient through w_t)

where C is the truncation coefficient (Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"). ``mismatch_sums`` measures the mismatch the weights correct.

Modes (``--rl-importance-sampling-mode``, TRL's ``vllm_importance_sampling_mode`` values), with
rho_t = pi_old(y_t) / pi_inference(y_t), C_max = C and C_min = ``--rl-importance-sampling-clip-min``
(none: no lower bound):

    token_truncate     w_t = clip(rho_t, C_min, C_max)                                (TIS; default)
    token_mask         w_t = rho_t if C_min <= rho_t <= C_max else 0                  (MIS; ICE-POP)
    sequence_truncate  w_t = clip(rho_i, C_min, C_max),  rho_i = prod_t rho_t = exp(sum_t log rho_t)
    sequence_mask      w_t = rho_i if C_min <= rho_i <= C_max else 0

The sequence weight is the product over the row's loss tokens (TRL, verl ``rollout_is=sequence``);
NeMo-RL's ``seq-mask-tis`` instead masks by the geometric mean and keeps the token weights. A
masked token (or sequence) keeps its place in the loss's denominator, as in TRL: its weight is 0.
Peers: TRL ``vllm_importance_sampling_mode`` with ``vllm_importance_sampling_clip_min/max``; verl
``algorithm.rollout_correction.rollout_is`` (token / sequence truncation at
``rollout_is_threshold``) and ``rollout_rs`` (rejection); NeMo-RL
``loss_fn.truncated_importance_sampling_type`` ``tis`` / ``icepop`` with
``truncated_importance_sampling_ratio(_min)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.rl.grpo.kl import k3
from megatron.rl.grpo.names import DEFAULT_IS_MODE, IS_MODES


@dataclass(frozen=True)
class ImportanceConfig:
    """Importance-sampling correction with the engine's per-token logprobs: truncated or masked,
    per token or per sequence."""

    truncation_coef: float | None
    """C: weights above C are set to C (None: no truncation). The trainer's default 1
    (``--rl-importance-sampling-truncation-coef``) only ever
    down-weights a token (where the trainer's policy finds it less likely than the engine did):
    with a forced lag, weights above 1 amplify exactly the tokens the policy has already moved
    towards, and on the built-in task at lag 2 the default run's last-10-step reward was 0.86
    with C = 1, 0.68 with C = 1.28 and 0.44 with C = 2 (0.99 without the correction).
    In the ``*_mask`` modes C is the upper bound of the kept range."""
    mode: str
    """One of ``IS_MODES`` (module docstring)."""
    clip_min: float | None
    """C_min: the lower bound (truncation or mask); None: none."""

    @classmethod
    def tis(cls, truncation_coef: float | None) -> ImportanceConfig:
        """Token-level truncated IS at C with no lower bound (``token_truncate``)."""
        return cls(truncation_coef, DEFAULT_IS_MODE, None)

    def __post_init__(self) -> None:
        if self.truncation_coef is not None and not self.truncation_coef > 0:
            raise ValueError(f"truncation_coef must be > 0, got {self.truncation_coef}")
        if self.mode not in IS_MODES:
            raise ValueError(f"mode must be one of {IS_MODES}, got {self.mode!r}")
        if self.clip_min is not None and not (math.isfinite(self.clip_min) and self.clip_min >= 0):
            raise ValueError(f"clip_min must be finite and >= 0, got {self.clip_min}")
        coef = self.truncation_coef
        if self.clip_min is not None and coef is not None and not self.clip_min < coef:
            raise ValueError(f"clip_min ({self.clip_min}) must be < truncation_coef ({coef})")
        if self.sequence_level and coef is None:
            raise ValueError(
                f"{self.mode} needs a truncation_coef (a sequence's weight is a product)"
            )

    @property
    def sequence_level(self) -> bool:
        """One weight per sequence (the product of its token ratios)."""
        return self.mode.startswith("sequence")

    @property
    def masks(self) -> bool:
        """Weights outside [C_min, C] are set to 0 (else clipped into it)."""
        return self.mode.endswith("_mask")


MISMATCH_SUMS = (
    "is/tokens",
    "is/sequences",
    "is/abs_delta_p",
    "is/kl",
    "is/truncated_tokens",
    "is/truncated_sequences",
    "is/weight",
    "is/masked_tokens",
    "is/masked_sequences",
)
"""The names of the sums ``mismatch_sums`` returns."""


def importance_weights(
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    config: ImportanceConfig,
) -> torch.Tensor:
    """(B, T) weights of the mode (module docstring; by default ``min(exp(old - inference), C)``)
    on masked tokens, 1.0 elsewhere (``token_truncate``: min(1, C)).

    Exactly 1.0 where the two logprobs are equal (and 1 lies in the range); never carries a
    gradient.
    """
    log_w = ((old_logprobs - inference_logprobs) * mask).detach()  # (B, T)
    if config.sequence_level:
        log_w = log_w.sum(dim=1, keepdim=True)  # (B, 1): log of the product of the row's ratios
    weights = torch.exp(log_w)
    if not config.masks:
        if config.truncation_coef is not None or config.clip_min is not None:
            weights = weights.clamp(min=config.clip_min, max=config.truncation_coef)
    else:
        weights = torch.where(_outside(weights, config), torch.zeros_like(weights), weights)
    if config.sequence_level or config.masks:  # (token_truncate's masked positions: min(1, C))
        weights = torch.where(mask > 0, weights, torch.ones_like(mask, dtype=weights.dtype))
    return weights


def _outside(weights: torch.Tensor, config: ImportanceConfig) -> torch.Tensor:
    """Bool: the weights outside [C_min, C] (either bound may be absent)."""
    out = torch.zeros_like(weights, dtype=torch.bool)
    if config.truncation_coef is not None:
        out = out | (weights > config.truncation_coef)
    if config.clip_min is not None:
        out = out | (weights < config.clip_min)
    return out


def mismatch_sums(
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    config: ImportanceConfig,
) -> dict[str, torch.Tensor]:
    """Float64 sums over the masked tokens of a micro-batch, by name (``is/...``).

    * ``is/abs_delta_p``: |pi_old(y) - pi_inference(y)|, per token;
    * ``is/kl``: k3 estimate of KL(pi_inference || pi_old) (the tokens are pi_inference's samples);
    * ``is/truncated_tokens`` / ``is/truncated_sequences``: tokens whose weight was clipped (above
      C, or below C_min; in the sequence modes every token of a clipped sequence), and rows with
      at least one such token (rows without masked tokens are not counted in ``is/sequences``);
    * ``is/masked_tokens`` / ``is/masked_sequences``: the same for the weights the ``*_mask``
      modes set to 0;
    * ``is/weight``: the (truncated or masked) importance weight;
    * ``is/tokens``, ``is/sequences``: the counts ``mismatch_metrics`` divides by.

    Add them over micro-batches and ranks, then call ``mismatch_metrics``.
    """
    with torch.no_grad():
        m = mask.double()
        log_w = (old_logprobs.double() - inference_logprobs.double()) * m  # (B, T)
        delta_p = (old_logprobs.double().exp() - inference_logprobs.double().exp()).abs() * m
        raw = log_w.exp()  # (B, T) the token ratios
        if config.sequence_level:
            raw = log_w.sum(dim=1, keepdim=True).exp().expand_as(m)  # the row's product
        out = _outside(raw, config) & (m > 0)  # (B, T)
        none = torch.zeros_like(out)
        cut, dropped = (none, out) if config.masks else (out, none)
        has_tokens = m.sum(dim=1) > 0  # (B,)
        weight = importance_weights(old_logprobs, inference_logprobs, mask, config).double() * m
        sums = [
            m.sum(),
            has_tokens.double().sum(),
            delta_p.sum(),
            (k3(log_w) * m).sum(),
            cut.double().sum(),
            (cut.any(dim=1) & has_tokens).double().sum(),
            weight.sum(),
            dropped.double().sum(),
            (dropped.any(dim=1) & has_tokens).double().sum(),
        ]
        return {name: value.cpu() for name, value in zip(MISMATCH_SUMS, sums)}


def mismatch_metrics(
    sums: dict[str, float], config: ImportanceConfig | None = None
) -> dict[str, float]:
    """The logged ``is_*`` metrics from the global ``is/...`` sums of ``mismatch_sums``; with a
    ``*_mask`` mode also ``is_masked_fraction`` and ``is_masked_sequence_fraction``."""
    tokens, sequences = max(sums["is/tokens"], 1.0), max(sums["is/sequences"], 1.0)
    metrics = {
        "is_abs_delta_p": sums["is/abs_delta_p"] / tokens,
        "is_kl": sums["is/kl"] / tokens,
        "is_weight_mean": sums["is/weight"] / tokens,
        "is_truncated_fraction": sums["is/truncated_tokens"] / tokens,
        "is_truncated_sequence_fraction": sums["is/truncated_sequences"] / sequences,
    }
    if config is not None and config.masks:
        metrics["is_masked_fraction"] = sums["is/masked_tokens"] / tokens
        metrics["is_masked_sequence_fraction"] = sums["is/masked_sequences"] / sequences
    return metrics
