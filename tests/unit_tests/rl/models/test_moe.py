"""Mixture-of-experts GPTs on CPU: megatron-core's MoELayer with the CPU-safe router, built from
``GPTArchitecture.num_experts``; forward/backward, the aux loss and the load statistics."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron.rl.models.architecture import (
    GPTArchitecture,
    build_gpt_model,
    layer_spec,
    transformer_config,
)
from megatron.rl.models.gpt_spec import SDPASpecProvider
from megatron.rl.models.moe import CPUSafeRouter, moe_statistics, set_aux_loss_scale

MOE = GPTArchitecture(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    vocab_size=128,
    max_position_embeddings=32,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
)


def build(arch: GPTArchitecture, **overrides) -> torch.nn.Module:
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    config = transformer_config(arch, **overrides)
    return build_gpt_model(arch, config, layer_spec(arch, SDPASpecProvider()))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (3, 12), generator=g)  # (B, T)
    return ids, torch.arange(12)[None].expand(3, -1)


def test_moe_layers_are_megatron_cores_with_sequential_experts(single_rank_world):
    model = build(MOE)
    mlp = model.decoder.layers[0].mlp
    assert isinstance(mlp, MoELayer) and isinstance(mlp.router, CPUSafeRouter)
    assert isinstance(mlp.experts, SequentialMLP) and len(mlp.experts.local_experts) == 4
    fc1 = mlp.experts.local_experts[0].linear_fc1.weight
    assert tuple(fc1.shape) == (2 * 16, 32)  # [gate; up] of one expert
    assert tuple(mlp.router.weight.shape) == (4, 32)


@pytest.mark.parametrize(
    "balancing", [pytest.param("aux_loss", id="aux_loss"), pytest.param("seq_aux_loss", id="seq")]
)
def test_forward_backward_with_aux_loss(balancing, single_rank_world):
    model = build(MOE, moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=0.5)
    ids, positions = batch()
    model.train()
    set_aux_loss_scale(1.0, torch.device("cpu"))
    logits = model(ids, positions, None)  # (B, T, V)
    stats = moe_statistics(model)
    assert stats["moe_aux_loss"] > 0
    assert stats["moe_load_imbalance"] >= 1.0
    # the aux loss's gradient reaches the router through megatron-core's autoscaler only
    router = model.decoder.layers[0].mlp.router
    (logits.sum() * 0).backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.decoder.layers[1].mlp.parameters())


def test_no_aux_loss_without_coefficient_or_in_eval(single_rank_world):
    model = build(MOE, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.5)
    ids, positions = batch()
    with torch.no_grad():
        model.eval()(ids, positions, None)
    stats = moe_statistics(model)
    assert "moe_aux_loss" not in stats and stats["moe_load_imbalance"] >= 1.0
    dense = dataclasses.replace(MOE, num_experts=None, moe_ffn_hidden_size=None)
    parallel_state.destroy_model_parallel()
    assert moe_statistics(build(dense)) == {}


def test_tokens_per_expert_counts_every_routed_token(single_rank_world):
    model = build(MOE)
    ids, positions = batch()
    with torch.no_grad():
        model.eval()(ids, positions, None)
    for layer in model.decoder.layers:
        counts = layer.mlp.router.last_tokens_per_expert
        assert int(counts.sum()) == ids.numel() * MOE.moe_router_topk


@pytest.mark.parametrize(
    "change, field",
    [
        pytest.param(dict(moe_router_topk=5), "moe_router_topk", id="topk-over-experts"),
        pytest.param(dict(moe_router_topk=1), "moe_router_pre_softmax", id="top1-post-softmax"),
        pytest.param(dict(num_experts=0), "num_experts", id="no-experts"),
        pytest.param(dict(moe_ffn_hidden_size=-2), "moe_ffn_hidden_size", id="ffn"),
    ],
)
def test_validation_names_the_field(change, field):
    with pytest.raises(ValueError, match=f"GPTArchitecture.{field}"):
        dataclasses.replace(MOE, **change).validate()


def test_expert_parallel_validation():
    MOE.validate_expert_parallel(2)
    with pytest.raises(ValueError, match="num_experts"):
        MOE.validate_expert_parallel(3)
    with pytest.raises(ValueError, match="num_experts"):
        dataclasses.replace(MOE, num_experts=None).validate_expert_parallel(2)
    with pytest.raises(ValueError, match="moe_ffn_hidden_size"):
        dataclasses.replace(MOE, moe_ffn_hidden_size=15).validate(tensor_model_parallel_size=2)
