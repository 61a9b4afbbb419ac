"""Tiny megatron-core GPT models for tests, built by the project's own model provider."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron.trainer.config import model_build
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.model.provider import build_model

VOCAB = 21


def tiny_args(**overrides) -> RunConfig:
    """The run config of a 2-layer, 32-wide GPT (the toy architecture's other defaults);
    ``overrides`` by argparse dest (``seq_length=64``) or derived field (``hf=...``)."""
    values = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        seq_length=32,
        max_position_embeddings=32,
        make_vocab_size_divisible_by=8,
    )
    values.update(overrides)
    return RunConfig().with_flags(**values)


def tiny_gpt(tp: int = 1, seed: int = 0, **overrides) -> torch.nn.Module:
    """Initialize parallel state for ``tp`` (world must exist) and build a seeded tiny GPT."""
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    return build_model(
        model_build(tiny_args(tensor_model_parallel_size=tp, **overrides)),
        VOCAB,
        torch.device("cpu"),
    )
