"""Model flags -> ``GPTArchitecture`` -> the megatron-core ``GPTModel`` trained and used for rollouts.

``architecture(cfg, vocab_size)`` is the one mapping of the model options (``flags/model.py``; with
``--hf-checkpoint`` they were set from ``config.json``, whose architecture is taken verbatim). The
tiers build the model with ``megatron.rl.models.architecture`` and their own precision and
fusions; ``build_model`` is the CPU tier's.
"""

from __future__ import annotations

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


def architecture(cfg: RunConfig, vocab_size: int) -> GPTArchitecture:
    """The model of the flags for a tokenizer of ``vocab_size`` ids (the embedding is padded to
    ``--make-vocab-size-divisible-by``); ``--hf-checkpoint``'s own architecture when given."""
    if cfg.hf is not None:
        return cfg.hf.arch
    scaling = None
    if cfg.model.use_rope_scaling:
        scaling = RopeScaling(factor=cfg.model.rope_scaling_factor, **LLAMA3_SCALING)
    return GPTArchitecture(
        num_layers=cfg.model.num_layers,
        hidden_size=cfg.model.hidden_size,
        num_attention_heads=cfg.model.num_attention_heads,
        ffn_hidden_size=cfg.model.ffn_hidden_size,
        vocab_size=padded_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by),
        max_position_embeddings=cfg.model.max_position_embeddings,
        num_query_groups=cfg.model.num_query_groups if cfg.model.group_query_attention else None,
        kv_channels=cfg.model.kv_channels,
        position_embedding_type=cfg.model.position_embedding_type,
        rotary_base=cfg.model.rotary_base,
        rotary_percent=cfg.model.rotary_percent,
        rope_scaling=scaling,
        normalization=cfg.model.normalization,
        norm_epsilon=cfg.model.norm_epsilon,
        swiglu=cfg.model.swiglu,
        add_bias_linear=not cfg.model.disable_bias_linear,
        add_qkv_bias=cfg.model.add_qkv_bias,
        qk_layernorm=cfg.model.qk_layernorm,
        untie_embeddings_and_output_weights=cfg.model.untie_embeddings_and_output_weights,
    )


def parallel_overrides(cfg: RunConfig) -> dict:
    """The TransformerConfig fields of the parallel layout."""
    return dict(
        tensor_model_parallel_size=cfg.parallelism.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.parallelism.pipeline_model_parallel_size,
    )


def build_model(
    cfg: RunConfig, vocab_size: int, device: torch.device, initialize: bool = True
) -> GPTModel:
    """The CPU tier's GPT (SDPA core attention, float32, one pipeline stage) of the flags, for a
    tokenizer of ``vocab_size`` ids. ``initialize=False`` skips megatron-core's random init
    (``perform_initialization``): for a model whose every tensor a checkpoint load overwrites."""
    arch = architecture(cfg, vocab_size)
    config = transformer_config(arch, **parallel_overrides(cfg), perform_initialization=initialize)
    model = build_gpt_model(arch, config, layer_spec(arch, SDPASpecProvider())).to(device)
    return plain_output_layer(model)
