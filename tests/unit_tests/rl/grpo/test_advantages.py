"""Hand-computed values of ``advantages/compute.advantages``: GRPO's group normalization (sample
std), the RLOO baseline, the batch and no scale; the configs it refuses and its metrics."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.advantages.compute import AdvantageConfig, advantage_metrics, advantages

GRPO = AdvantageConfig("grpo", "group")


def group_advantages(rewards: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO's advantages (the group mean over the group's std)."""
    return advantages(rewards, valid, GRPO)


S3 = math.sqrt(3) / 2  # (1 - 0.5) / sqrt(1/3): z-score of a 0/1 reward in a half-right group of 4


@pytest.mark.parametrize(
    "rewards, valid, expected",
    [
        pytest.param([[1, 0, 0, 1]], None, [[S3, -S3, -S3, S3]], id="half-right-group-of-4"),
        pytest.param([[3, 1]], None, [[1 / math.sqrt(2), -1 / math.sqrt(2)]], id="pair-3-1"),
        # mean 2, sample var (1 + 0 + 1) / 2 = 1
        pytest.param([[1, 2, 3]], None, [[-1.0, 0.0, 1.0]], id="1-2-3-unit-std"),
        pytest.param([[0.7, 0.7, 0.7]], None, [[0.0, 0.0, 0.0]], id="constant-group-is-zero"),
        pytest.param(
            [[1, 0, 5, 1]],
            [[True, True, False, False]],
            [[1 / math.sqrt(2), -1 / math.sqrt(2), 0.0, 0.0]],
            id="placeholders-excluded-and-zero",
        ),
        pytest.param(
            [[1, 0, 0]], [[True, False, False]], [[0.0, 0.0, 0.0]], id="single-valid-is-zero"
        ),
        pytest.param([[2, 4, 6]], [[False] * 3], [[0.0, 0.0, 0.0]], id="no-valid-is-zero"),
        pytest.param(
            [[1, 0, 0, 1], [1, 2, 3, 2], [5, 5, 5, 5]],
            None,
            [
                [S3, -S3, -S3, S3],
                # mean 2, sample var (1 + 0 + 1 + 0) / 3 = 2/3
                [-math.sqrt(1.5), 0.0, math.sqrt(1.5), 0.0],
                [0.0, 0.0, 0.0, 0.0],
            ],
            id="groups-are-independent",
        ),
    ],
)
def test_group_advantages_hand_computed(rewards, valid, expected):
    valid_t = None if valid is None else torch.tensor(valid)
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float32), valid_t)
    assert adv.dtype == torch.float32
    assert adv.shape == torch.Size([len(rewards), len(rewards[0])])
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_placeholder_reward_value_does_not_change_other_advantages():
    valid = torch.tensor([[True, True, True, False]])
    a = group_advantages(torch.tensor([[1.0, 0.0, 0.5, 0.0]]), valid)
    b = group_advantages(torch.tensor([[1.0, 0.0, 0.5, 123.0]]), valid)
    torch.testing.assert_close(a, b)
    assert a[0, 3] == 0


def test_group_statistics_do_not_leak_across_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [9.0, -3.0, 4.0, 0.5]])
    alone = group_advantages(rewards[:1])
    together = group_advantages(rewards)
    torch.testing.assert_close(together[:1], alone)


