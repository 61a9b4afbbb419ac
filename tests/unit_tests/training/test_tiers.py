"""The tier seam: selection by device, the CPU tier as the existing code path, the CUDA tier's
pieces that run without a GPU, and (``gpu``) the CUDA tier against the CPU tier on one GPU."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from grpo_testing.models import VOCAB, tiny_args
from grpo_testing.rollouts import synthetic_groups
from megatron.core import parallel_state

from megatron.rl.grpo.batch import build_train_batch
from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.rl.inference.engine import LocalEngineConfig, LocalInferenceEngine
from megatron.rl.inference.model_runner import ModelRunner
from megatron.rl.inference.protocol import InferenceEngine, RowRunner
from megatron.training.cuda_tier import (
    NO_CLIP,
    CUDATier,
    _loss,
    cuda_transformer_config,
    micro_batches,
)
from megatron.training.initialize import ParallelContext
from megatron.training.model_provider import build_model
from megatron.training.tiers import CPUTier, select_tier, tier_class
from megatron.training.train_step import MicroBatchTerms, forward_backward_step

LOSS = GRPOLossConfig(0.2, 0.28)


def train_args(**overrides) -> argparse.Namespace:
    args = tiny_args(**overrides)
    args.__dict__.update(
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
    args.__dict__.update(overrides)
    return args


def context(device: str = "cpu") -> ParallelContext:
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


@pytest.fixture
def cpu_world(single_rank_world):
    parallel_state.initialize_model_parallel()
    return context("cpu")


def test_the_device_selects_the_tier():
    assert tier_class(torch.device("cpu")) is CPUTier
    assert tier_class(torch.device("cuda", 0)) is CUDATier


def test_select_tier_binds_args_and_context(cpu_world):
    tier = select_tier(train_args(), cpu_world)
    assert isinstance(tier, CPUTier) and tier.name == "cpu"
    assert tier.ctx is cpu_world and "cpu" in tier.describe()


def test_the_cpu_tier_builds_what_the_training_loop_built_before(cpu_world):
    args = train_args()
    torch.manual_seed(3)
    model = CPUTier(args, cpu_world).build_model(VOCAB)
    torch.manual_seed(3)
    before = build_model(args, VOCAB, torch.device("cpu"))
    got, want = model.state_dict(), before.state_dict()
    assert got.keys() == want.keys()
    for name, value in got.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, want[name]), name


def test_the_cpu_tier_trains_one_step(cpu_world):
    tier = CPUTier(train_args(), cpu_world)
    torch.manual_seed(3)
    model = tier.build_model(VOCAB)
    optimizer, scheduler = tier.build_optimizer(model)
    batch = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=1), pad_id=0)
    result = tier.train_step(model, optimizer, scheduler, batch, LOSS, VOCAB)
    assert math.isfinite(result.loss) and result.grad_norm > 0
    assert result.loss_tokens == batch.num_loss_tokens


def test_the_cpu_tier_engine_is_the_local_engine_and_speaks_the_protocol(cpu_world):
    tier = CPUTier(train_args(), cpu_world)
    model = tier.build_model(VOCAB)
    config = LocalEngineConfig(max_requests=2, max_seq_len=32, eos_id=1)
    steps = tier.build_step_group(model, config, VOCAB)
    assert isinstance(steps.runner, ModelRunner) and isinstance(steps.runner, RowRunner)
    engine = tier.build_engine(steps, config, lambda: 0)
    assert isinstance(engine, LocalInferenceEngine) and isinstance(engine, InferenceEngine)


# ------------------------------------------------------------- CUDA-tier pieces, no GPU needed


def test_cuda_config_carries_precision_and_per_token_loss():
    config = cuda_transformer_config(train_args(bf16=True), transformer_engine=False)
    assert config.bf16 and config.params_dtype == torch.bfloat16
    assert config.pipeline_dtype == torch.bfloat16 and config.calculate_per_token_loss
    fp32 = cuda_transformer_config(train_args(), transformer_engine=True)
    assert not fp32.bf16 and fp32.params_dtype == torch.float32
    assert fp32.gradient_accumulation_fusion  # Transformer Engine fuses weight gradients


def test_micro_batches_keep_a_fixed_width_for_pipeline_parallelism():
    batch = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=2), pad_id=0)
    fixed = micro_batches(batch, 0, 8, 2, fixed_width=True)
    trimmed = micro_batches(batch, 4, 4, 2, fixed_width=False)
    assert len(fixed) == 4 and {m.input_ids.shape for m in fixed} == {(2, batch.input_ids.shape[1])}
    assert len(trimmed) == 2
    for m, start in zip(trimmed, (4, 6)):
        assert m.input_ids.shape[1] == int(batch.lengths[start : start + 2].max())
        assert torch.equal(m.input_ids, batch.input_ids[start : start + 2, : m.input_ids.shape[1]])


def test_cuda_loss_function_returns_the_cpu_tiers_sums_and_the_token_count(cpu_world):
    torch.manual_seed(0)
    model = build_model(train_args(), VOCAB, torch.device("cpu"))
    batch = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=3), pad_id=0)
    micro = batch.rows(0, 4)
    cpu = forward_backward_step(model, micro, LOSS, micro.num_loss_tokens, VOCAB, cpu_world)
    ids = micro.input_ids
    logits = model(ids, torch.arange(ids.shape[1])[None].expand_as(ids), None)
    sums: list[torch.Tensor] = []
    loss_sum, num_tokens, report = _loss(
        micro, MicroBatchTerms(), logits, loss_config=LOSS, vocab_size=VOCAB, ctx=cpu_world,
        sums=sums,
    )  # fmt: skip
    assert int(num_tokens) == micro.num_loss_tokens and num_tokens.dtype == torch.int32
    assert float(loss_sum.detach()) == pytest.approx(float(cpu.loss_sum.detach()), rel=1e-6)
    assert loss_sum.requires_grad  # megatron-core backpropagates the sum
    want = [cpu.loss_sum.detach(), cpu.clipped_tokens, cpu.ratio_sum, cpu.mismatch_kl_sum]
    assert sums[0].tolist() == pytest.approx([float(w) for w in want], rel=1e-6)


def test_clip_grad_zero_measures_without_clipping():
    assert NO_CLIP > 1e20


# ------------------------------------------------------------- CUDA tier on one GPU


@pytest.fixture
def cuda_world():
    from megatron.training.initialize import initialize_distributed, shutdown_distributed

    ctx = initialize_distributed(train_args())
    yield ctx
    shutdown_distributed()


def run_steps(tier, steps: int = 2, seed: int = 3):
    torch.manual_seed(seed)
    model = tier.build_model(VOCAB)
    optimizer, scheduler = tier.build_optimizer(model)
    results = []
    for step in range(steps):
        batch = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=step), pad_id=0)
        results.append(tier.train_step(model, optimizer, scheduler, batch, LOSS, VOCAB))
    return model, optimizer, scheduler, results


@pytest.mark.gpu
@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "dist-opt"])
def test_cuda_tier_steps_match_the_cpu_tier_on_the_same_gpu(cuda_world, distributed_optimizer):
    args = train_args(use_distributed_optimizer=distributed_optimizer)
    _, _, _, cpu = run_steps(CPUTier(args, cuda_world))
    model, _, _, cuda = run_steps(CUDATier(args, cuda_world))
    for a, b in zip(cpu, cuda):
        assert b.loss == pytest.approx(a.loss, rel=1e-4, abs=1e-6)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-4)
        assert b.lr == pytest.approx(a.lr)
        assert b.loss_tokens == a.loss_tokens


@pytest.mark.gpu
def test_cuda_tier_bf16_tracks_fp32(cuda_world):
    _, _, _, fp32 = run_steps(CUDATier(train_args(), cuda_world))
    _, _, _, bf16 = run_steps(CUDATier(train_args(bf16=True), cuda_world))
    for a, b in zip(fp32, bf16):
        assert b.loss == pytest.approx(a.loss, rel=5e-2, abs=5e-3)


@pytest.mark.gpu
def test_dist_checkpoint_round_trip_continues_identically(cuda_world, tmp_path):
    from megatron.rl.rollout.generator import PipelineState

    args = train_args()
    tier = CUDATier(args, cuda_world)
    model, optimizer, scheduler, _ = run_steps(tier, steps=1)
    state = PipelineState(
        next_batch_id=1, submitted=1, forced_lag=0, groups_per_batch=2, group_size=4, groups=[]
    )
    tier.save_checkpoint(str(tmp_path), 1, model, optimizer, scheduler, state)
    batch = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=9), pad_id=0)
    want = tier.train_step(model, optimizer, scheduler, batch, LOSS, VOCAB)

    torch.manual_seed(123)  # different initial weights: everything must come from the checkpoint
    fresh = tier.build_model(VOCAB)
    fresh_opt, fresh_sched = tier.build_optimizer(fresh)
    resumed = tier.load_checkpoint(str(tmp_path), fresh, fresh_opt, fresh_sched)
    assert resumed.iteration == 1 and resumed.pipeline == state
    got = tier.train_step(fresh, fresh_opt, fresh_sched, batch, LOSS, VOCAB)
    assert got.loss == pytest.approx(want.loss, rel=1e-6)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-6)
    assert got.lr == want.lr


@pytest.mark.gpu
def test_cuda_tier_engine_is_megatron_cores_dynamic_engine(cuda_world):
    from megatron.rl.inference.dynamic_engine import (
        DynamicEngineRunner,
        DynamicInferenceEngineAdapter,
    )

    tier = CUDATier(train_args(), cuda_world)
    model = tier.build_model(VOCAB)
    config = LocalEngineConfig(max_requests=4, max_seq_len=32, eos_id=1)
    steps = tier.build_step_group(model, config, VOCAB)
    assert isinstance(steps.runner, DynamicEngineRunner) and isinstance(steps.runner, RowRunner)
    engine = tier.build_engine(steps, config, lambda: 0)
    assert isinstance(engine, DynamicInferenceEngineAdapter)
    assert isinstance(engine, InferenceEngine)
    assert "DynamicInferenceEngine" in tier.describe()


def test_the_cpu_tier_passes_step_options_through(cpu_world):
    from megatron.training.train_step import StepOptions

    tier = CPUTier(train_args(), cpu_world)
    torch.manual_seed(3)
    model = tier.build_model(VOCAB)
    optimizer, scheduler = tier.build_optimizer(model)
    batch = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=1), pad_id=0)
    options = StepOptions(iterations=2)
    result = tier.train_step(model, optimizer, scheduler, batch, LOSS, VOCAB, options=options)
    assert math.isfinite(result.loss)


def test_the_cuda_tier_refuses_step_options_it_does_not_implement(cpu_world):
    from megatron.training.train_step import StepOptions

    tier = CUDATier(train_args(), cpu_world)
    with pytest.raises(NotImplementedError, match="packing"):
        tier.train_step(None, None, None, None, LOSS, VOCAB, StepOptions(packing_capacity=32))
    with pytest.raises(NotImplementedError, match="KL"):
        tier.train_step(None, None, None, None, GRPOLossConfig(0.2, 0.28, kl_beta=0.1), VOCAB)
