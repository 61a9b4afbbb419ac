"""Tiny megatron-core GPT models for tests, built by the project's own model provider."""

from __future__ import annotations

import argparse

import torch
from megatron.core import parallel_state

from megatron.trainer.model_provider import build_model

VOCAB = 21


def tiny_args(**overrides) -> argparse.Namespace:
    """Flags of a 2-layer, 32-wide GPT (the fields the model provider reads)."""
    values = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=32,
        max_position_embeddings=32,
        make_vocab_size_divisible_by=8,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        # the toy architecture (the defaults of the model flags)
        group_query_attention=False,
        num_query_groups=None,
        kv_channels=None,
        position_embedding_type="learned_absolute",
        rotary_base=10000,
        rotary_percent=1.0,
        use_rope_scaling=False,
        rope_scaling_factor=8.0,
        normalization="LayerNorm",
        norm_epsilon=1e-5,
        swiglu=False,
        disable_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=False,
        untie_embeddings_and_output_weights=False,
        hf_config=None,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def tiny_gpt(tp: int = 1, seed: int = 0, **overrides) -> torch.nn.Module:
    """Initialize parallel state for ``tp`` (world must exist) and build a seeded tiny GPT."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    return build_model(
        tiny_args(tensor_model_parallel_size=tp, **overrides), VOCAB, torch.device("cpu")
    )
