"""The run's LoRA: adapters on the model a tier builds, ``--lora-checkpoint`` in, ``--save-lora``
out.

The library (``megatron.rl.lora``) holds the adapters and their formats; this module ties them to
the run (``provider.ModelBuild``, whose ``LoRAConfig`` ``config.lora_config`` builds from the LoRA
flags): ``attach_adapters`` is what both tiers call on a freshly loaded base model (adapters,
the starting adapter directory, on the CPU tier under ``--bf16`` the frozen linear weights stored
in bfloat16), and ``save_lora`` writes the PEFT directory at the end of a run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron.rl.lora.frozen import store_frozen_linear_weights
from megatron.rl.lora.model import apply_lora, lora_adapters
from megatron.rl.lora.peft import (
    AdapterLoadError,
    gather_adapter_tensors,
    load_adapter_directory,
    write_adapter_directory,
)
from megatron.trainer.model.provider import ModelBuild
from megatron.trainer.parallel import ParallelContext


def attach_adapters(
    model: torch.nn.Module,
    spec: ModelBuild,
    store_base: bool = False,
    base_dtype: torch.dtype | None = None,
) -> None:
    """Freeze ``model`` and give it the run's adapters (nothing without LoRA): initialized as
    ``--lora-init`` says, or ``--lora-checkpoint``'s. ``store_base`` (the CPU tier): keep the
    frozen linear weights transposed for the engine's products, in ``base_dtype`` if given
    (``--bf16``) (``megatron.rl.lora.frozen.store_frozen_linear_weights``)."""
    if spec.lora is None:
        return
    adapters = apply_lora(model, spec.lora)
    if spec.lora_checkpoint is not None:
        try:
            load_adapter_directory(adapters, spec.lora_checkpoint)
        except (AdapterLoadError, ValueError) as err:
            raise SystemExit(f"pretrain_grpo.py: error: --lora-checkpoint: {err}") from None
    if store_base:
        store_frozen_linear_weights(model, base_dtype)


def save_lora(
    directory: str, model: torch.nn.Module, spec: ModelBuild, ctx: ParallelContext
) -> Path | None:
    """Write the adapters to ``directory`` (``--save-lora``) as a PEFT directory (collective over
    TP; rank 0 writes); its path on rank 0. The tensors are float32, ``base_model_name_or_path``
    is ``--hf-checkpoint``."""
    adapters = lora_adapters(model)
    if adapters is None:
        return None
    tensors = gather_adapter_tensors(adapters)
    if not ctx.is_main:
        return None
    checkpoint = spec.section.hf_checkpoint
    base = str(Path(checkpoint).resolve()) if checkpoint else None
    return write_adapter_directory(directory, tensors, adapters.config, base)
