"""CISPO: clip the importance weight, not the update (MiniMax 2025, "MiniMax-M1", arXiv
2506.13585, section 3.1).

Per loss token, with r_t = pi_theta(y_t) / pi_old(y_t) and eps_high = ``--grpo-clamp-eps-upper``:

    objective_t = sg( min(r_t, 1 + eps_high) ) * A * log pi_theta(y_t)
    loss_t      = -objective_t                       (gradient: -min(r_t, 1 + eps_high) A grad log pi)

Every token keeps a gradient (PPO's clip drops the tokens whose ratio left the range); the weight
is only capped. There is no lower bound: MiniMax-M1 sets its eps_low^IS large and tunes eps_high
only. The loss value includes log pi_theta, so it is not comparable with the clipped surrogate's.

Peers: TRL ``loss_type="cispo"`` (its ``epsilon_high`` is the cap itself: TRL's 5.0, ScaleRL's
eps_max, is ``--grpo-clamp-eps-upper 4`` here), verl ``policy_loss.loss_mode=cispo`` (which also
clips below at 1 - ``clip_ratio_low``), NeMo-RL ``loss_fn.use_cispo``, ROLL
``pg_variant: cispo``.

Metrics: ``clip_fraction`` is the share of loss tokens whose weight was capped,
``cispo_weight_mean`` the mean capped weight per loss token.
"""

from __future__ import annotations

import torch

from megatron.rl.grpo.policy_loss.base import Surrogate

SUMS = ("cispo_weight_mean",)
"""The capped weight summed over the loss tokens (logged per token)."""
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
    """The CISPO objective (module docstring) of (B, T) logprobs, (B, 1) advantages and the
    (B, T) loss mask (``eps_lower`` is not used)."""
    with torch.no_grad():
        ratio = torch.exp((trainer_logprobs.detach() - old_logprobs) * mask)  # (B, T)
        cap = 1.0 + eps_upper
        weight = ratio.clamp(max=cap)
        capped = ((ratio > cap) & (mask > 0)).sum()
        sums = {"cispo_weight_mean": (weight * mask).sum().double()}
    objective = weight * advantages * trainer_logprobs
    return Surrogate(objective, capped.float(), sums)


def metrics(sums: dict[str, float]) -> dict[str, float]:
    """None besides ``cispo_weight_mean``, a per-token sum the loss logs per token."""
    return {}
