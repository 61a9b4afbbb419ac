"""The CPU and CUDA tiers behind one interface (``base.Tier``), chosen once by the device."""

from __future__ import annotations

import torch

from megatron.trainer.parallel import ParallelContext
from megatron.trainer.tiers.base import Tier, TierConfig
from megatron.trainer.tiers.cpu import CPUTier
from megatron.trainer.tiers.cuda import CUDATier


def tier_class(device: torch.device) -> type[Tier]:
    """The tier of a device: ``CUDATier`` for a CUDA device, ``CPUTier`` otherwise."""
    return CUDATier if device.type == "cuda" else CPUTier


def select_tier(config: TierConfig, ctx: ParallelContext) -> Tier:
    """The tier this process runs (by ``ctx.device``, set by ``initialize_distributed``)."""
    return tier_class(ctx.device)(config, ctx)


__all__ = ["CPUTier", "CUDATier", "Tier", "TierConfig", "select_tier", "tier_class"]
