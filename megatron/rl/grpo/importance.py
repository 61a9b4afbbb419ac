"""Importance-sampling correction of the train/inference mismatch (truncated IS, "TIS").

Rollouts are sampled by the inference engine, whose per-token logprobs differ from the trainer's:
with forced lag L the tokens come from policies up to L updates old, and even at L = 0 the engine's
incremental (KV-cache) forward rounds differently. With the correction on, the PPO ratio is taken
against pi_old, the trainer's own pre-update policy, and each token's surrogate is weighted by

    w_t = min(pi_old(y_t) / pi_inference(y_t), C)        (no gradient through w_t)

where C is the truncation coefficient (Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training"). ``mismatch_sums`` measures the mismatch the weights correct.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.rl.grpo.kl import k3


@dataclass(frozen=True)
class ImportanceConfig:
    """Truncated importance-sampling correction with the engine's per-token logprobs."""

    truncation_coef: float | None
    """C: weights above C are set to C (None: no truncation). The trainer's default 1
    (``--rl-importance-sampling-truncation-coef``) only ever
    down-weights a token (where the trainer's policy finds it less likely than the engine did):
    with a forced lag, weights above 1 amplify exactly the tokens the policy has already moved
    towards, and on the built-in task at lag 2 the default run's last-10-step reward was 0.86
    with C = 1, 0.68 with C = 1.28 and 0.44 with C = 2 (0.99 without the correction)."""

    def __post_init__(self) -> None:
        if self.truncation_coef is not None and not self.truncation_coef > 0:
            raise ValueError(f"truncation_coef must be > 0, got {self.truncation_coef}")


MISMATCH_SUMS = (
    "is/tokens",
    "is/sequences",
    "is/abs_delta_p",
    "is/kl",
    "is/truncated_tokens",
    "is/truncated_sequences",
    "is/weight",
)
"""The names of the sums ``mismatch_sums`` returns."""


def importance_weights(
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    config: ImportanceConfig,
) -> torch.Tensor:
    """(B, T) weights ``min(exp(old - inference), C)`` on masked tokens, 1.0 elsewhere.

    Exactly 1.0 where the two logprobs are equal; never carries a gradient.
    """
    log_w = ((old_logprobs - inference_logprobs) * mask).detach()  # (B, T)
    weights = torch.exp(log_w)
    if config.truncation_coef is not None:
        weights = weights.clamp(max=config.truncation_coef)
    return weights


def mismatch_sums(
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    config: ImportanceConfig,
) -> dict[str, torch.Tensor]:
    """Float64 sums over the masked tokens of a micro-batch, by name (``is/...``).

    * ``is/abs_delta_p``: |pi_old(y) - pi_inference(y)|, per token;
    * ``is/kl``: k3 estimate of KL(pi_inference || pi_old) (the tokens are pi_inference's samples);
    * ``is/truncated_tokens`` / ``is/truncated_sequences``: tokens whose weight exceeded C, and
      rows with at least one such token (rows without masked tokens are not counted in
      ``is/sequences``);
    * ``is/weight``: the (truncated) importance weight;
    * ``is/tokens``, ``is/sequences``: the counts ``mismatch_metrics`` divides by.

    Add them over micro-batches and ranks, then call ``mismatch_metrics``.
    """
    with torch.no_grad():
        m = mask.double()
        log_w = (old_logprobs.double() - inference_logprobs.double()) * m  # (B, T)
        delta_p = (old_logprobs.double().exp() - inference_logprobs.double().exp()).abs() * m
        cut = torch.zeros_like(m, dtype=torch.bool)
        if config.truncation_coef is not None:
            cut = (log_w.exp() > config.truncation_coef) & (m > 0)  # (B, T)
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
        ]
        return {name: value.cpu() for name, value in zip(MISMATCH_SUMS, sums)}


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The logged ``is_*`` metrics from the global ``is/...`` sums of ``mismatch_sums``."""
    tokens, sequences = max(sums["is/tokens"], 1.0), max(sums["is/sequences"], 1.0)
    return {
        "is_abs_delta_p": sums["is/abs_delta_p"] / tokens,
        "is_kl": sums["is/kl"] / tokens,
        "is_weight_mean": sums["is/weight"] / tokens,
        "is_truncated_fraction": sums["is/truncated_tokens"] / tokens,
        "is_truncated_sequence_fraction": sums["is/truncated_sequences"] / sequences,
    }
