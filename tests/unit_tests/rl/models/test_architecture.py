"""``GPTArchitecture``: the toy model exactly, validation by field, RMSNorm and QK-norm specs."""

from __future__ import annotations

import dataclasses

import megatron.core.models.backends as mcore_backends
import pytest
import torch
from grpo_testing.models import VOCAB, tiny_args
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron.rl.models.architecture import (
    GPTArchitecture,
    RopeScaling,
    build_gpt_model,
    layer_spec,
    transformer_config,
)
from megatron.rl.models.gpt_spec import SDPASpecProvider, gpt_layer_spec
from megatron.rl.models.rope import RoPEGPTModel
from megatron.trainer.model.provider import padded_vocab_size

TOY = GPTArchitecture(  # tests/grpo_testing/models.py's tiny_args, as an architecture
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    vocab_size=padded_vocab_size(VOCAB, 8),
    max_position_embeddings=32,
)
LLAMA_LIKE = GPTArchitecture(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=48,
    vocab_size=64,
    max_position_embeddings=64,
    num_query_groups=2,
    kv_channels=16,
    position_embedding_type="rope",
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16),
    normalization="RMSNorm",
    norm_epsilon=1e-6,
    swiglu=True,
    add_bias_linear=False,
    add_qkv_bias=True,
    qk_layernorm=True,
    untie_embeddings_and_output_weights=True,
)


@pytest.fixture
def tp1(single_rank_world):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def test_toy_model_is_expressible_and_builds_the_same_model_bitwise(tp1):
    # megatron-core's GPTModel as the trainer built the toy before GPTArchitecture existed
    torch.manual_seed(5)
    args = tiny_args()
    reference = GPTModel(
        config=TransformerConfig(
            num_layers=args.model.num_layers,
            hidden_size=args.model.hidden_size,
            num_attention_heads=args.model.num_attention_heads,
            ffn_hidden_size=args.model.ffn_hidden_size,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
        ),
        transformer_layer_spec=gpt_layer_spec(SDPASpecProvider()),
        vocab_size=padded_vocab_size(VOCAB, args.model.make_vocab_size_divisible_by),
        max_sequence_length=args.model.max_position_embeddings,
        parallel_output=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    torch.manual_seed(5)
    ours = build_gpt_model(TOY, transformer_config(TOY), layer_spec(TOY, SDPASpecProvider()))
    assert type(ours) is GPTModel and ours.position_embedding_type == "learned_absolute"
    assert ours.share_embeddings_and_output_weights
    ref_state, our_state = reference.state_dict(), ours.state_dict()
    assert list(ref_state) == list(our_state)
    for name, tensor in ref_state.items():
        assert tensor is None or torch.equal(tensor, our_state[name]), name
    ids = torch.randint(0, VOCAB, (2, 9))
    positions = torch.arange(9)[None, :].expand(2, 9)
    assert torch.equal(reference(ids, positions, None), ours(ids, positions, None))
    assert tiny_args().model.max_position_embeddings == TOY.max_position_embeddings


def test_megatron_core_builds_the_mlp_without_rewrapping_the_spec(tp1, caplog):
    """megatron-core 0.18+ rewraps a ``ModuleSpec`` of ``MLP`` into ``MLP.as_mlp_submodule`` and
    warns at every model build: the spec gives it that call directly there."""
    import logging

    with caplog.at_level(logging.WARNING, logger="megatron.core.transformer.transformer_layer"):
        model = build_gpt_model(TOY, transformer_config(TOY), layer_spec(TOY, SDPASpecProvider()))
    assert not [r for r in caplog.records if "Rewrapping" in r.getMessage()]
    assert type(model.decoder.layers[0].mlp).__name__ == "MLP"


def test_default_spec_uses_megatron_cores_layer_norm_and_no_qk_norm():
    spec = gpt_layer_spec(SDPASpecProvider())
    assert spec == gpt_layer_spec(SDPASpecProvider(), qk_layernorm=False, normalization="LayerNorm")
    assert spec.submodules.input_layernorm is mcore_backends.LNImpl
    assert spec.submodules.self_attention.submodules.q_layernorm is IdentityOp


def test_rms_norm_spec_builds_torch_rms_norms_without_changing_megatron_cores_default():
    before = mcore_backends.LNImpl
    spec = gpt_layer_spec(SDPASpecProvider(), qk_layernorm=True, normalization="RMSNorm")
    assert mcore_backends.LNImpl is before  # LocalSpecProvider would have rebound it
    assert spec.submodules.self_attention.submodules.q_layernorm is spec.submodules.input_layernorm
    with pytest.raises(ValueError, match="'L2Norm'"):
        gpt_layer_spec(SDPASpecProvider(), normalization="L2Norm")


def test_llama_like_model_has_rms_norms_qk_norms_swiglu_and_untied_output(tp1):
    model = build_gpt_model(
        LLAMA_LIKE, transformer_config(LLAMA_LIKE), layer_spec(LLAMA_LIKE, SDPASpecProvider())
    )
    assert isinstance(model, RoPEGPTModel)
    layer = model.decoder.layers[0]
    assert isinstance(layer.input_layernorm, torch.nn.RMSNorm)
    assert layer.input_layernorm.eps == 1e-6
    assert isinstance(layer.self_attention.q_layernorm, torch.nn.RMSNorm)
    assert layer.self_attention.q_layernorm.normalized_shape == (16,)
    assert layer.self_attention.linear_qkv.weight.shape == ((4 + 2 * 2) * 16, 32)
    assert layer.self_attention.linear_qkv.bias is not None
    assert layer.self_attention.linear_proj.bias is None
    assert layer.mlp.linear_fc1.weight.shape == (2 * 48, 32) and layer.mlp.linear_fc1.bias is None
    assert model.output_layer.weight is not None and not model.share_embeddings_and_output_weights
    assert model(torch.zeros(1, 3, dtype=torch.long), None, None).shape == (1, 3, 64)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_layers=0), "num_layers: must be a positive integer"),
        (dict(num_query_groups=3), "num_query_groups: 3 does not divide num_attention_heads=4"),
        (dict(hidden_size=30, kv_channels=None), "kv_channels: None needs hidden_size=30"),
        (dict(position_embedding_type="alibi"), "position_embedding_type: 'alibi'"),
        (dict(normalization="L2Norm"), "normalization: 'L2Norm'"),
        (dict(norm_epsilon=0.0), "norm_epsilon: must be > 0"),
        (dict(rotary_percent=0.0), "rotary_percent: must be in"),
        (
            dict(position_embedding_type="learned_absolute"),
            "rope_scaling: needs position_embedding",
        ),
        (dict(rope_scaling=RopeScaling(8.0, 4.0, 1.0, 16)), "rope_scaling: needs 0 < low_freq"),
        (dict(kv_channels=15), "rotary_percent: rotates an odd number of channels of 15"),
    ],
)
def test_validate_names_the_field(change, message):
    with pytest.raises(ValueError, match=f"GPTArchitecture.{message}"):
        dataclasses.replace(LLAMA_LIKE, **change).validate()


