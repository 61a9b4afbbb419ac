"""The frozen teacher of on-policy distillation (``--distill-teacher DIR``).

The teacher is a third model on every rank, held frozen in eval mode and never saved: its
logprobs of each trained token (and its argmax) are computed once per collection where the
reference logprobs are (``Policy.get_teacher_logprobs``), on the policy's parallel layout (its TP
shard and pipeline stage) and precision (``--bf16``). Its weights come from either

* a Hugging Face directory (``config.json`` and safetensors): its own architecture, which may
  differ from the policy's (a larger teacher), loaded as ``--hf-checkpoint`` loads the policy's;
* or a checkpoint directory of ours (``latest_checkpointed_iteration.txt``): the policy's
  architecture, the model weights of its latest checkpoint (the tier's shards, as ``--ref-load``).

Either way the tokenizer must be the policy's (``flags/distill.py`` checks it before anything is
built). Building it draws no random numbers, so a distilling run draws the same ones as a run
without a teacher. A URL instead of a directory is a teacher behind a server: no model is built
(``train/remote_teacher.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.trainer.checkpoint.directory import iteration_dir, latest_iteration, read_guarded
from megatron.trainer.flags.distill import is_server_url
from megatron.trainer.tiers.base import TeacherSource, Tier
from megatron.trainer.train.remote_teacher import RemoteTeacher

FLAG = "--distill-teacher"


def build_teacher_model(tier: Tier, vocab_size: int) -> torch.nn.Module | RemoteTeacher | None:
    """The frozen teacher of ``tier.config.teacher`` on this rank, or the server that scores for
    it (None without one)."""
    source = tier.config.teacher
    if source is None:
        return None
    if is_server_url(source.directory):
        return RemoteTeacher(source.directory, source.api_key, tier.ctx)
    device = tier.ctx.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if source.hf is None:
            teacher = _from_checkpoint(tier, vocab_size, source.directory)
        else:
            teacher = _from_hugging_face(tier, vocab_size, source)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


def _from_checkpoint(tier: Tier, vocab_size: int, directory: str) -> torch.nn.Module:
    """The policy's architecture with the model weights of ``directory``'s latest checkpoint."""
    teacher = tier.build_reference(vocab_size, initialize=False)  # every tensor loaded below
    iteration = latest_iteration(directory, FLAG)
    path, shards = iteration_dir(directory, iteration), tier.checkpoint_shards()
    read_guarded(
        FLAG,
        directory,
        iteration,
        shards.path(path),
        lambda: shards.read_model(path, teacher, FLAG),
    )
    return teacher


def _from_hugging_face(tier: Tier, vocab_size: int, source: TeacherSource) -> torch.nn.Module:
    """The Hugging Face directory's own architecture and weights, on the policy's layout."""
    from megatron.rl.models.hf import HFCheckpointError, load_hf_checkpoint

    section = dataclasses.replace(tier.config.model.section, hf_checkpoint=source.directory)
    spec = dataclasses.replace(
        tier.config.model,
        section=section,
        hf=source.hf,
        moe=source.hf.arch.num_experts is not None,
        recompute=False,
        lora=None,
        lora_checkpoint=None,
    )

    def load(model: torch.nn.Module) -> None:
        try:
            load_hf_checkpoint(model, source.directory, source.hf)
        except HFCheckpointError as err:
            raise SystemExit(f"pretrain_grpo.py: error: {FLAG}: {err}") from None

    teacher_tier = type(tier)(dataclasses.replace(tier.config, model=spec, teacher=None), tier.ctx)
    return teacher_tier.build_reference(vocab_size, load=load)
