"""Builds the megatron-core ``GPTModel`` that is both trained and used for rollouts."""

from __future__ import annotations

import argparse

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron.rl.models.gpt_spec import SDPASpecProvider, gpt_layer_spec


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Embedding rows: ``vocab_size`` rounded up to a multiple of ``divisible_by``.

    The multiple does not depend on the TP degree, so every parallel layout builds (and, from the
    same seed, initializes) the same embedding table.
    """
    return -(-vocab_size // divisible_by) * divisible_by


def transformer_config(args: argparse.Namespace, **overrides) -> TransformerConfig:
    """megatron-core config of the model described by the flags (``overrides``: tier settings)."""
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Weights are initialized at full size on the CPU from the global seed and then split,
        # so TP=1 and TP=2 start from identical weights.
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def gpt_model(
    args: argparse.Namespace,
    vocab_size: int,
    config: TransformerConfig,
    layer_spec: ModuleSpec,
    pre_process: bool = True,
    post_process: bool = True,
) -> GPTModel:
    """The GPT (this pipeline stage's part) with learned absolute positions and tied embeddings."""
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by),
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )


def build_model(args: argparse.Namespace, vocab_size: int, device: torch.device) -> GPTModel:
    """The CPU tier's GPT described by ``args`` (SDPA core attention, float32, one stage)."""
    model = gpt_model(
        args, vocab_size, transformer_config(args), gpt_layer_spec(SDPASpecProvider())
    )
    return model.to(device)