def test_advantages_are_zero_mean_and_unit_sample_std_per_group():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(5, 8, generator=g)
    adv = group_advantages(rewards).double()
    torch.testing.assert_close(
        adv.mean(dim=1), torch.zeros(5, dtype=torch.float64), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        adv.std(dim=1), torch.ones(5, dtype=torch.float64), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_reward_of_invalid_rollout_is_left_out(bad):
    """Placeholders are "left out of the group statistics", whatever their reward value."""
    valid = torch.tensor([[True, True, False, True]])
    adv = group_advantages(torch.tensor([[1.0, 0.0, bad, 1.0]]), valid)
    # valid rewards 1, 0, 1: mean 2/3, sample std sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected = torch.tensor([[(1 / 3) / s, (-2 / 3) / s, 0.0, (1 / 3) / s]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------ other baselines and scales (``advantages``)

R3 = 2 / math.sqrt(3)  # RLOO of a half-right group of 4: (1 - 1/3) / sqrt(1/3)


@pytest.mark.parametrize(
    "estimator, scale, rewards, valid, expected",
    [
        # RLOO, unscaled: A_i = r_i - mean of the others
        pytest.param(
            "rloo",
            "none",
            [[1, 0, 0, 0]],
            None,
            [[1.0, -1 / 3, -1 / 3, -1 / 3]],
            id="rloo-none-one-right-of-4",
        ),
        pytest.param("rloo", "none", [[1, 2, 3]], None, [[-1.5, 0.0, 1.5]], id="rloo-none-1-2-3"),
        pytest.param(
            "rloo",
            "none",
            [[0.7, 0.7, 0.7]],
            None,
            [[0.0, 0.0, 0.0]],
            id="rloo-all-equal-is-zero",
        ),
        pytest.param(
            "rloo",
            "none",
            [[1, 0, 5, 1]],
            [[True, True, False, False]],
            [[1.0, -1.0, 0.0, 0.0]],
            id="rloo-placeholders-excluded-and-zero",
        ),
        pytest.param(
            "rloo",
            "none",
            [[4, 0, 0]],
            [[True, False, False]],
            [[0.0, 0.0, 0.0]],
            id="rloo-single-valid-is-zero",
        ),
        # RLOO over the group's reward std (sample std 1 for 1 2 3; sqrt(1/3) for 1 0 0 1)
        pytest.param("rloo", "group", [[1, 2, 3]], None, [[-1.5, 0.0, 1.5]], id="rloo-group-1-2-3"),
        pytest.param(
            "rloo", "group", [[1, 0, 0, 1]], None, [[R3, -R3, -R3, R3]], id="rloo-group-half-right"
        ),
        # Dr. GRPO: the group mean, unscaled
        pytest.param("grpo", "none", [[1, 2, 3]], None, [[-1.0, 0.0, 1.0]], id="grpo-none-1-2-3"),
        pytest.param(
            "grpo", "none", [[1, 0, 0, 1]], None, [[0.5, -0.5, -0.5, 0.5]], id="grpo-none-half"
        ),
        # batch std of 1 0 3 3: mean 1.75, sample var (0.5625 + 3.0625 + 2 x 1.5625) / 3 = 2.25
        pytest.param(
            "grpo",
            "batch",
            [[1, 0], [3, 3]],
            None,
            [[1 / 3, -1 / 3], [0.0, 0.0]],
            id="grpo-batch-two-groups",
        ),
        pytest.param(
            "rloo",
            "batch",
            [[1, 0], [3, 3]],
            None,
            [[2 / 3, -2 / 3], [0.0, 0.0]],
            id="rloo-batch-two-groups",
        ),
        # the placeholder's 9 is not in the batch std: std(1, 0) = sqrt(1/2)
        pytest.param(
            "grpo",
            "batch",
            [[1, 0, 9]],
            [[True, True, False]],
            [[math.sqrt(0.5), -math.sqrt(0.5), 0.0]],
            id="grpo-batch-placeholder-left-out",
        ),
        pytest.param(
            "rloo",
            "batch",
            [[2, 2], [2, 2]],
            None,
            [[0.0, 0.0], [0.0, 0.0]],
            id="batch-all-equal-is-zero",
        ),
    ],
)
def test_estimators_and_scales_hand_computed(estimator, scale, rewards, valid, expected):
    valid_t = None if valid is None else torch.tensor(valid)
    config = AdvantageConfig(estimator, scale)
    adv = advantages(torch.tensor(rewards, dtype=torch.float64), valid_t, config)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def published_grpo(rewards: torch.Tensor, valid: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantages written out as the golden values were made: float64 group statistics,
    float32 result."""
    rewards, w = rewards.double(), valid.double()
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    count = w.sum(dim=1, keepdim=True)
    mean = (rewards * w).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = (rewards - mean) * w
    var = (centered**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
    adv = centered / (var.sqrt() + eps)
    return torch.where(count > 1, adv, torch.zeros_like(adv)).float()


def test_grpo_with_the_group_scale_is_the_published_formula_bit_for_bit():
    rewards = torch.rand(5, 8, generator=torch.Generator().manual_seed(0))
    valid = torch.rand(5, 8, generator=torch.Generator().manual_seed(1)) > 0.2
    assert torch.equal(advantages(rewards, valid, GRPO), published_grpo(rewards, valid))


def test_rloo_is_the_group_mean_difference_times_k_over_k_minus_1():
    rewards = torch.rand(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    rloo = advantages(rewards, None, AdvantageConfig("rloo", "none"))
    grpo = advantages(rewards, None, AdvantageConfig("grpo", "none"))
    torch.testing.assert_close(rloo, grpo * 6 / 5)


@pytest.mark.parametrize(
    "estimator, scale, needle",
    [
        pytest.param("gae", "group", "estimator", id="estimator"),
        pytest.param("grpo", "std", "scale", id="scale"),
    ],
)
def test_an_unknown_estimator_or_scale_is_refused(estimator, scale, needle):
    with pytest.raises(ValueError, match=needle):
        AdvantageConfig(estimator, scale)


def test_advantage_metrics_cover_the_valid_rollouts_only():
    adv = torch.tensor([1.0, -0.5, -0.5, 7.0])
    valid = torch.tensor([True, True, True, False])
    assert advantage_metrics(adv, valid) == {
        "advantages_mean": 0.0,
        "advantages_abs_mean": 2 / 3,
        "advantages_min": -0.5,
        "advantages_max": 1.0,
    }
    assert advantage_metrics(adv, torch.zeros(4, dtype=torch.bool))["advantages_max"] == 0.0
