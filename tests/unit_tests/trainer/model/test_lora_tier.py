"""A LoRA run on the CPU tier: the model the tier builds, the reference (the base, no second copy),
adapter-only checkpoints that refuse another base, a full checkpoint as the base of --finetune."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.batches import build_train_batch
from grpo_testing.models import VOCAB, tiny_args
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import one_rank_context
from megatron.core import parallel_state

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.rollout.generator import PipelineState
from megatron.trainer.checkpoint import directory as checkpointing
from megatron.trainer.checkpoint.directory import LoadOptions, TrainState
from megatron.trainer.config import tier_config
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.runtime.initialize import set_seeds
from megatron.trainer.tiers.cpu import CPUTier
from megatron.trainer.tiers.cpu_checkpoint import TorchShards
from megatron.trainer.tiers.reference import build_reference_model
from megatron.trainer.train.policy import PolicyConfig

pytestmark = pytest.mark.usefixtures("single_rank_world")

LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    group_query_attention=True,
    num_query_groups=2,
)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_args(**overrides):
    values = dict(
        seed=5,
        lr=1e-2,
        min_lr=0.0,
        lr_warmup_iters=0,
        train_iters=10,
        grpo_kl_beta=0.1,
        rl_forced_lag=0,
        grpo_prompts_per_step=1,
        grpo_group_size=2,
        lora_rank=4,
        lora_alpha=8.0,
        lora_target_modules=TARGETS,
        **LLAMA,
    )
    values.update(overrides)
    return tiny_args(**values)


def context() -> ParallelContext:
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    return one_rank_context()


def build(args, ctx):
    """What ``grpo.build_run`` builds: seeded model (LoRA), reference, optimizer."""
    set_seeds(args.training.seed, cuda=False)
    tier = CPUTier(tier_config(args), ctx)
    model = tier.build_model(VOCAB)
    reference = build_reference_model(tier, model, VOCAB, True)
    return tier, TrainState(model, *tier.build_optimizer(model)), reference


def train_batch() -> TrainBatch:
    """8 right-padded rows (temperatures 1.0 and 0.8)."""
    return build_train_batch(synthetic_groups(2, 4, VOCAB, seed=1), pad_id=0)


def pipeline() -> PipelineState:
    return PipelineState(
        next_batch_id=1, submitted=1, forced_lag=0, groups_per_batch=1, group_size=2, groups=[]
    )


def randomize_adapters(model) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("lora.") and "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_the_reference_is_the_policy_with_its_adapters_off():
    args, ctx = lora_args(), context()
    tier, state, reference = build(args, ctx)
    assert reference is state.model  # no second copy of the weights
    trained = [n for n, p in state.model.named_parameters() if p.requires_grad]
    assert trained and all(n.startswith("lora.") for n in trained)
    assert {id(p) for g in state.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in state.model.parameters() if p.requires_grad
    }
    policy = tier.build_policy(state, PolicyConfig(VOCAB, 4, 1.0), reference)
    batch = train_batch()
    before = policy.get_logprobs(batch)
    assert torch.equal(policy.get_reference_policy_logprobs(batch), before)  # B = 0: the base
    randomize_adapters(state.model)
    after = policy.get_logprobs(batch)
    assert (after - before).abs().max() > 1e-3
    assert torch.equal(policy.get_reference_policy_logprobs(batch), before)  # still the base


def test_a_lora_checkpoint_holds_the_adapters_and_their_optimizer_state_only(tmp_path):
    args, ctx = lora_args(), context()
    _, state, _ = build(args, ctx)
    randomize_adapters(state.model)
    checkpointing.save_checkpoint(tmp_path, 3, TorchShards(ctx), state, pipeline(), args, ctx)
    payload = torch.load(
        tmp_path / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True
    )
    assert payload["model"] and all(k.startswith("lora.") for k in payload["model"])
    assert "lora_base" in payload and payload["cfg"]["lora_target_modules"] == TARGETS
    _, other, _ = build(args, ctx)
    checkpointing.load_checkpoint(tmp_path, TorchShards(ctx), other, args, ctx, LoadOptions())
    for (name, a), (_, b) in zip(
        state.model.state_dict().items(), other.model.state_dict().items()
    ):
        assert a is None or torch.equal(a, b), name


def test_adapters_of_another_base_are_refused_naming_the_flag(tmp_path):
    ctx = context()
    _, state, _ = build(lora_args(), ctx)
    checkpointing.save_checkpoint(
        tmp_path, 3, TorchShards(ctx), state, pipeline(), lora_args(), ctx
    )
    other_base = lora_args()
    _, other, _ = build(other_base, ctx)
    with torch.no_grad():  # another base model, the same shapes
        other.model.decoder.layers[0].self_attention.linear_qkv.weight.mul_(1.5)
    with pytest.raises(SystemExit, match="trained on another base model"):
        checkpointing.load_checkpoint(
            tmp_path, TorchShards(ctx), other, other_base, ctx, LoadOptions()
        )


def test_a_full_checkpoint_is_the_base_of_a_lora_finetune(tmp_path):
    ctx = context()
    full_args = lora_args(lora_rank=0, lora_alpha=None, lora_target_modules=("linear_qkv",))
    _, full, _ = build(full_args, ctx)
    with torch.no_grad():
        for p in full.model.parameters():
            p.add_(0.01)
    checkpointing.save_checkpoint(tmp_path, 2, TorchShards(ctx), full, pipeline(), full_args, ctx)
    args = lora_args(finetune=True, load=str(tmp_path))
    _, lora, _ = build(args, ctx)
    options = LoadOptions(optimizer=False, rng=False, resume=False)
    checkpointing.load_checkpoint(tmp_path, TorchShards(ctx), lora, args, ctx, options)
    base = {k: v for k, v in lora.model.state_dict().items() if not k.startswith("lora.")}
    for name, value in full.model.state_dict().items():
        assert value is None or torch.equal(base[name].float(), value.float()), name
