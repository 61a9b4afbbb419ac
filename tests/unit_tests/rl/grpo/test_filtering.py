"""Dynamic sampling: the first P groups with differing rewards, in (round, index) order; a short
batch trains on those, the rest masked."""

from __future__ import annotations

import pytest

from megatron.rl.grpo.filtering import (
    DynamicSamplingConfig,
    has_reward_variance,
    select_groups,
)
from megatron.rl.wire import RolloutGroup, TokenRollout


def rollout(reward: float, placeholder: bool = False) -> TokenRollout:
    return TokenRollout(
        env_id="e",
        problem_id="p",
        prompt="",
        completion="",
        reward=reward,
        error="boom" if placeholder else None,
        tokens=[] if placeholder else [3, 4],
        generation_mask=[] if placeholder else [False, True],
        logprobs=[] if placeholder else [-1.0],
        policy_versions=[] if placeholder else [0],
        submission_policy_version=0,
        temperature=1.0,
    )


def group(index: int, *rewards: float, placeholders: int = 0) -> RolloutGroup:
    rollouts = [rollout(r) for r in rewards] + [rollout(0.5, True)] * placeholders
    return RolloutGroup(batch_id=7, index_in_batch=index, rollouts=rollouts)


@pytest.mark.parametrize(
    "g, expected",
    [
        pytest.param(group(0, 1, 1, 1), False, id="all-equal"),
        pytest.param(group(0, 0, 1, 1), True, id="one-differs"),
        pytest.param(group(0, 1, placeholders=2), False, id="one-valid-rollout"),
        pytest.param(group(0, 1, 1, placeholders=1), False, id="placeholder-not-counted"),
        pytest.param(group(0, 0, 1, placeholders=1), True, id="two-valid-differ"),
    ],
)
def test_reward_variance(g, expected):
    assert has_reward_variance(g) is expected


def test_keeps_first_groups_with_variance_and_reports_rounds():
    # P = 2, R = 3: round 0 = indices 0, 1; round 1 = 2, 3; round 2 = 4, 5
    groups = [
        group(0, 1, 1),  # dropped
        group(1, 0, 1),  # kept
        group(2, 0, 0),  # dropped
        group(3, 0.5, 1),  # kept -> batch full in round 2
        group(4, 0, 1),
        group(5, 0, 1),
    ]
    out = select_groups(groups, DynamicSamplingConfig(2, 3))
    assert [g.index_in_batch for g in out.groups] == [1, 3]
    assert out.dropped == 2 and out.rounds_used == 2 and out.kept == 2


def test_first_round_suffices():
    groups = [group(0, 0, 1), group(1, 0, 1), group(2, 1, 1), group(3, 1, 1)]
    out = select_groups(groups, DynamicSamplingConfig(2, 2))
    assert [g.index_in_batch for g in out.groups] == [0, 1]
    assert out.dropped == 0 and out.rounds_used == 1


@pytest.mark.parametrize("rounds", [1, 2], ids=["one-round", "two-rounds"])
def test_a_short_batch_trains_on_the_groups_that_remain_and_masks_the_rest(rounds):
    groups = [group(0, 0, 1), group(1, 1, 1), group(2, 1, 1), group(3, 0, 0)][: 2 * rounds]
    out = select_groups(groups, DynamicSamplingConfig(2, rounds))
    assert out.kept == 1 and out.rounds_used == rounds
    assert out.dropped == (1 if rounds == 1 else 3)
    assert [g.index_in_batch for g in out.groups] == [0, 1]  # kept, then the first dropped
    assert not any(r.is_placeholder for r in out.groups[0].rollouts)
    masked = out.groups[1].rollouts
    assert all(r.is_placeholder and "dynamic sampling" in r.error for r in masked)
    assert [r.tokens for r in masked] == [r.tokens for r in groups[1].rollouts]


def test_masked_groups_carry_no_loss_and_the_mean_is_over_kept_tokens():
    from grpo_testing.batches import build_train_batch

    groups = [group(0, 0, 1), group(1, 1, 1)]
    out = select_groups(groups, DynamicSamplingConfig(2, 1))
    batch = build_train_batch(out.groups, pad_id=0)
    assert batch.num_rows == 4  # shapes do not depend on what was dropped
    assert batch.loss_mask[2:].sum() == 0 and batch.advantages[2:].abs().sum() == 0
    assert batch.num_loss_tokens == 2  # the token-mean loss divides by the kept group's tokens


@pytest.mark.parametrize(
    "count",
    [
        pytest.param(1, id="less-than-a-round"),
        pytest.param(3, id="part-of-a-round"),
        pytest.param(6, id="more-rounds-than-R"),
    ],
)
def test_wrong_number_of_groups_is_rejected(count):
    groups = [group(i, 0, 1) for i in range(count)]
    with pytest.raises(ValueError, match="expected 1 to 2 rounds of 2 groups"):
        select_groups(groups, DynamicSamplingConfig(2, 2))


@pytest.mark.parametrize(
    "rewards, kept, dropped, rounds, surplus",
    [
        # P = 2, R = 3; lazy rounds stop once the kept groups fill the batch
        pytest.param([(0, 1), (0, 1)], [0, 1], 0, 1, 0, id="one-round-fills"),
        pytest.param([(1, 1), (0, 1), (0, 1), (0, 1)], [1, 2], 1, 2, 1, id="second-round-surplus"),
        pytest.param([(1, 1), (0, 1), (1, 1), (2, 2), (0, 1), (1, 1)], [1, 4], 3, 3, 0, id="r3"),
        pytest.param([(1, 1), (0, 0), (0, 1), (1, 1)], [2, 0], 3, 2, 0, id="short-two-rounds"),
    ],
)
def test_lazy_rounds_are_a_prefix_of_the_eager_ones(rewards, kept, dropped, rounds, surplus):
    groups = [group(i, *r) for i, r in enumerate(rewards)]
    out = select_groups(groups, DynamicSamplingConfig(2, 3))
    assert [g.index_in_batch for g in out.groups] == kept
    assert (out.dropped, out.rounds_used, out.surplus) == (dropped, rounds, surplus)


def test_surplus_counts_the_qualifying_groups_generated_after_the_batch_filled():
    groups = [group(0, 0, 1), group(1, 1, 1), group(2, 0, 1), group(3, 0, 1), group(4, 0, 1)]
    out = select_groups(groups + [group(5, 2, 2)], DynamicSamplingConfig(2, 3))
    assert [g.index_in_batch for g in out.groups] == [0, 2]
    assert out.rounds_used == 2 and out.surplus == 2  # groups 3 and 4; 5's rewards are equal
