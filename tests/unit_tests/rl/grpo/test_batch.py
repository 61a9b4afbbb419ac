"""``build_train_batch``: next-token shift, masks, behaviour logprobs and advantages per rollout."""

from __future__ import annotations

import math

import pytest
import torch
from grpo_testing.batches import build_train_batch

from megatron.rl.wire import RolloutGroup, TokenRollout

PAD = 0


def rollout(
    prompt: list[int],
    completion: list[int],
    reward: float,
    logprobs: list[float] | None = None,
    temperature: float = 1.0,
) -> TokenRollout:
    return TokenRollout(
        env_id="test",
        problem_id="p",
        prompt="",
        completion="",
        reward=reward,
        tokens=prompt + completion,
        generation_mask=[False] * len(prompt) + [True] * len(completion),
        logprobs=logprobs if logprobs is not None else [-0.5] * len(completion),
        policy_versions=[0] * len(completion),
        submission_policy_version=0,
        temperature=temperature,
    )


def placeholder(error: str = "ValueError: boom") -> TokenRollout:
    return TokenRollout(
        env_id="test",
        problem_id="?",
        prompt="",
        completion="",
        reward=0.0,
        error=error,
        tokens=[],
        generation_mask=[],
        logprobs=[],
        policy_versions=[],
        submission_policy_version=0,
    )


def group(index: int, rollouts: list[TokenRollout]) -> RolloutGroup:
    return RolloutGroup(batch_id=0, index_in_batch=index, rollouts=rollouts)


def test_inputs_are_tokens_shifted_against_targets_and_right_padded():
    groups = [group(0, [rollout([5, 6], [7, 8, 9], 1.0), rollout([5, 6], [7], 0.0)])]
    batch = build_train_batch(groups, pad_id=PAD)
    # width = longest trajectory (5 tokens) - 1
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 6, PAD, PAD]]
    assert batch.target_ids.tolist() == [[6, 7, 8, 9], [6, 7, PAD, PAD]]
    assert batch.lengths.tolist() == [4, 2]
    assert batch.input_ids.dtype == torch.long and batch.target_ids.dtype == torch.long
    assert batch.num_rows == 2


def test_custom_pad_id_fills_padding():
    groups = [group(0, [rollout([5, 6], [7, 8, 9], 1.0), rollout([5, 6], [7], 0.0)])]
    batch = build_train_batch(groups, pad_id=3)
    assert batch.input_ids[1].tolist() == [5, 6, 3, 3]
    assert batch.target_ids[1].tolist() == [6, 7, 3, 3]


def test_loss_mask_and_inference_logprobs_sit_on_generated_targets():
    r = rollout([2, 3, 4], [5, 6], 1.0, logprobs=[-0.25, -1.5])
    batch = build_train_batch([group(0, [r, rollout([2], [9], 0.0, [-3.0])])], pad_id=PAD)
    # targets of row 0: 3 4 5 6 -> generated at positions 2 and 3
    assert batch.loss_mask[0].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert batch.inference_logprobs[0].tolist() == [0.0, 0.0, -0.25, -1.5]
    # row 1: tokens 2 9 -> one target, generated, then padding
    assert batch.loss_mask[1].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert batch.inference_logprobs[1].tolist() == [-3.0, 0.0, 0.0, 0.0]
    assert batch.loss_mask.dtype == torch.float32
    assert batch.inference_logprobs.dtype == torch.float32
    assert batch.num_loss_tokens == 3


def test_interleaved_generation_mask_places_logprobs_in_order():
    """A multi-turn style trajectory: generated, prompt, generated again."""
    r = TokenRollout(
        env_id="test",
        problem_id="p",
        prompt="",
        completion="",
        reward=1.0,
        tokens=[2, 10, 11, 3, 4, 12],
        generation_mask=[False, True, True, False, False, True],
        logprobs=[-0.1, -0.2, -0.3],
        policy_versions=[0, 0, 1],
        submission_policy_version=0,
    )
    batch = build_train_batch([group(0, [r])], pad_id=PAD)
    assert batch.loss_mask[0].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    torch.testing.assert_close(batch.inference_logprobs[0], torch.tensor([-0.1, -0.2, 0, 0, -0.3]))


