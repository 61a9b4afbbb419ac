"""Hugging Face checkpoints in and out of a run: ``--hf-checkpoint`` weights, ``--save-hf`` export.

The library (``megatron.rl.models.hf``) maps tensors; this module ties it to the run's model
(``provider.ModelBuild``) and parallel layout, and turns its errors into one message naming the flag.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from megatron.core.utils import unwrap_model

from megatron.rl.lora.model import is_adapter_key, lora_adapters, merged_state_dict
from megatron.rl.models.architecture import GPTArchitecture
from megatron.rl.models.hf import (
    HFCheckpointError,
    export_hf,
    gather_tensor_parallel_state_dicts,
    hf_weight_readers,
    load_hf_checkpoint,
)
from megatron.rl.models.hf.families import export_family_of
from megatron.trainer.model.provider import ModelBuild
from megatron.trainer.parallel import ParallelContext


def export_family(arch: GPTArchitecture) -> str:
    """The Hugging Face family an architecture is exported as (``export_family_of``): Qwen3 (QK
    norm), Qwen2 (QKV bias only), else Llama."""
    return export_family_of(arch).name


def weight_loader(spec: ModelBuild) -> Callable[[torch.nn.Module], None] | None:
    """What fills a freshly built model from ``--hf-checkpoint`` (None without one)."""
    if spec.hf is None:
        return None
    return functools.partial(_load, directory=spec.section.hf_checkpoint, hf=spec.hf)


def _load(model: torch.nn.Module, directory: str, hf) -> None:
    try:
        load_hf_checkpoint(model, directory, hf)
    except HFCheckpointError as err:
        raise SystemExit(f"pretrain_grpo.py: error: --hf-checkpoint: {err}") from None


def save_hf(
    spec: ModelBuild,
    model: torch.nn.Module,
    arch: GPTArchitecture,
    vocab_size: int,
    ctx: ParallelContext,
) -> Path | None:
    """Write the policy to ``--save-hf`` (collective over TP; rank 0 writes); its path on rank 0.

    A LoRA policy is written merged: each adapted weight is ``W + (alpha / rank) * B @ A``
    summed in float32 with ``W`` the ``--hf-checkpoint``'s own values (re-read: under ``--bf16``
    the run keeps its frozen base in bfloat16, which is not the base), and written in float32
    when the checkpoint's dtype is narrower (rounding the sum to it would drop most of the
    update). Otherwise the weights are written in the checkpoint's dtype.

    ``vocab_size``: the embedding rows to keep (the checkpoint's when the run loaded one, else
    the tokenizer's).
    """
    merged = _merged_policy(spec, model, ctx)
    shards = gather_tensor_parallel_state_dicts(unwrap_model(model), ctx.tp_group, merged)
    if not ctx.is_main:
        return None
    hf = spec.hf
    family = hf.family if hf is not None else export_family(arch)
    dtype = None
    if hf is not None and hf.dtype in ("float16", "bfloat16", "float32"):
        dtype = getattr(torch, hf.dtype)  # as the checkpoint that was loaded
    if lora_adapters(model) is not None and dtype in (torch.float16, torch.bfloat16):
        print(
            f"--save-hf: the merged LoRA policy is written in float32 ({hf.dtype} would round "
            "the adapters' update away)",
            flush=True,
        )
        dtype = torch.float32
    return export_hf(
        spec.section.save_hf,
        arch,
        [{k: v.float() for k, v in shard.items()} for shard in shards],
        family=family,
        vocab_size=vocab_size,
        dtype=dtype,
        tokenizer_dir=spec.section.tokenizer_model,
    )


def _merged_policy(
    spec: ModelBuild, model: torch.nn.Module, ctx: ParallelContext
) -> dict[str, torch.Tensor]:
    """This rank's policy weights: with LoRA merged onto the ``--hf-checkpoint``'s own base
    values where that checkpoint is the base the adapters were trained on, else onto the stored
    base (a ``--finetune --load`` base), with a line saying so."""
    if lora_adapters(model) is None or spec.hf is None:
        return merged_state_dict(model)
    directory = spec.section.hf_checkpoint
    try:
        readers = hf_weight_readers(unwrap_model(model), directory, spec.hf, extra=is_adapter_key)
        return merged_state_dict(model, readers)
    except ValueError as err:  # BaseMismatchError, HFCheckpointError: not that base
        if ctx.is_main:
            print(
                f"--save-hf: merging onto the run's stored base, not --hf-checkpoint {directory} "
                f"({err})",
                flush=True,
            )
        return merged_state_dict(model)
