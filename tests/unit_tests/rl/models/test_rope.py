"""RoPE at per-row positions: equal to megatron-core's table at 0..T-1, exact Llama-3 scaling."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel

from megatron.rl.models.architecture import (
    GPTArchitecture,
    RopeScaling,
    build_gpt_model,
    layer_spec,
    transformer_config,
)
from megatron.rl.models.gpt_spec import SDPASpecProvider
from megatron.rl.models.rope import PositionalRotaryEmbedding, RoPEGPTModel, llama3_inv_freq

ARCH = GPTArchitecture(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=48,
    vocab_size=64,
    max_position_embeddings=64,
    num_query_groups=2,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
)


@pytest.fixture
def tp1(single_rank_world):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def rope_model(arch: GPTArchitecture = ARCH, seed: int = 0) -> RoPEGPTModel:
    torch.manual_seed(seed)
    model = build_gpt_model(arch, transformer_config(arch), layer_spec(arch, SDPASpecProvider()))
    return model.eval()


def test_table_at_positions_0_to_t_is_megatron_cores_table_bitwise(monkeypatch):
    reference = RotaryEmbedding(
        kv_channels=16, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # its get_emb moves to CUDA
    expected = reference.get_emb(11)  # (T, 1, 1, d)
    ours = PositionalRotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000)
    assert torch.equal(ours(11), expected)
    per_row = ours.at_positions(torch.arange(11)[None, :].expand(3, 11))  # (T, B, 1, d)
    assert per_row.shape == (11, 3, 1, 16)
    for b in range(3):
        assert torch.equal(per_row[:, b : b + 1], expected)
    shifted = ours.at_positions(torch.tensor([[5, 6, 7]]))
    assert torch.equal(shifted, reference.get_emb(3, offset=5))


def test_llama3_scaling_equals_megatron_core_for_its_hard_coded_values_and_hf_for_others():
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    reference = RotaryEmbedding.__new__(RotaryEmbedding)  # only _apply_scaling is used
    assert torch.equal(
        llama3_inv_freq(inv_freq, RopeScaling(8.0, 1.0, 4.0, 8192)),
        reference._apply_scaling(inv_freq, factor=8.0),
    )
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(factor=4.0, low_freq_factor=1.5, high_freq_factor=8.0)
    config = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", original_max_position_embeddings=64, **scaling),
    )
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    ours = llama3_inv_freq(inv_freq, RopeScaling(original_max_position_embeddings=64, **scaling))
    assert torch.equal(ours, hf_inv_freq)
    assert not torch.equal(ours, reference._apply_scaling(inv_freq, factor=4.0))


def test_explicit_positions_0_to_t_equal_the_default_forward_bitwise(tp1):
    model = rope_model()
    ids = torch.randint(0, 64, (3, 10))
    positions = torch.arange(10)[None, :].expand(3, 10)
    assert torch.equal(model(ids, positions, None), model(ids, None, None))


def test_each_row_is_rotated_at_its_own_positions(tp1):
    """One sequence at three offsets gives the same logits (RoPE is relative); a gap inside one
    row changes that row's later tokens only."""
    model = rope_model(dataclasses.replace(ARCH, rope_scaling=RopeScaling(4.0, 1.0, 4.0, 16)))
    ids = torch.randint(0, 64, (1, 6)).expand(3, 6)
    offsets = torch.tensor([0, 7, 30])[:, None]
    positions = offsets + torch.arange(6)[None, :]  # (B, T): one sequence at three offsets
    out = model(ids, positions, None)
    torch.testing.assert_close(out[1], out[0], atol=1e-5, rtol=0)  # RoPE is relative
    torch.testing.assert_close(out[2], out[0], atol=1e-5, rtol=0)
    skewed = positions.clone()
    skewed[1, 3:] += 5  # a gap inside row 1 only: its later tokens must change
    changed = model(ids, skewed, None)
    assert torch.equal(changed[0], out[0]) and torch.equal(changed[2], out[2])
    assert torch.equal(changed[1, :3], out[1, :3])
    assert (changed[1, 3:] - out[1, 3:]).abs().max() > 1e-4  # float noise here: ~1e-7


def test_inference_context_and_packed_params_keep_megatron_cores_table(tp1, monkeypatch):
    model = rope_model()
    sentinel = ("decoder_input", "megatron-core's table", None, None, None, None)
    monkeypatch.setattr(GPTModel, "_preprocess", lambda self, **kwargs: sentinel)
    positions = torch.arange(4)[None, :]
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert model._preprocess(ids, positions, inference_context=object()) is sentinel
    assert model._preprocess(ids, positions, packed_seq_params=object()) is sentinel
    assert model._preprocess(ids, None) is sentinel
    replaced = model._preprocess(ids, positions)
    assert replaced[0] == "decoder_input" and replaced[1].shape == (4, 1, 1, 8)


def test_learned_absolute_models_are_megatron_cores_gpt_model(tp1):
    toy = dataclasses.replace(
        ARCH, position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False
    )
    assert type(rope_model(toy)) is GPTModel


@pytest.mark.parametrize("flag", ["apply_rope_fusion", "rotary_interleaved"])
def test_fused_or_interleaved_rope_is_refused(tp1, flag):
    config = transformer_config(ARCH)
    setattr(config, flag, True)  # TransformerConfig refuses apply_rope_fusion without TE itself
    with pytest.raises(ValueError, match=f"TransformerConfig.{flag}=True is not supported"):
        build_gpt_model(ARCH, config, layer_spec(ARCH, SDPASpecProvider()))
