"""Group-normalized advantages (GRPO, Shao et al. 2024, outcome supervision)."""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, valid: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """A_i = (r_i - mean_g(r)) / (std_g(r) + eps) within each group g.

    Args:
        rewards: (G, K) rewards, one row per group of K rollouts.
        valid: (G, K) bool; invalid rollouts (placeholders) are left out of the group statistics
            and get advantage 0. Default: all valid.
        eps: added to the standard deviation (sample std, ``unbiased=True``).

    Returns:
        (G, K) advantages; a group whose valid rewards are all equal (or with fewer than two
        valid rollouts) gets all zeros, so it contributes no gradient.
    """
    rewards = rewards.double()
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    w = valid.double()  # (G, K)
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))  # drop NaN/inf of invalid
    count = w.sum(dim=1, keepdim=True)  # (G, 1)
    mean = (rewards * w).sum(dim=1, keepdim=True) / count.clamp(min=1)  # (G, 1)
    centered = (rewards - mean) * w  # (G, K)
    var = (centered**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)  # (G, 1)
    adv = centered / (var.sqrt() + eps)
    return torch.where(count > 1, adv, torch.zeros_like(adv)).float()
