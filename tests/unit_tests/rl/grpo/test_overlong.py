"""Hand-computed values of DAPO's soft overlong penalty, of what it measures on a rollout (the
longest model turn against the recorded budget), of the shaped rewards, their metrics and masked
rows, and of the advantages computed from them."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.advantages.compute import AdvantageConfig
from megatron.rl.grpo.batch import batch_advantages, shaped_advantages
from megatron.rl.grpo.overlong import (
    CompletionLength,
    OverlongConfig,
    completion_length,
    overlong_penalty,
    shape_rewards,
)
from megatron.rl.wire import RolloutGroup, TokenRollout


@pytest.mark.parametrize(
    "length, max_len, buffer_len, factor, expected",
    [
        pytest.param(1, 16, 4, 1.0, 0.0, id="single-token"),
        pytest.param(12, 16, 4, 1.0, 0.0, id="at-the-buffer-start"),
        pytest.param(13, 16, 4, 1.0, -0.25, id="one-into-the-buffer"),
        pytest.param(14, 16, 4, 1.0, -0.5, id="half-way"),
        pytest.param(16, 16, 4, 1.0, -1.0, id="at-the-budget"),
        pytest.param(17, 16, 4, 1.0, -1.0, id="beyond-the-budget"),
        pytest.param(14, 16, 4, 0.5, -0.25, id="factor-scales"),
        pytest.param(16, 16, 0, 1.0, 0.0, id="no-buffer-no-penalty"),
        pytest.param(0, 16, 16, 1.0, 0.0, id="whole-budget-buffer-empty"),
        pytest.param(1, 16, 16, 1.0, -1 / 16, id="whole-budget-buffer-one-token"),
    ],
)
def test_overlong_penalty_hand_computed(length, max_len, buffer_len, factor, expected):
    assert overlong_penalty(length, max_len, buffer_len, factor) == pytest.approx(expected)


def rollout(generated: int, reward: float = 1.0, **recorded) -> TokenRollout:
    """A rollout of a 2-token prompt and ``generated`` tokens, with what its agent recorded."""
    return TokenRollout(
        env_id="e",
        problem_id="p",
        prompt="",
        completion="",
        reward=reward,
        tokens=[5, 6] + [7] * generated,
        generation_mask=[False, False] + [True] * generated,
        logprobs=[-1.0] * generated,
        policy_versions=[0] * generated,
        submission_policy_version=0,
        **recorded,
    )


def placeholder() -> TokenRollout:
    return TokenRollout(
        env_id="e",
        problem_id="p",
        prompt="",
        completion="",
        reward=0.0,
        error="boom",
        tokens=[],
        generation_mask=[],
        logprobs=[],
        policy_versions=[],
        submission_policy_version=0,
    )


@pytest.mark.parametrize(
    "recorded, generated, expected",
    [
        pytest.param(
            dict(max_tokens=8, turn_lengths=[5], truncated=False),
            5,
            CompletionLength(5, 8, False),
            id="single-turn-recorded",
        ),
        pytest.param(
            dict(max_tokens=8, turn_lengths=[3, 8, 2], truncated=True),
            13,
            CompletionLength(8, 8, True),
            id="multi-turn-longest-turn",
        ),
        pytest.param(
            dict(max_tokens=8, turn_lengths=[8], truncated=False),
            8,
            CompletionLength(8, 8, False),
            id="stop-token-at-the-budget",
        ),
        pytest.param(
            dict(max_tokens=32), 20, CompletionLength(20, 32, False), id="environment-budget"
        ),
        pytest.param({}, 16, CompletionLength(16, 16, True), id="unrecorded-at-default-budget"),
        pytest.param({}, 4, CompletionLength(4, 16, False), id="unrecorded-short"),
    ],
)
def test_completion_length_reads_what_the_rollout_recorded(recorded, generated, expected):
    assert completion_length(rollout(generated, **recorded), default_max_tokens=16) == expected


CONFIG = OverlongConfig(
    buffer_len=4, penalty_factor=1.0, mask_truncated=True, default_max_tokens=16
)


def test_shaped_rewards_metrics_and_masked_rows_hand_computed():
    """Budget 16, buffer 4: a single-token completion (no penalty), one truncated at the budget
    (-1, masked), one of 14 tokens that stopped (-0.5), a placeholder (left out)."""
    group = RolloutGroup(
        batch_id=0,
        index_in_batch=0,
        rollouts=[
            rollout(1, 1.0, max_tokens=16, turn_lengths=[1], truncated=False),
            rollout(16, 0.0, max_tokens=16, turn_lengths=[16], truncated=True),
            rollout(14, 1.0, max_tokens=16, turn_lengths=[14], truncated=False),
            placeholder(),
        ],
    )
    shaped = shape_rewards([group], CONFIG)
    assert shaped.penalties.tolist() == [0.0, -1.0, -0.5, 0.0]
    assert shaped.rewards.tolist() == [1.0, -1.0, 0.5, 0.0]
    assert shaped.truncated.tolist() == shaped.masked.tolist() == [False, True, False, False]
    assert shaped.metrics() == {
        "truncated_fraction": 1 / 3,
        "overlong_penalty_mean": -0.5,
        "overlong_penalized_fraction": 2 / 3,
        "truncated_masked_rollouts": 1,
    }
    # GRPO over the shaped 1, -1, 0.5: mean 1/6, sample var 39/36; the masked row keeps its own
    result = shaped_advantages([group], AdvantageConfig("grpo", "group"), CONFIG)
    expected = [5 / math.sqrt(39), -7 / math.sqrt(39), 2 / math.sqrt(39), 0.0]
    torch.testing.assert_close(result.advantages, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert result.masked.tolist() == [False, True, False, False]
    assert result.metrics["truncated_masked_rollouts"] == 1
    assert result.metrics["advantages_min"] == pytest.approx(-7 / math.sqrt(39), rel=1e-6)


def test_lengths_break_a_tie_of_equal_rewards():
    """All-equal rewards: no signal without shaping; 12 and 14 tokens of a 16 budget with a buffer
    of 4 shape them into 1 and 0.5 (GRPO: +-1/sqrt(2)); equal lengths leave them tied."""
    tied = RolloutGroup(
        batch_id=0,
        index_in_batch=0,
        rollouts=[
            rollout(12, max_tokens=16, turn_lengths=[12], truncated=False),
            rollout(14, max_tokens=16, turn_lengths=[14], truncated=False),
        ],
    )
    assert batch_advantages([tied], AdvantageConfig("grpo", "group")).tolist() == [0.0, 0.0]
    shaped = shaped_advantages([tied], AdvantageConfig("grpo", "group"), CONFIG)
    torch.testing.assert_close(shaped.advantages, torch.tensor([1.0, -1.0]) / math.sqrt(2))
    same = RolloutGroup(batch_id=0, index_in_batch=0, rollouts=[tied.rollouts[1]] * 2)
    assert shaped_advantages(
        [same], AdvantageConfig("rloo", "none"), CONFIG
    ).advantages.tolist() == [0.0, 0.0]


def test_only_the_options_that_are_on_log_metrics():
    group = RolloutGroup(batch_id=0, index_in_batch=0, rollouts=[rollout(16), rollout(3)])
    penalty_only = OverlongConfig(4, 1.0, mask_truncated=False, default_max_tokens=16)
    mask_only = OverlongConfig(0, 1.0, mask_truncated=True, default_max_tokens=16)
    assert set(shape_rewards([group], penalty_only).metrics()) == {
        "truncated_fraction",
        "overlong_penalty_mean",
        "overlong_penalized_fraction",
    }
    masked = shape_rewards([group], mask_only)
    assert masked.metrics() == {"truncated_fraction": 0.5, "truncated_masked_rollouts": 1}
    assert masked.rewards.tolist() == [1.0, 1.0]  # no penalty without a buffer
    assert not shape_rewards([group], penalty_only).masked.any()


def test_turn_lengths_must_add_up_to_the_generated_tokens():
    with pytest.raises(ValueError, match="turn_lengths"):
        rollout(5, max_tokens=8, turn_lengths=[2, 2], truncated=False)


def test_a_bad_config_is_refused():
    with pytest.raises(ValueError, match="buffer_len"):
        OverlongConfig(-1, 1.0, mask_truncated=False, default_max_tokens=16)
