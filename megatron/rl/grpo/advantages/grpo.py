"""GRPO's baseline (Shao et al. 2024, DeepSeekMath): the group mean, c_i = r_i - mean_g(r).

With ``--scale-rewards group`` this is GRPO as published (verl ``norm_adv_by_std_in_grpo=True``);
with ``none`` Dr. GRPO (Liu et al. 2025)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HELP = "the group's mean reward"
"""Its part of ``--adv-estimator``'s help."""


def centered(
    rewards: torch.Tensor, weights: torch.Tensor, total: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """(G, K) r_i - mean_g(r) on valid rollouts, 0 elsewhere (``base`` names the arguments)."""
    mean = total / count.clamp(min=1)  # (G, 1)
    return (rewards - mean) * weights
