"""The CPU tier's GRPO step (``CPUPolicy.train`` with the GRPO loss) is invariant to
micro-batching, data and tensor parallelism.

Each case runs two optimizer steps on the same synthetic batches from the same seed; loss and
gradient norm must agree with the single-rank, single-micro-batch reference.
"""

from __future__ import annotations

import math

import pytest
from grpo_testing.batches import build_train_batch
from grpo_testing.distributed import run_on_ranks
from grpo_testing.models import VOCAB, tiny_args
from grpo_testing.rollouts import synthetic_groups

from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.config import model_build, optimizer_settings
from megatron.trainer.model.provider import build_model
from megatron.trainer.runtime.initialize import initialize_distributed
from megatron.trainer.tiers.cpu import CPUPolicy
from megatron.trainer.train.losses import GRPOLoss
from megatron.trainer.train.optimizer import build_optimizer
from megatron.trainer.train.policy import PolicyConfig
from megatron.trainer.train.step import StepConfig


def two_steps(rank: int, world_size: int, tp: int, micro_batch_size: int):
    args = tiny_args(tensor_model_parallel_size=tp)
    args = args.with_flags(
        distributed_timeout_minutes=1,
        seed=7,
        lr=1e-2,
        min_lr=1e-3,
        lr_warmup_iters=0,
        lr_decay_style="cosine",
        train_iters=10,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_eps=1e-8,
    )
    ctx = initialize_distributed(args)
    model = build_model(model_build(args), VOCAB, ctx.device)
    state = TrainState(model, *build_optimizer(model, optimizer_settings(args)))
    config = StepConfig(GRPOLossConfig(0.2, 0.28), VOCAB, micro_batch_size, clip_grad=0.5)
    policy = CPUPolicy(state, PolicyConfig.of(config), ctx)
    results = []
    for step in range(2):
        batch = build_train_batch(synthetic_groups(4, 4, VOCAB, seed=step), pad_id=0)
        (r,) = policy.train(batch, GRPOLoss(config))
        results.append((r.loss, r.grad_norm, r.lr, r.metrics["clip_fraction"], r.loss_tokens))
    return results


@pytest.fixture(scope="module")
def reference():
    (result,) = run_on_ranks(two_steps, 1, 1, 16)
    return result


@pytest.mark.parametrize(
    "world_size, tp, micro_batch_size",
    [
        pytest.param(1, 1, 4, id="micro-batches-of-4"),
        pytest.param(2, 1, 2, id="data-parallel-2"),
        pytest.param(2, 2, 8, id="tensor-parallel-2"),
    ],
)
def test_step_matches_single_rank_single_micro_batch(reference, world_size, tp, micro_batch_size):
    for rank_result in run_on_ranks(two_steps, world_size, tp, micro_batch_size):
        for got, want in zip(rank_result, reference):
            assert got[0] == pytest.approx(want[0], rel=1e-5, abs=1e-7)  # loss
            assert got[1] == pytest.approx(want[1], rel=1e-5)  # grad norm (shards counted once)
            assert got[2:] == pytest.approx(want[2:], rel=1e-6)


def test_reference_exercises_clipping_and_the_schedule(reference):
    (loss0, norm0, lr0, _, tokens0), (loss1, *_rest) = reference
    assert norm0 > 0.5  # above --clip-grad 0.5: the clipping path is exercised
    # Update 1 of a 10-step cosine decay from 1e-2 to 1e-3 without warmup.
    assert lr0 == pytest.approx(1e-3 + 0.5 * (1 + math.cos(math.pi / 10)) * 9e-3, rel=1e-6)
    assert tokens0 > 0 and loss0 != loss1
