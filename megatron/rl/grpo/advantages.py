"""Advantages of a batch of groups: a baseline, then a scale.

Each group g holds the K rollouts of one prompt with rewards r_1..r_K (valid rollouts only:
placeholders are left out of every statistic and get advantage 0). Two baselines
(``AdvantageConfig.estimator``):

* ``grpo`` (Shao et al. 2024, DeepSeekMath): the group mean, c_i = r_i - mean_g(r);
* ``rloo``, REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019):
  the mean of the *other* rollouts, c_i = r_i - sum_{j != i} r_j / (K - 1) = K/(K-1) (r_i -
  mean_g(r)). verl ``algorithm.adv_estimator=rloo``, NeMo-RL
  ``grpo.use_leave_one_out_baseline``, TRL's ``RLOOTrainer``.

and three scales (``AdvantageConfig.scale``, TRL's ``scale_rewards``):

* ``group``: A_i = c_i / (std_g(r) + eps), the sample standard deviation (``unbiased``) of the
  group's rewards (GRPO as published; verl ``norm_adv_by_std_in_grpo=True``);
* ``batch``: A_i = c_i / (std_B(r) + eps), the sample standard deviation of every valid reward of
  the batch (Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning": group
  mean, batch std; TRL ``scale_rewards="batch"``);
* ``none``: A_i = c_i (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training": dividing
  by the group's std weights prompts by their difficulty; verl ``norm_adv_by_std_in_grpo=False``).

The scale always divides by a standard deviation of *rewards*, whatever the baseline, so RLOO with
``group`` is the leave-one-out difference over the group's std (NeMo-RL divides by a
leave-one-out std instead). A group with fewer than two valid rollouts gets all zeros, and so does
a group whose rewards are all equal (c_i = 0 under both baselines): it contributes no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.rl.grpo.names import ESTIMATORS, SCALES


@dataclass(frozen=True)
class AdvantageConfig:
    """The baseline and the scale of the advantages (see the module docstring)."""

    estimator: str
    """``grpo`` (group mean) or ``rloo`` (leave-one-out mean): ``--adv-estimator``."""
    scale: str
    """``group``, ``batch`` or ``none``: ``--scale-rewards``."""
    eps: float = 1e-6
    """Added to the standard deviation before dividing."""

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if self.scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {self.scale!r}")

    @property
    def is_grpo(self) -> bool:
        """GRPO as published: the group mean over the group's std (``group_advantages``)."""
        return self.estimator == "grpo" and self.scale == "group"


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


def advantages(
    rewards: torch.Tensor, valid: torch.Tensor | None, config: AdvantageConfig
) -> torch.Tensor:
    """(G, K) float32 advantages of (G, K) ``rewards`` under ``config``'s baseline and scale.

    ``valid`` as in ``group_advantages``. GRPO with the group scale is ``group_advantages``
    itself (the same operations, so the same bits).
    """
    if config.is_grpo:
        return group_advantages(rewards, valid, config.eps)
    rewards = rewards.double()
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    w = valid.double()  # (G, K)
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    count = w.sum(dim=1, keepdim=True)  # (G, 1)
    total = (rewards * w).sum(dim=1, keepdim=True)  # (G, 1)
    mean = total / count.clamp(min=1)  # (G, 1)
    deviation = (rewards - mean) * w  # (G, K): r_i - mean_g(r) on valid rollouts
    if config.estimator == "rloo":  # r_i - (sum_g(r) - r_i) / (K - 1)
        centered = (rewards - (total - rewards) / (count - 1).clamp(min=1)) * w
    else:
        centered = deviation
    if config.scale == "group":
        var = (deviation**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)  # (G, 1)
        centered = centered / (var.sqrt() + config.eps)
    elif config.scale == "batch":
        centered = centered / (batch_reward_std(rewards, valid) + config.eps)
    return torch.where(count > 1, centered, torch.zeros_like(centered)).float()


def batch_reward_std(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The sample standard deviation (``unbiased``) of the valid entries of ``rewards`` (any
    shape), as a float64 scalar; 0 with fewer than two."""
    values = rewards.double()[valid]
    if values.numel() < 2:
        return torch.zeros((), dtype=torch.float64)
    return values.std()


def advantage_metrics(adv: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """``advantages_{mean,abs_mean,min,max}`` over the valid rollouts (0 without any)."""
    values = adv.double()[valid]
    if values.numel() == 0:
        return {f"advantages_{s}": 0.0 for s in ("mean", "abs_mean", "min", "max")}
    return {
        "advantages_mean": float(values.mean()),
        "advantages_abs_mean": float(values.abs().mean()),
        "advantages_min": float(values.min()),
        "advantages_max": float(values.max()),
    }
