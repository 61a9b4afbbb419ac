"""The CUDA tier: its pieces that run without a GPU, and (``gpu``) the tier against the CPU tier
on one GPU. The whole tier also runs on CPU under a CUDA emulation in
``tests/functional_tests/test_cuda_tier_emulated.py``."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from grpo_testing.batches import build_train_batch
from grpo_testing.models import VOCAB
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import grpo_update, one_rank_context, step_config, train_args
from megatron.core import parallel_state

from megatron.rl.inference.protocol import InferenceEngine, RowRunner
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.trainer.checkpoint.directory import TrainState, load_checkpoint, save_checkpoint
from megatron.trainer.config import model_build, optimizer_settings, tier_config
from megatron.trainer.model.provider import architecture
from megatron.trainer.tiers.cpu import CPUTier
from megatron.trainer.tiers.cuda import NO_CLIP, CUDATier, cuda_transformer_config, optimizer_config
from megatron.trainer.tiers.cuda_policy import CUDAPolicy
from megatron.trainer.train.policy import PolicyConfig
from megatron.trainer.train.step import data_parallel_micro_batches

ARCH = architecture(model_build(train_args()), VOCAB)


@pytest.fixture
def cpu_world(single_rank_world):
    parallel_state.initialize_model_parallel()
    return one_rank_context("cpu")


def test_cuda_config_carries_precision_and_per_token_loss():
    config = cuda_transformer_config(
        model_build(train_args(bf16=True)), ARCH, transformer_engine=False
    )
    assert config.bf16 and config.params_dtype == torch.bfloat16
    assert config.pipeline_dtype == torch.bfloat16 and config.calculate_per_token_loss
    fp32 = cuda_transformer_config(model_build(train_args()), ARCH, transformer_engine=True)
    assert not fp32.bf16 and fp32.params_dtype == torch.float32
    assert fp32.gradient_accumulation_fusion  # Transformer Engine fuses weight gradients


@pytest.mark.parametrize(
    "clip, want",
    [pytest.param(0.5, 0.5, id="clips-at-the-flag"), pytest.param(0.0, NO_CLIP, id="zero")],
)
def test_optimizer_config_maps_the_flags(clip, want):
    args = train_args(clip_grad=clip, use_distributed_optimizer=True)
    config = optimizer_config(
        optimizer_settings(args),
        cuda_transformer_config(model_build(args), ARCH, transformer_engine=False),
    )
    assert config.optimizer == "adam" and config.use_distributed_optimizer
    assert (config.lr, config.min_lr, config.weight_decay) == (
        args.training.lr,
        args.training.min_lr,
        0.01,
    )
    assert (config.adam_beta1, config.adam_beta2, config.adam_eps) == (0.9, 0.99, 1e-8)
    assert config.clip_grad == want
    # megatron-core scales gradients by clip_grad / (norm + 1e-6) only when that is below 1:
    # with --clip-grad 0 no gradient norm a model reaches triggers it, so the norm is measured
    # without clipping, as on the CPU tier.
    assert config.clip_grad / (1e12 + 1e-6) > 1 if clip == 0 else config.clip_grad == clip


def test_micro_batches_keep_a_fixed_width_for_pipeline_parallelism(cpu_world):
    batch = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=2), pad_id=0)
    fixed = data_parallel_micro_batches(batch, cpu_world, 2, fixed_width=True)
    trimmed = data_parallel_micro_batches(batch, cpu_world, 2)
    assert len(fixed) == 4 and {m.input_ids.shape for m in fixed} == {(2, batch.input_ids.shape[1])}
    for m, start in zip(trimmed, (0, 2, 4, 6)):
        assert m.input_ids.shape[1] == int(batch.lengths[start : start + 2].max())
        assert torch.equal(m.input_ids, batch.input_ids[start : start + 2, : m.input_ids.shape[1]])


def test_the_cuda_policy_refuses_packing_with_the_transformer_engine_spec(cpu_world):
    config = PolicyConfig.of(step_config(VOCAB, packing_capacity=32))
    with pytest.raises(ValueError, match="--rl-use-sequence-packing.*Transformer Engine"):
        CUDAPolicy(None, config, cpu_world, transformer_engine=True)
    assert CUDAPolicy(None, config, cpu_world).config.packing_capacity == 32  # SDPA spec


# ------------------------------------------------------------- CUDA tier on one GPU


@pytest.fixture
def cuda_world():
    from megatron.trainer.runtime.initialize import initialize_distributed, shutdown_distributed

    with mock.patch.dict(os.environ):  # the world's variables do not outlive the test
        ctx = initialize_distributed(train_args())
        yield ctx
        shutdown_distributed()


def train_step(tier, state, batch):
    """One GRPO update through the tier's policy."""
    config = step_config(VOCAB)
    return grpo_update(tier.build_policy(state, PolicyConfig.of(config)), batch, config)


