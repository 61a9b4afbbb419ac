"""The model section -> ``GPTArchitecture`` -> the megatron-core ``GPTModel`` trained and used for
rollouts.

``ModelBuild`` is what building the run's model reads (built from the run config by
``config.model_build``). ``architecture(spec, vocab_size)`` is the run's model
(``flags.model.gpt_architecture``: the model section's options, or ``--hf-checkpoint``'s
``config.json`` architecture verbatim). The tiers build the model with
``megatron.rl.models.architecture`` and their own precision and fusions; ``build_model`` is the
CPU tier's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron.rl.lora.config import LoRAConfig
from megatron.rl.models.architecture import (
    GPTArchitecture,
    build_gpt_model,
    layer_spec,
    transformer_config,
)
from megatron.rl.models.gpt_spec import SDPASpecProvider, plain_output_layer
from megatron.trainer.flags.model import Model, gpt_architecture

if TYPE_CHECKING:
    from megatron.rl.models.hf import HFModelConfig


@dataclass(frozen=True)
class ModelBuild:
    """What building the run's model reads: both tiers, ``reference.py``, ``lora.py`` and
    ``hf_io.py`` (``config.model_build``)."""

    section: Model
    """The model section: the architecture (without ``hf``), ``--moe-*``, the routing mode,
    ``--make-vocab-size-divisible-by`` and the Hugging Face paths."""
    hf: HFModelConfig | None = None
    """``--hf-checkpoint``'s config.json (None without it): its architecture wins."""
    tensor_parallel: int = 1
    """``--tensor-model-parallel-size``."""
    pipeline_parallel: int = 1
    """``--pipeline-model-parallel-size`` (the CUDA tier's stages)."""
    expert_parallel: int = 1
    """``--expert-model-parallel-size``."""
    moe: bool = False
    """Whether the resolved architecture routes to experts (its ``num_experts`` is set)."""
    bf16: bool = False
    """``--bf16``: bfloat16 compute (CPU: autocast on float32 weights; CUDA: bf16 weights)."""
    recompute: bool = False
    """``--recompute-granularity full``: every layer recomputed in the backward pass."""
    lora: LoRAConfig | None = None
    """The adapters of the LoRA flags (None: full fine-tuning)."""
    lora_checkpoint: str | None = None
    """``--lora-checkpoint``: the PEFT directory the adapters start from."""


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Embedding rows: ``vocab_size`` rounded up to a multiple of ``divisible_by``.

    The multiple does not depend on the TP degree, so every parallel layout builds (and, from the
    same seed, initializes) the same embedding table.
    """
    return -(-vocab_size // divisible_by) * divisible_by


def architecture(spec: ModelBuild, vocab_size: int) -> GPTArchitecture:
    """The run's model for a tokenizer of ``vocab_size`` ids (``flags.model.gpt_architecture``:
    ``--hf-checkpoint``'s own architecture, else the model section's)."""
    return gpt_architecture(spec.section, spec.hf, vocab_size)


def parallel_overrides(spec: ModelBuild) -> dict:
    """The TransformerConfig fields of the parallel layout (and of the experts' training)."""
    fields = dict(
        tensor_model_parallel_size=spec.tensor_parallel,
        pipeline_model_parallel_size=spec.pipeline_parallel,
    )
    if spec.moe:
        coeff = spec.section.moe_aux_loss_coeff
        fields.update(
            expert_model_parallel_size=spec.expert_parallel,
            moe_router_load_balancing_type=(
                spec.section.moe_router_load_balancing_type if coeff > 0 else "none"
            ),
            moe_aux_loss_coeff=coeff,
            moe_grouped_gemm=spec.section.moe_grouped_gemm,
        )
    return fields


def build_model(
    spec: ModelBuild,
    vocab_size: int,
    device: torch.device,
    initialize: bool = True,
    pg_collection: ProcessGroupCollection | None = None,
) -> GPTModel:
    """The CPU tier's GPT (SDPA core attention, float32, one pipeline stage) of the flags, for a
    tokenizer of ``vocab_size`` ids. ``initialize=False`` skips megatron-core's random init
    (``perform_initialization``): for a model whose every tensor a checkpoint load overwrites.
    ``pg_collection``: its process groups (None: megatron-core's parallel state; an inference
    copy on its own layout passes its own, with ``spec.tensor_parallel`` that group's size)."""
    arch = architecture(spec, vocab_size)
    config = transformer_config(arch, **parallel_overrides(spec), perform_initialization=initialize)
    spec_ = layer_spec(arch, SDPASpecProvider())
    model = build_gpt_model(arch, config, spec_, pg_collection=pg_collection).to(device)
    return plain_output_layer(model)
