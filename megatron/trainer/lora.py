"""The run's LoRA: adapters on the model a tier builds, ``--lora-checkpoint`` in, ``--save-lora``
out.

The library (``megatron.rl.lora``) holds the adapters and their formats; this module ties them to
the flags: ``attach_adapters`` is what both tiers call on a freshly loaded base model (adapters,
the starting adapter directory, on the CPU tier under ``--bf16`` the frozen linear weights stored
in bfloat16), and ``save_lora`` writes the PEFT directory at the end of a run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron.rl.lora.config import LoRAConfig
from megatron.rl.lora.model import apply_lora, lora_adapters, store_frozen_linear_weights
from megatron.rl.lora.peft import (
    AdapterLoadError,
    gather_adapter_tensors,
    load_adapter_directory,
    write_adapter_directory,
)
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.initialize import ParallelContext


def lora_config(cfg: RunConfig) -> LoRAConfig | None:
    """The adapters of the LoRA flags (None: full fine-tuning)."""
    lora = cfg.lora
    if not lora.enabled:
        return None
    return LoRAConfig(
        rank=lora.lora_rank,
        alpha=lora.lora_alpha,
        targets=tuple(lora.lora_target_modules),
        init=lora.lora_init,
        seed=cfg.training.seed,
    )


def attach_adapters(
    model: torch.nn.Module,
    cfg: RunConfig,
    store_base: bool = False,
    base_dtype: torch.dtype | None = None,
) -> None:
    """Freeze ``model`` and give it the run's adapters (nothing without LoRA): initialized as
    ``--lora-init`` says, or ``--lora-checkpoint``'s. ``store_base`` (the CPU tier): keep the
    frozen linear weights transposed for the engine's products, in ``base_dtype`` if given
    (``--bf16``) (``megatron.rl.lora.model.store_frozen_linear_weights``)."""
    config = lora_config(cfg)
    if config is None:
        return
    adapters = apply_lora(model, config)
    if cfg.lora.lora_checkpoint is not None:
        try:
            load_adapter_directory(adapters, cfg.lora.lora_checkpoint)
        except (AdapterLoadError, ValueError) as err:
            raise SystemExit(f"pretrain_grpo.py: error: --lora-checkpoint: {err}") from None
    if store_base:
        store_frozen_linear_weights(model, base_dtype)


def save_lora(cfg: RunConfig, model: torch.nn.Module, ctx: ParallelContext) -> Path | None:
    """Write the adapters to ``--save-lora`` as a PEFT directory (collective over TP; rank 0
    writes); its path on rank 0. The tensors are float32, ``base_model_name_or_path`` is
    ``--hf-checkpoint``."""
    adapters = lora_adapters(model)
    if adapters is None or cfg.lora.save_lora is None:
        return None
    tensors = gather_adapter_tensors(adapters)
    if not ctx.is_main:
        return None
    base = str(Path(cfg.model.hf_checkpoint).resolve()) if cfg.model.hf_checkpoint else None
    return write_adapter_directory(cfg.lora.save_lora, tensors, adapters.config, base)
