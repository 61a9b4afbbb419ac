"""Flags and a one-rank parallel context for tests of the trainer's tiers."""

from __future__ import annotations

import torch
from grpo_testing.models import tiny_args
from megatron.core import parallel_state

from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.train.losses import GRPOLoss
from megatron.trainer.train.policy import Policy
from megatron.trainer.train.step import MicroBatchCache, StepConfig, StepResult


def train_args(**overrides) -> RunConfig:
    """The tiny model's run config with the optimizer, schedule and tier options a tier reads."""
    values = dict(
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
        clip_grad=0.5,
        micro_batch_size=4,
        distributed_timeout_minutes=1,
        bf16=False,
        use_distributed_optimizer=False,
    )
    values.update(overrides)
    return tiny_args(**values)


def step_config(vocab_size: int, **options) -> StepConfig:
    """The default step (plain clipped surrogate) of ``train_args``, with ``options``."""
    return StepConfig(GRPOLossConfig(0.2, 0.28), vocab_size, 4, clip_grad=0.5, **options)


def one_rank_context(device: str = "cpu") -> ParallelContext:
    """The context of a world of one (parallel state must be initialized)."""
    return ParallelContext(
        rank=0,
        world_size=1,
        device=torch.device(device),
        tp_rank=0,
        tp_size=1,
        dp_rank=0,
        dp_size=1,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
    )


def grpo_update(
    policy: Policy,
    batch,
    config: StepConfig,
    caches: list[MicroBatchCache] | None = None,
) -> StepResult:
    """One GRPO update of ``batch`` as the training loop runs it through the policy interface:
    pi_ref up front when a loss term needs it, then ``Policy.train`` with the GRPO loss."""
    ref = policy.get_reference_policy_logprobs(batch) if config.needs_reference else None
    (result,) = policy.train(batch, GRPOLoss(config, ref_logprobs=ref), caches=caches)
    return result
