"""Sequence-level logprob error masking in the trainer (``megatron/trainer/train/seq_logprob_error.py``)
with an injected mismatch: the engine's logprobs equal the trainer's except on chosen rows, which
are perturbed by a known factor; exactly those above the threshold are masked, and the metrics are
the ones computed by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from grpo_testing.batches import build_train_batch
from grpo_testing.models import VOCAB
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import one_rank_context, train_args
from megatron.core import parallel_state

from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.rl.grpo.seq_logprob_error import SeqLogprobErrorConfig
from megatron.rl.wire import RolloutGroup
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.config import model_build, optimizer_settings, tier_config
from megatron.trainer.model.provider import build_model
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.runtime.initialize import set_seeds
from megatron.trainer.tiers.cpu import CPUTier
from megatron.trainer.train.collection import Collection
from megatron.trainer.train.losses import GRPOLoss
from megatron.trainer.train.optimizer import build_optimizer
from megatron.trainer.train.policy import Policy, PolicyConfig
from megatron.trainer.train.seq_logprob_error import apply_seq_logprob_error
from megatron.trainer.train.step import StepConfig

MICRO = 4
PERTURBED = {1: math.log(2.0), 6: -math.log(4.0), 9: math.log(1.2)}
"""Row -> the log-factor added to every generated token's engine logprob: errors 2, 4 and 1.2."""
REWARDS = {1: 1.0, 6: 0.0, 9: 0.3}


def context() -> ParallelContext:
    return one_rank_context()


def fresh_policy() -> Policy:
    """The policy of the seed, with its optimizer (parallel state up)."""
    args = train_args(micro_batch_size=MICRO)
    set_seeds(args.training.seed, cuda=False)
    model = build_model(model_build(args), VOCAB, torch.device("cpu"))
    state = TrainState(model, *build_optimizer(model, optimizer_settings(args)))
    tier = CPUTier(tier_config(args), context())
    return tier.build_policy(state, PolicyConfig(VOCAB, MICRO, clip_grad=1.0))


def setup() -> Policy:
    parallel_state.initialize_model_parallel()
    return fresh_policy()


def engine_groups(policy: Policy) -> list[RolloutGroup]:
    """4 groups of 4 whose engine logprobs are the policy's own, but for the ``PERTURBED`` rows."""
    groups = synthetic_groups(4, 4, VOCAB, seed=1)
    batch = build_train_batch(groups, pad_id=0)
    own_logprobs = policy.get_logprobs(batch)  # (16, T)
    out, row = [], 0
    for g in groups:
        rollouts = []
        for r in g.rollouts:
            own = own_logprobs[row][batch.loss_mask[row] > 0].tolist()
            delta = PERTURBED.get(row, 0.0)
            rollouts.append(
                r.model_copy(
                    update={"logprobs": [x + delta for x in own], "reward": REWARDS.get(row, 0.7)}
                )
            )
            row += 1
        out.append(g.model_copy(update={"rollouts": rollouts}))
    return out


def rewards(groups: list[RolloutGroup]) -> torch.Tensor:
    return torch.tensor([r.reward for g in groups for r in g.rollouts], dtype=torch.float64)


def step_config(**options) -> StepConfig:
    return StepConfig(GRPOLossConfig(0.2, 0.28), VOCAB, MICRO, clip_grad=1.0, **options)


@pytest.mark.parametrize(
    "global_batch_size, iterations",
    [
        pytest.param(16, 1, id="one-global-batch"),
        pytest.param(8, 2, id="two-global-batches"),
        pytest.param(12, 4, id="wrapping-global-batches"),
    ],
)
def test_injected_mismatch_masks_exactly_the_rows_above_the_threshold(
    single_rank_world, global_batch_size, iterations
):
    policy = setup()
    groups = engine_groups(policy)
    batch = build_train_batch(groups, pad_id=0)
    collection = Collection(batch, global_batch_size, iterations)
    collection.prepare(policy, step_config())
    metrics = apply_seq_logprob_error(
        collection, rewards(groups), policy, SeqLogprobErrorConfig(1.5)
    )

    # 13 rows with error 1, then 2, 4 and 1.2; masked above 1.5: rows 1 and 6 (rewards 1 and 0)
    assert metrics == pytest.approx(
        {
            "seq_mult_prob_error_min": 1.0,
            "seq_mult_prob_error_mean": (13 + 2 + 4 + 1.2) / 16,
            "seq_mult_prob_error_max": 4.0,
            "seq_mult_prob_error_after_mask_min": 1.0,
            "seq_mult_prob_error_after_mask_mean": (13 + 1.2) / 14,
            "seq_mult_prob_error_after_mask_max": 1.2,
            "seq_logprob_error_masked_sequences": 2,
            "seq_logprob_error_masked_rewarded_fraction": 0.5,
        },
        rel=1e-5,
    )
    masked = collection.batch.loss_mask
    assert [r for r in range(16) if masked[r].sum() == 0] == [1, 6]
    keep = [r for r in range(16) if r not in (1, 6)]
    assert torch.equal(masked[keep], batch.loss_mask[keep])


def test_the_loss_is_normalised_over_the_remaining_tokens(single_rank_world):
    policy = setup()
    groups = engine_groups(policy)
    batch = build_train_batch(groups, pad_id=0)
    collection = Collection(batch, 16, 1)
    config = step_config()
    collection.prepare(policy, config)
    apply_seq_logprob_error(collection, rewards(groups), policy, SeqLogprobErrorConfig(1.5))
    (masked,) = policy.train(
        collection.global_batch(0), collection.loss(0, config), caches=collection.caches(0, 4)
    )
    rows_1_6 = int(batch.loss_mask[[1, 6]].sum())
    assert masked.loss_tokens == batch.num_loss_tokens - rows_1_6

    by_hand = batch.loss_mask.clone()
    by_hand[[1, 6]] = 0.0
    (plain,) = fresh_policy().train(dataclasses.replace(batch, loss_mask=by_hand), GRPOLoss(config))
    assert masked.loss == pytest.approx(plain.loss, rel=1e-6)
    assert masked.grad_norm == pytest.approx(plain.grad_norm, rel=1e-6)
