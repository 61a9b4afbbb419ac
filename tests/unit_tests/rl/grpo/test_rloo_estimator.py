"""``advantages/rloo.py``: the mean of the group's other rollouts as baseline,
c_i = r_i - sum_{j != i} r_j / (K - 1) = K/(K-1) (r_i - mean_g(r))."""

from __future__ import annotations

import torch

from megatron.rl.grpo.advantages import load_estimator


def centered(name: str, rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    total = (rewards * weights).sum(dim=1, keepdim=True)
    return load_estimator(name).centered(rewards, weights, total, weights.sum(1, keepdim=True))


def test_each_reward_less_the_mean_of_the_others():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 5.0, 0.0]], dtype=torch.float64)
    weights = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    rewards = rewards * weights  # a placeholder's reward is 0 here, as compute passes it
    out = centered("rloo", rewards, weights)
    torch.testing.assert_close(
        out, torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3], [1.0, -1.0, 0.0, 0.0]]).double()
    )


def test_it_is_the_group_mean_difference_times_k_over_k_minus_1():
    rewards = torch.rand(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    weights = torch.ones_like(rewards)
    torch.testing.assert_close(
        centered("rloo", rewards, weights), centered("grpo", rewards, weights) * 6 / 5
    )