def test_advantages_are_normalized_per_group_in_row_order():
    groups = [
        group(0, [rollout([2], [3], r) for r in (1.0, 0.0, 0.0, 1.0)]),
        group(1, [rollout([2], [3], r) for r in (1.0, 2.0, 3.0, 2.0)]),
        group(2, [rollout([2], [3], 0.5) for _ in range(4)]),
    ]
    batch = build_train_batch(groups, pad_id=PAD)
    s3, s15 = math.sqrt(3) / 2, math.sqrt(1.5)
    expected = [s3, -s3, -s3, s3, -s15, 0.0, s15, 0.0, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(batch.advantages, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert batch.advantages.shape == (12,)


def test_temperature_per_row():
    groups = [group(0, [rollout([2], [3], 0.0, temperature=0.7), rollout([2], [3], 1.0)])]
    batch = build_train_batch(groups, pad_id=PAD)
    torch.testing.assert_close(batch.temperature, torch.tensor([0.7, 1.0]))


def test_placeholder_rows_carry_no_loss_and_do_not_shift_other_advantages():
    good = [rollout([2, 3], [4, 5], r) for r in (1.0, 0.0, 1.0)]
    with_ph = build_train_batch([group(0, [good[0], placeholder(), good[1], good[2]])], PAD)
    without = build_train_batch([group(0, good)], PAD)
    assert with_ph.num_rows == 4
    assert with_ph.loss_mask[1].sum() == 0
    assert with_ph.lengths[1] == 0
    assert with_ph.input_ids[1].tolist() == [PAD] * 3
    assert with_ph.advantages[1] == 0
    torch.testing.assert_close(with_ph.advantages[[0, 2, 3]], without.advantages)
    assert with_ph.num_loss_tokens == without.num_loss_tokens == 6
    # the valid rewards 1, 0, 1 are not all equal, so the others are not zero
    assert with_ph.advantages[[0, 2, 3]].abs().min() > 0.1


def test_placeholder_with_leftover_tokens_is_still_masked():
    ph = rollout([2, 3], [4, 5], 1.0).model_copy(update={"error": "reward failed"})
    batch = build_train_batch([group(0, [ph, rollout([2, 3], [4], 1.0)])], PAD)
    assert batch.loss_mask[0].sum() == 0
    assert batch.advantages[0] == 0


def test_all_placeholder_batch_has_width_one_and_no_loss_tokens():
    batch = build_train_batch([group(0, [placeholder(), placeholder()])], PAD)
    assert batch.input_ids.shape == (2, 1)
    assert batch.num_loss_tokens == 0
    assert batch.advantages.tolist() == [0.0, 0.0]


def test_rows_selects_and_trims_to_longest_selected_sequence():
    groups = [
        group(0, [rollout([2], [3, 4, 5, 6, 7], 1.0), rollout([2], [3], 0.0)]),
        group(1, [rollout([2, 3], [4], 0.0), rollout([2], [8, 9], 1.0)]),
    ]
    batch = build_train_batch(groups, PAD)
    assert batch.input_ids.shape == (4, 5)
    part = batch.rows(1, 4)
    assert part.num_rows == 3
    assert part.input_ids.shape == (3, 2)  # longest of rows 1..3 has 2 inputs
    assert part.input_ids.tolist() == [[2, PAD], [2, 3], [2, 8]]
    assert part.target_ids.tolist() == [[3, PAD], [3, 4], [8, 9]]
    assert part.loss_mask.tolist() == [[1, 0], [0, 1], [1, 1]]
    assert part.inference_logprobs.shape == (3, 2)
    torch.testing.assert_close(part.advantages, batch.advantages[1:4])
    torch.testing.assert_close(part.temperature, batch.temperature[1:4])
    assert part.lengths.tolist() == [1, 2, 2]
    assert part.num_loss_tokens == batch.num_loss_tokens - 5


def test_rows_of_placeholders_only_keeps_width_one():
    batch = build_train_batch([group(0, [rollout([2], [3, 4, 5], 1.0), placeholder()])], PAD)
    part = batch.rows(1, 2)
    assert part.input_ids.shape == (1, 1)
    assert part.num_loss_tokens == 0


def test_unequal_group_sizes_raise():
    groups = [
        group(0, [rollout([2], [3], 1.0), rollout([2], [3], 0.0)]),
        group(1, [rollout([2], [3], 1.0)]),
    ]
    with pytest.raises(ValueError, match="same size"):
        build_train_batch(groups, PAD)


@pytest.mark.parametrize(
    "tokens",
    [
        pytest.param([3, 4], id="two-generated-tokens"),
        pytest.param([3, 4, 5], id="three-generated-tokens"),
        pytest.param([3], id="single-generated-token"),
    ],
)
def test_rollout_starting_with_generated_token_raises(tokens):
    bad = TokenRollout(
        env_id="envx",
        problem_id="prob7",
        prompt="",
        completion="",
        reward=1.0,
        tokens=tokens,
        generation_mask=[True] * len(tokens),
        logprobs=[-1.0] * len(tokens),
        policy_versions=[0] * len(tokens),
        submission_policy_version=0,
    )
    with pytest.raises(ValueError, match="envx/prob7"):
        build_train_batch([group(0, [rollout([2], [3], 0.0), bad])], PAD)
