"""REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019): the mean
of the group's *other* rollouts as baseline,

    c_i = r_i - sum_{j != i} r_j / (K - 1) = K/(K-1) (r_i - mean_g(r)).

verl ``algorithm.adv_estimator=rloo``, NeMo-RL ``grpo.use_leave_one_out_baseline``, TRL's
``RLOOTrainer``; as published with ``--scale-rewards none``. With ``group`` the difference is
divided by the group's reward std (NeMo-RL divides by a leave-one-out std instead)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HELP = (
    "REINFORCE leave-one-out (Ahmadian et al. 2024), the mean of the group's other rollouts, "
    "A_i = r_i - sum_{j != i} r_j / (G - 1) ('none' for --scale-rewards as published)"
)
"""Its part of ``--adv-estimator``'s help."""


def centered(
    rewards: torch.Tensor, weights: torch.Tensor, total: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """(G, K) r_i - (sum_g(r) - r_i) / (K - 1) on valid rollouts, 0 elsewhere (``base`` names
    the arguments)."""
    return (rewards - (total - rewards) / (count - 1).clamp(min=1)) * weights