def test_validate_names_the_tensor_parallel_degree():
    with pytest.raises(ValueError, match="num_query_groups: 2 is not divisible by tensor_model_"):
        LLAMA_LIKE.validate(tensor_model_parallel_size=4)
    LLAMA_LIKE.validate(tensor_model_parallel_size=2)


def test_a_config_that_disagrees_with_the_architecture_is_refused(tp1):
    config = transformer_config(LLAMA_LIKE, normalization="LayerNorm")
    with pytest.raises(ValueError, match=r"TransformerConfig.normalization='LayerNorm' disagrees"):
        build_gpt_model(LLAMA_LIKE, config, layer_spec(LLAMA_LIKE, SDPASpecProvider()))


def test_tier_overrides_reach_the_config():
    config = transformer_config(TOY, tensor_model_parallel_size=2, params_dtype=torch.bfloat16)
    assert config.tensor_model_parallel_size == 2 and config.params_dtype is torch.bfloat16
    assert config.activation_func is torch.nn.functional.gelu and not config.gated_linear_unit
    llama = transformer_config(LLAMA_LIKE)
    assert llama.gated_linear_unit and llama.activation_func is torch.nn.functional.silu
    assert (llama.num_query_groups, llama.kv_channels, llama.layernorm_epsilon) == (2, 16, 1e-6)


class FusedNormLinear:
    """Stands in for Transformer Engine's fused norm + column-parallel linear."""


class RecordingFusedBackend(SDPASpecProvider):
    """A Transformer-Engine-like backend (fused input norms) that records its norm requests."""

    def __init__(self) -> None:
        self.norm_requests: list[tuple[bool, bool]] = []

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self) -> type:
        return FusedNormLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        self.norm_requests.append((rms_norm, for_qk))
        return super().layer_norm(rms_norm, for_qk)


def test_fused_backends_get_rms_qk_norms_and_norm_linear_modules():
    backend = RecordingFusedBackend()
    spec = gpt_layer_spec(backend, qk_layernorm=True, normalization="RMSNorm")
    assert backend.norm_requests == [(True, False), (True, True)]
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    assert layer.input_layernorm is IdentityOp and layer.pre_mlp_layernorm is IdentityOp
    assert attention.linear_qkv is FusedNormLinear and layer.mlp.submodules.linear_fc1 is (
        FusedNormLinear
    )
    assert attention.q_layernorm is attention.k_layernorm is WrappedTorchNorm


@pytest.mark.parametrize(
    "initialize", [pytest.param(True, id="random-init"), pytest.param(False, id="for-a-load")]
)
def test_tensor_parallel_weights_are_tagged_with_or_without_random_init(tp1, initialize):
    """megatron-core tags TP shards only while initializing them; a model built for a checkpoint
    load gets the same tags, or every gradient norm at TP > 1 counts its shards once."""
    config = transformer_config(LLAMA_LIKE, perform_initialization=initialize)
    model = build_gpt_model(LLAMA_LIKE, config, layer_spec(LLAMA_LIKE, SDPASpecProvider()))
    tags = {
        name: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", -1))
        for name, p in model.named_parameters()
    }
    assert tags["embedding.word_embeddings.weight"] == (True, 0)
    assert tags["output_layer.weight"] == (True, 0)
    assert tags["decoder.layers.0.self_attention.linear_qkv.weight"] == (True, 0)
    assert tags["decoder.layers.0.self_attention.linear_proj.weight"] == (True, 1)
    assert tags["decoder.layers.1.mlp.linear_fc1.weight"] == (True, 0)
    assert tags["decoder.layers.1.mlp.linear_fc2.weight"] == (True, 1)
    assert not tags["decoder.layers.0.self_attention.q_layernorm.weight"][0]  # replicated
    assert not tags["decoder.final_layernorm.weight"][0]
