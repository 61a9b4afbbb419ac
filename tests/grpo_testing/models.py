"""Tiny megatron-core GPT models for tests, built by the project's own model provider."""

from __future__ import annotations

import torch
import torch.distributed as dist
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


# SwiGLU (gated fc1), grouped-query attention (the QKV interleave), RoPE and RMSNorm
LLAMA_LIKE = dict(
    swiglu=True,
    group_query_attention=True,
    num_query_groups=2,
    position_embedding_type="rope",
    normalization="RMSNorm",
)
TOKENS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


def logits_of(model: torch.nn.Module, group) -> torch.Tensor:
    """Full-vocabulary logits of ``TOKENS`` (gathered over ``group``, the model's TP ranks)."""
    model.eval()
    with torch.no_grad():
        local = model(TOKENS, torch.arange(TOKENS.shape[1])[None], None)
    if group is None or dist.get_world_size(group) == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)
