"""The k3 estimator of a KL divergence from per-token log-probabilities (Schulman, 2020).

For tokens sampled from q and another policy p, with log r = log p - log q per token,
``k3 = r - 1 - log r`` is an unbiased, always non-negative estimate of KL(q || p). GRPO (Shao et
al. 2024) uses it for the penalty towards the reference policy: with samples from pi_theta,
``k3 = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1`` estimates KL(pi_theta || pi_ref).
"""

from __future__ import annotations

import torch


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(x) - x - 1`` elementwise (>= 0, and exactly 0 where ``x == 0``)."""
    return torch.exp(log_ratio) - log_ratio - 1.0


def reference_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref), differentiable w.r.t. ``logprobs``.

    Args:
        logprobs: (B, T) log pi_theta of the sampled tokens.
        ref_logprobs: (B, T) log pi_ref of the same tokens (no gradient).
        mask: (B, T) 1.0 on tokens that count; elsewhere the estimate is 0 (and finite).

    Returns:
        (B, T) ``exp(d) - d - 1`` with ``d = (ref_logprobs - logprobs) * mask``.
    """
    return k3((ref_logprobs - logprobs) * mask)
