"""The tier seam: the device selects the tier, and the tier reads the run through its
``TierConfig`` (``config.tier_config``), never the run config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from grpo_testing.trainer import one_rank_context, train_args
from megatron.core import parallel_state

import megatron.trainer
from megatron.trainer.config import tier_config
from megatron.trainer.runtime import allocator
from megatron.trainer.tiers import CPUTier, CUDATier, cpu as cpu_tier, select_tier, tier_class


def test_the_device_selects_the_tier():
    assert tier_class(torch.device("cpu")) is CPUTier
    assert tier_class(torch.device("cuda", 0)) is CUDATier


@pytest.mark.usefixtures("single_rank_world")
def test_select_tier_binds_the_tier_config_and_context():
    parallel_state.initialize_model_parallel()
    ctx = one_rank_context()
    args = train_args()
    tier = select_tier(tier_config(args), ctx)
    assert isinstance(tier, CPUTier) and tier.name == "cpu"
    assert tier.config == tier_config(args) and tier.ctx is ctx
    assert tier.describe() == f"tier: cpu | allocator {allocator.loaded()}"


def test_the_tier_config_carries_what_the_tiers_read():
    args = train_args(
        bf16=True,
        recompute_granularity="full",
        ref_load="ck",
        lr_decay_iters=None,
        lora_rank=4,
        lora_target_modules=("q_proj", "v_proj"),
    )
    config = tier_config(args)
    assert config.ref_load == "ck" and config.model.section is args.model
    assert config.model.bf16 and config.model.recompute and not config.model.moe
    assert config.model.lora.rank == 4 and config.model.lora.seed == args.training.seed
    assert config.optimizer.decay_iters == args.training.train_iters  # the default decay
    assert config.optimizer.lr == args.training.lr and not config.optimizer.distributed


def test_the_tiers_and_what_they_build_with_never_read_the_run_config():
    """An option a tier uses touches its section, its line in ``config.tier_config`` and its
    use: the tiers, the model and the update read only their typed configs."""
    trainer = Path(megatron.trainer.__file__).parent
    readers = [
        str(path.relative_to(trainer))
        for package in ("tiers", "model", "train")
        for path in sorted((trainer / package).glob("*.py"))
        if "RunConfig" in path.read_text() or "flags.run " in path.read_text()
    ]
    assert readers == []


@pytest.mark.parametrize(
    "native", [pytest.param(True, id="bf16-instructions"), pytest.param(False, id="avx2-only")]
)
@pytest.mark.usefixtures("single_rank_world")
def test_bf16_on_a_cpu_without_bf16_instructions_says_so_in_the_header(monkeypatch, native):
    parallel_state.initialize_model_parallel()
    monkeypatch.setattr(cpu_tier, "bf16_products_native", lambda: native)
    header = select_tier(tier_config(train_args(bf16=True)), one_rank_context()).describe()
    assert "bf16 autocast" in header
    assert ("no bfloat16 matrix instructions" in header) is not native
    plain = select_tier(tier_config(train_args()), one_rank_context()).describe()
    assert "bfloat16 matrix" not in plain  # float32 runs are not told about it
