"""``advantages/grpo.py``: the group mean as baseline, c_i = r_i - mean_g(r)."""

from __future__ import annotations

import torch

from megatron.rl.grpo.advantages import load_estimator


def test_the_group_mean_is_subtracted_from_the_valid_rewards():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 0.0], [1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    weights = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    total = (rewards * weights).sum(dim=1, keepdim=True)
    out = load_estimator("grpo").centered(rewards, weights, total, weights.sum(1, keepdim=True))
    assert out.tolist() == [[-1.0, 0.0, 1.0, 0.0], [0.5, -0.5, -0.5, 0.5]]
