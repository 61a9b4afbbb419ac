"""The CPU tier: what it builds, that its step honours the step config, its engine and shards."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.batches import build_train_batch
from grpo_testing.models import VOCAB
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import grpo_update, one_rank_context, step_config, train_args
from megatron.core import parallel_state

from megatron.rl.inference.cpu.kv_cache_runner import KVCacheRowRunner
from megatron.rl.inference.protocol import InferenceEngine, RowRunner
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.models.attention import SDPACoreAttention
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.config import tier_config
from megatron.trainer.tiers.cpu import CPUTier
from megatron.trainer.tiers.cpu_checkpoint import TorchShards
from megatron.trainer.train.losses import GRPOLoss
from megatron.trainer.train.policy import PolicyConfig
from megatron.trainer.train.step import MicroBatchCache


@pytest.fixture
def tier(single_rank_world) -> CPUTier:
    parallel_state.initialize_model_parallel()
    return CPUTier(tier_config(train_args()), one_rank_context())


def test_the_model_is_a_float32_gpt_with_sdpa_attention_and_a_padded_tied_vocabulary(tier):
    model = tier.build_model(VOCAB)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    attention = model.decoder.layers[0].self_attention.core_attention
    assert isinstance(attention, SDPACoreAttention)
    rows = model.embedding.word_embeddings.weight.shape[0]
    assert rows == 24  # VOCAB 21 padded to --make-vocab-size-divisible-by 8
    assert model.share_embeddings_and_output_weights and model.output_layer.weight is None
    ids = torch.tensor([[2, 3, 4]])
    assert model(ids, torch.arange(3)[None], None).shape == (1, 3, rows)


def test_a_step_is_one_update_and_one_schedule_step(tier):
    torch.manual_seed(3)
    model = tier.build_model(VOCAB)
    state = TrainState(model, *tier.build_optimizer(model))
    batch = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=1), pad_id=0)
    before = [p.detach().clone() for p in model.parameters()]
    config = step_config(VOCAB)
    result = grpo_update(tier.build_policy(state, PolicyConfig.of(config)), batch, config)
    first_param = next(iter(model.parameters()))
    assert state.optimizer.state[first_param]["step"].item() == 1
    assert state.scheduler.num_steps == 1
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert result.trained_tokens == int(batch.lengths.sum())
    assert result.loss_tokens == batch.num_loss_tokens


def test_pi_old_filled_up_front_equals_the_policy_before_the_update(tier):
    torch.manual_seed(3)
    model = tier.build_model(VOCAB)
    state = TrainState(model, *tier.build_optimizer(model))
    batch = build_train_batch(synthetic_groups(2, 4, VOCAB, seed=1), pad_id=0)
    config = step_config(VOCAB, old_logprobs=True)
    policy = tier.build_policy(state, PolicyConfig.of(config))
    upfront = policy.get_logprobs(batch)  # (B, T)
    lazy = [MicroBatchCache(), MicroBatchCache()]
    (result,) = policy.train(batch, GRPOLoss(config), caches=lazy)  # pi_old from its forward
    for rows, cache in zip((slice(0, 4), slice(4, 8)), lazy):
        width = cache.old_logprobs.shape[1]
        assert torch.equal(upfront[rows, :width], cache.old_logprobs)
        assert torch.all(upfront[rows, width:] == 0)  # past the micro-batch's width: padding
    assert result.metrics["ratio_mean"] == 1.0


def test_the_engine_is_the_scheduler_over_kv_cache_runners(tier):
    model = tier.build_model(VOCAB)
    config = SchedulerConfig(max_requests=2, max_seq_len=32, eos_id=1)
    steps = tier.build_step_group(model, config, VOCAB)
    assert isinstance(steps.runner, KVCacheRowRunner) and isinstance(steps.runner, RowRunner)
    assert steps.runner.cache.keys.shape[1:4:2] == (2, 32)  # slots x sequence length
    engine = tier.build_engine(steps, config, lambda: 0)
    assert isinstance(engine, ContinuousBatchingScheduler) and isinstance(engine, InferenceEngine)


def test_shards_are_one_torch_file_per_tensor_parallel_rank(tier, tmp_path):
    shards = tier.checkpoint_shards()
    assert isinstance(shards, TorchShards)
    assert shards.path(tmp_path) == tmp_path / "mp_rank_00" / "model_optim_rng.pt"
