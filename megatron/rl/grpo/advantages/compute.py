"""Advantages of a batch of groups: an estimator's baseline, then a scale; the one place they
are computed.

Each group g holds the K rollouts of one prompt with rewards r_1..r_K (valid rollouts only:
placeholders are left out of every statistic and get advantage 0). The estimator
(``AdvantageConfig.estimator``, a module of this package) gives the centered rewards c_i; the
scale (``AdvantageConfig.scale``, TRL's ``scale_rewards``) divides them:

* ``group``: A_i = c_i / (std_g(r) + eps), the sample standard deviation (``unbiased``) of the
  group's rewards (GRPO as published; verl ``norm_adv_by_std_in_grpo=True``);
* ``batch``: A_i = c_i / (std_B(r) + eps), the sample standard deviation of every valid reward of
  the batch (Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning": group
  mean, batch std; TRL ``scale_rewards="batch"``);
* ``none``: A_i = c_i (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training": dividing
  by the group's std weights prompts by their difficulty; verl ``norm_adv_by_std_in_grpo=False``).

The scale always divides by a standard deviation of *rewards*, whatever the baseline. A group
with fewer than two valid rollouts gets all zeros, and so does a group whose rewards are all
equal (c_i = 0 under every estimator): it contributes no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.rl.grpo.advantages import estimators, load_estimator
from megatron.rl.grpo.names import SCALES


@dataclass(frozen=True)
class AdvantageConfig:
    """The baseline and the scale of the advantages (see the module docstring)."""

    estimator: str
    """One of ``estimators()`` (``grpo``: group mean; ``rloo``: leave-one-out mean):
    ``--adv-estimator``."""
    scale: str
    """``group``, ``batch`` or ``none``: ``--scale-rewards``."""
    eps: float = 1e-6
    """Added to the standard deviation before dividing."""

    def __post_init__(self) -> None:
        if self.estimator not in estimators():
            raise ValueError(f"estimator must be one of {estimators()}, got {self.estimator!r}")
        if self.scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {self.scale!r}")

    @property
    def is_grpo(self) -> bool:
        """GRPO as published: the group mean over the group's std."""
        return self.estimator == "grpo" and self.scale == "group"


def advantages(
    rewards: torch.Tensor, valid: torch.Tensor | None, config: AdvantageConfig
) -> torch.Tensor:
    """(G, K) float32 advantages of (G, K) ``rewards`` (one row per group) under ``config``'s
    estimator and scale.

    ``valid``: (G, K) bool; invalid rollouts (placeholders) are left out of the group statistics
    and get advantage 0 (None: all valid). The statistics are float64 (sample std).
    """
    rewards = rewards.double()
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    w = valid.double()  # (G, K)
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))  # drop NaN/inf of invalid
    count = w.sum(dim=1, keepdim=True)  # (G, 1)
    total = (rewards * w).sum(dim=1, keepdim=True)  # (G, 1)
    centered = load_estimator(config.estimator).centered(rewards, w, total, count)
    if config.scale == "group":
        deviation = (rewards - total / count.clamp(min=1)) * w  # r_i - mean_g(r) on valid ones
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
