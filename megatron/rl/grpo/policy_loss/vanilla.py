"""The clipped token-level surrogate (the default): GRPO (Shao et al. 2024) with DAPO's decoupled
clip range ("clip-higher", Yu et al. 2025).

Per loss token, with r_t = pi_theta(y_t) / pi_old(y_t) (pi_old: the engine's logprobs, or the
trainer's pre-update policy with ``--grpo-iterations`` > 1 or the IS correction):

    objective_t = min( r_t A, clip(r_t, 1 - eps_lower, 1 + eps_upper) A )

A token whose clip binds contributes no gradient. Peers: verl ``policy_loss.loss_mode=vanilla``,
TRL's default surrogate (``epsilon``, ``epsilon_high``), NeMo-RL ``loss_fn.ratio_clip_min/max``.

Metrics: ``clip_fraction`` (the share of loss tokens whose clip binds); no sums of its own.
"""

from __future__ import annotations

import torch

from megatron.rl.grpo.policy_loss.base import Surrogate

SUMS: tuple[str, ...] = ()
"""No metric sums besides the loss's own."""
TOKEN_ADVANTAGES = True
"""Per-token objective: (B, T) advantages broadcast as (B, 1) ones do."""


def surrogate(
    trainer_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_lower: float,
    eps_upper: float,
) -> Surrogate:
    """The clipped surrogate (module docstring) of (B, T) logprobs, (B, 1) advantages and the
    (B, T) loss mask."""
    ratio = torch.exp((trainer_logprobs - old_logprobs) * mask)  # (B, T)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_lower, 1.0 + eps_upper) * advantages
    objective = torch.minimum(unclipped, clipped)  # (B, T)
    with torch.no_grad():
        was_clipped = ((clipped < unclipped) & (mask > 0)).sum()
    return Surrogate(objective, was_clipped.float())


def metrics(sums: dict[str, float]) -> dict[str, float]:
    """None: ``clip_fraction`` is the loss's own metric."""
    return {}
