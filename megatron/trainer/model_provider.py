"""Model flags -> ``GPTArchitecture`` -> the megatron-core ``GPTModel`` trained and used for rollouts.

``architecture(args, vocab_size)`` is the one mapping of the model flags (``model_flags.py``; with
``--hf-checkpoint`` they were set from ``config.json``, whose architecture is taken verbatim). The
tiers build the model with ``megatron.rl.models.architecture`` and their own precision and
fusions; ``build_model`` is the CPU tier's.
"""

from __future__ import annotations

import argparse

import torch
from megatron.core.models.gpt import GPTModel

from megatron.rl.models.architecture import (
    GPTArchitecture,
    RopeScaling,
    build_gpt_model,
    layer_spec,
    transformer_config,
)
from megatron.rl.models.gpt_spec import SDPASpecProvider, plain_output_layer

LLAMA3_SCALING = dict(
    low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
"""Megatron-LM's fixed Llama 3 RoPE scaling values (``--use-rope-scaling``)."""


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Embedding rows: ``vocab_size`` rounded up to a multiple of ``divisible_by``.

    The multiple does not depend on the TP degree, so every parallel layout builds (and, from the
    same seed, initializes) the same embedding table.
    """
    return -(-vocab_size // divisible_by) * divisible_by


def architecture(args: argparse.Namespace, vocab_size: int) -> GPTArchitecture:
    """The model of the flags for a tokenizer of ``vocab_size`` ids (the embedding is padded to
    ``--make-vocab-size-divisible-by``); ``--hf-checkpoint``'s own architecture when given."""
    if args.hf_config is not None:
        return args.hf_config.arch
    scaling = None
    if args.use_rope_scaling:
        scaling = RopeScaling(factor=args.rope_scaling_factor, **LLAMA3_SCALING)
    return GPTArchitecture(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by),
        max_position_embeddings=args.max_position_embeddings,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rope_scaling=scaling,
        normalization=args.normalization,
        norm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
    )


def parallel_overrides(args: argparse.Namespace) -> dict:
    """The TransformerConfig fields of the parallel layout."""
    return dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )


def build_model(
    args: argparse.Namespace, vocab_size: int, device: torch.device, initialize: bool = True
) -> GPTModel:
    """The CPU tier's GPT (SDPA core attention, float32, one pipeline stage) of the flags, for a
    tokenizer of ``vocab_size`` ids. ``initialize=False`` skips megatron-core's random init
    (``perform_initialization``): for a model whose every tensor a checkpoint load overwrites."""
    arch = architecture(args, vocab_size)
    config = transformer_config(arch, **parallel_overrides(args), perform_initialization=initialize)
    model = build_gpt_model(arch, config, layer_spec(arch, SDPASpecProvider())).to(device)
    return plain_output_layer(model)