def run_steps(tier, steps: int = 2, seed: int = 3):
    torch.manual_seed(seed)
    model = tier.build_model(VOCAB)
    state = TrainState(model, *tier.build_optimizer(model))
    results = []
    for step in range(steps):
        batch = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=step), pad_id=0)
        results.append(train_step(tier, state, batch))
    return state, results


@pytest.mark.gpu
@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "dist-opt"])
def test_cuda_tier_steps_match_the_cpu_tier_on_the_same_gpu(cuda_world, distributed_optimizer):
    args = train_args(use_distributed_optimizer=distributed_optimizer)
    _, cpu = run_steps(CPUTier(tier_config(args), cuda_world))
    _, cuda = run_steps(CUDATier(tier_config(args), cuda_world))
    for a, b in zip(cpu, cuda):
        assert b.loss == pytest.approx(a.loss, rel=1e-4, abs=1e-6)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        assert b.lr == pytest.approx(a.lr)
        assert b.loss_tokens == a.loss_tokens


@pytest.mark.gpu
def test_cuda_tier_bf16_tracks_fp32(cuda_world):
    _, fp32 = run_steps(CUDATier(tier_config(train_args()), cuda_world))
    _, bf16 = run_steps(CUDATier(tier_config(train_args(bf16=True)), cuda_world))
    for a, b in zip(fp32, bf16):
        assert b.loss == pytest.approx(a.loss, rel=5e-2, abs=5e-3)


@pytest.mark.gpu
def test_dist_checkpoint_round_trip_continues_identically(cuda_world, tmp_path):
    from megatron.rl.rollout.generator import PipelineState

    args = train_args()
    tier = CUDATier(tier_config(args), cuda_world)
    state, _ = run_steps(tier, steps=1)
    pipeline = PipelineState(
        next_batch_id=1, submitted=1, forced_lag=0, groups_per_batch=2, group_size=4, groups=[]
    )
    save_checkpoint(str(tmp_path), 1, tier.checkpoint_shards(), state, pipeline, args, cuda_world)
    batch = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=9), pad_id=0)
    want = train_step(tier, state, batch)

    torch.manual_seed(123)  # different initial weights: everything must come from the checkpoint
    fresh = tier.build_model(VOCAB)
    fresh_state = TrainState(fresh, *tier.build_optimizer(fresh))
    resumed = load_checkpoint(
        str(tmp_path), tier.checkpoint_shards(), fresh_state, args, cuda_world
    )
    assert resumed.iteration == 1 and resumed.pipeline == pipeline
    got = train_step(tier, fresh_state, batch)
    assert got.loss == pytest.approx(want.loss, rel=1e-6)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-6)
    assert got.lr == want.lr


@pytest.mark.gpu
def test_cuda_tier_engine_runs_megatron_cores_dynamic_engine(cuda_world):
    from megatron.rl.inference.megatron_core.dynamic_runner import DynamicEngineRowRunner

    tier = CUDATier(tier_config(train_args()), cuda_world)
    model = tier.build_model(VOCAB)
    config = SchedulerConfig(max_requests=4, max_seq_len=32, eos_id=1)
    steps = tier.build_step_group(model, config, VOCAB)
    assert isinstance(steps.runner, DynamicEngineRowRunner) and isinstance(steps.runner, RowRunner)
    engine = tier.build_engine(steps, config, lambda: 0)
    assert isinstance(engine, ContinuousBatchingScheduler) and isinstance(engine, InferenceEngine)
    assert "DynamicInferenceEngine" in tier.describe()
