"""The tier seam: the device selects the tier, and the tier is bound to the run's flags."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.trainer import one_rank_context, train_args
from megatron.core import parallel_state

from megatron.trainer.tiers import CPUTier, CUDATier, select_tier, tier_class


def test_the_device_selects_the_tier():
    assert tier_class(torch.device("cpu")) is CPUTier
    assert tier_class(torch.device("cuda", 0)) is CUDATier


@pytest.mark.usefixtures("single_rank_world")
def test_select_tier_binds_args_and_context():
    parallel_state.initialize_model_parallel()
    ctx = one_rank_context()
    args = train_args()
    tier = select_tier(args, ctx)
    assert isinstance(tier, CPUTier) and tier.name == "cpu"
    assert tier.cfg is args and tier.ctx is ctx and tier.describe() == "tier: cpu"
