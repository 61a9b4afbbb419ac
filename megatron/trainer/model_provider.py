"""The model section -> ``GPTArchitecture`` -> the megatron-core ``GPTModel`` trained and used for
rollouts.

``architecture(cfg, vocab_size)`` is the run's model (``flags.model.gpt_architecture``: the model
section's options, or ``--hf-checkpoint``'s ``config.json`` architecture verbatim). The tiers build the model with ``megatron.rl.models.architecture`` and their own precision and
fusions; ``build_model`` is the CPU tier's.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from megatron.rl.models.architecture import (
    GPTArchitecture,
    build_gpt_model,
    layer_spec,
    transformer_config,
)
from megatron.rl.models.gpt_spec import SDPASpecProvider, plain_output_layer
from megatron.trainer.flags.model import gpt_architecture
from megatron.trainer.flags.run import RunConfig


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Embedding rows: ``vocab_size`` rounded up to a multiple of ``divisible_by``.

    The multiple does not depend on the TP degree, so every parallel layout builds (and, from the
    same seed, initializes) the same embedding table.
    """
    return -(-vocab_size // divisible_by) * divisible_by


def architecture(cfg: RunConfig, vocab_size: int) -> GPTArchitecture:
    """The run's model for a tokenizer of ``vocab_size`` ids (``flags.model.gpt_architecture``:
    ``--hf-checkpoint``'s own architecture, else the model section's)."""
    return gpt_architecture(cfg.model, cfg.hf, vocab_size)


def parallel_overrides(cfg: RunConfig) -> dict:
    """The TransformerConfig fields of the parallel layout (and of the experts' training)."""
    fields = dict(
        tensor_model_parallel_size=cfg.parallelism.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.parallelism.pipeline_model_parallel_size,
    )
    if cfg.architecture_flags.get("num_experts") is not None:
        coeff = cfg.model.moe_aux_loss_coeff
        fields.update(
            expert_model_parallel_size=cfg.parallelism.expert_model_parallel_size,
            moe_router_load_balancing_type=(
                cfg.model.moe_router_load_balancing_type if coeff > 0 else "none"
            ),
            moe_aux_loss_coeff=coeff,
            moe_grouped_gemm=cfg.model.moe_grouped_gemm,
        )
    return fields


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
