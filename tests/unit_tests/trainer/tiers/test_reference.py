"""The reference policy: initial weights or --ref-load, identical on resume, RNG untouched."""

from __future__ import annotations

import argparse

import pytest
import torch
from grpo_testing.models import VOCAB, tiny_args
from grpo_testing.trainer import one_rank_context
from megatron.core import parallel_state

from megatron.rl.rollout.generator import PipelineState
from megatron.trainer.checkpoint import directory as checkpointing
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.config import model_build, optimizer_settings, tier_config
from megatron.trainer.model.provider import build_model
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.runtime.initialize import set_seeds
from megatron.trainer.tiers.cpu import CPUTier
from megatron.trainer.tiers.cpu_checkpoint import TorchShards
from megatron.trainer.tiers.reference import build_reference_model
from megatron.trainer.train.optimizer import build_optimizer

pytestmark = pytest.mark.usefixtures("single_rank_world")


def run_args(**overrides) -> argparse.Namespace:
    args = tiny_args()
    args = args.with_flags(
        seed=5,
        lr=1e-2,
        min_lr=1e-3,
        lr_warmup_iters=0,
        lr_decay_style="cosine",
        train_iters=10,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_eps=1e-8,
        grpo_kl_beta=0.1,
        ref_load=None,
        rl_forced_lag=0,
        grpo_prompts_per_step=1,
        grpo_group_size=2,
    )
    args = args.with_flags(**overrides)
    return args


def context() -> ParallelContext:
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    return one_rank_context()


def start(args, ctx):
    """What ``grpo.train`` does before the loop: seed, policy, reference, optimizer."""
    set_seeds(args.training.seed, cuda=False)
    model = build_model(model_build(args), VOCAB, ctx.device)
    reference = build_reference_model(
        CPUTier(tier_config(args), ctx), model, VOCAB, args.grpo.weight("--grpo-kl-beta") > 0
    )
    optimizer, scheduler = build_optimizer(model, optimizer_settings(args))
    return model, reference, optimizer, scheduler


def save_checkpoint(root, iteration, model, optimizer, scheduler, pipeline, args, ctx):
    state = TrainState(model, optimizer, scheduler)
    checkpointing.save_checkpoint(root, iteration, TorchShards(ctx), state, pipeline, args, ctx)


def load_checkpoint(root, model, optimizer, scheduler, args, ctx):
    state = TrainState(model, optimizer, scheduler)
    return checkpointing.load_checkpoint(root, TorchShards(ctx), state, args, ctx)


def weights(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def drift(model: torch.nn.Module, optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.3)
    optimizer.step()


def drained() -> PipelineState:
    return PipelineState(
        next_batch_id=1, submitted=1, forced_lag=0, groups_per_batch=1, group_size=2, groups=[]
    )


def test_no_reference_without_kl():
    ctx = context()
    args = run_args(grpo_kl_beta=0.0)
    set_seeds(args.training.seed, cuda=False)
    model = build_model(model_build(args), VOCAB, ctx.device)
    assert (
        build_reference_model(
            CPUTier(tier_config(args), ctx), model, VOCAB, args.grpo.weight("--grpo-kl-beta") > 0
        )
        is None
    )


def test_reference_copies_initial_weights_is_frozen_and_leaves_the_rng_alone():
    ctx = context()
    args = run_args()
    set_seeds(args.training.seed, cuda=False)
    model = build_model(model_build(args), VOCAB, ctx.device)
    before = torch.get_rng_state()
    reference = build_reference_model(
        CPUTier(tier_config(args), ctx), model, VOCAB, args.grpo.weight("--grpo-kl-beta") > 0
    )
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(weights(reference), weights(model)))
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())


def test_resumed_run_rebuilds_the_same_reference(tmp_path):
    ctx = context()
    args = run_args()
    model, reference, optimizer, scheduler = start(args, ctx)
    initial = weights(reference)
    drift(model, optimizer)
    save_checkpoint(str(tmp_path), 1, model, optimizer, scheduler, drained(), args, ctx)

    model2, reference2, optimizer2, scheduler2 = start(args, ctx)  # a fresh process, resuming
    load_checkpoint(str(tmp_path), model2, optimizer2, scheduler2, args, ctx)
    assert all(torch.equal(a, b) for a, b in zip(weights(reference2), initial))
    assert not all(torch.equal(a, b) for a, b in zip(weights(model2), initial))


def test_ref_load_reads_the_weights_of_a_checkpoint(tmp_path):
    ctx = context()
    args = run_args()
    model, _, optimizer, scheduler = start(args, ctx)
    drift(model, optimizer)
    save_checkpoint(str(tmp_path), 4, model, optimizer, scheduler, drained(), args, ctx)

    _, reference, *_ = start(run_args(ref_load=str(tmp_path)), ctx)
    assert all(torch.equal(a, b) for a, b in zip(weights(reference), weights(model)))


def test_ref_load_without_a_checkpoint_is_named(tmp_path):
    ctx = context()
    with pytest.raises(SystemExit, match="--ref-load"):
        start(run_args(ref_load=str(tmp_path)), ctx)
