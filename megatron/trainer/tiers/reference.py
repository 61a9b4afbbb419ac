"""The frozen reference policy of the KL term (``--grpo-kl-beta``, ``--ref-load``).

The reference is a second model of the same shape (this rank's TP shard and pipeline stage,
built by the tier: ``Tier.build_reference``, no DDP) holding either the policy's *initial*
weights or, with ``--ref-load DIR``, the model weights of the latest checkpoint in DIR (the
tier's checkpoint shards). It is not saved in checkpoints. On resume it is rebuilt the same way:
the policy is first built from ``--seed`` exactly as in the original run (``--seed`` and the model
shape must match to resume), the reference copies those initial weights, and only then does
``--load`` overwrite the policy; ``--ref-load`` is simply read again. Building it does not advance
the run's RNG streams, so a run with the KL term draws the same random numbers as one without.
The policy reads it through ``Policy.get_reference_policy_logprobs``.

With LoRA (``--lora-rank``) and no ``--ref-load`` the reference is the policy model itself: its
base weights are frozen, and the policies run reference forwards with every adapter off
(``megatron.rl.lora.model.base_model``); no second copy of the weights exists.
"""

from __future__ import annotations

import torch
from megatron.core.utils import unwrap_model

from megatron.rl.lora.model import lora_adapters
from megatron.trainer.checkpoint.directory import iteration_dir, latest_iteration, read_guarded
from megatron.trainer.tiers.base import Tier


def build_reference_model(
    tier: Tier, policy: torch.nn.Module, vocab_size: int, needs_reference: bool
) -> torch.nn.Module | None:
    """The frozen reference (eval mode, no gradients), or None when no loss term needs it;
    ``--ref-load`` is the tier's ``config.ref_load``.

    Call before ``--load`` restores the policy, so that ``policy`` holds its initial weights.
    """
    if not needs_reference:
        return None
    ref_load = tier.config.ref_load
    if lora_adapters(policy) is not None and ref_load is None:
        return policy  # the base is frozen in the policy: adapters off (``lora.base_model``)
    device = tier.ctx.device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # a guard: building draws nothing (no init)
        reference = tier.build_reference(vocab_size, initialize=False)  # every tensor loaded below
    if ref_load is not None:
        iteration = latest_iteration(ref_load, "--ref-load")
        directory, shards = iteration_dir(ref_load, iteration), tier.checkpoint_shards()
        read_guarded(
            "--ref-load",
            ref_load,
            iteration,
            shards.path(directory),
            lambda: shards.read_model(directory, reference, "--ref-load"),
        )
    else:
        unwrap_model(reference).load_state_dict(unwrap_model(policy).state_dict())
    reference.eval()
    reference.requires_grad_(False)
    return reference
