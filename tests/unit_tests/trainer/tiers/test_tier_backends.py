"""The tiers build their engine's row runner through the inference-backend registry
(``megatron.rl.inference.backends``): each tier's default backend, and what it passes the
provider."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.models import VOCAB
from grpo_testing.trainer import one_rank_context, train_args
from megatron.core import parallel_state

from megatron.rl.inference import backends
from megatron.rl.inference.backends import InferenceBackend, RunnerInputs
from megatron.rl.inference.scheduler import SchedulerConfig
from megatron.rl.inference.step_group import StepGroup
from megatron.trainer.config import tier_config
from megatron.trainer.tiers import CPUTier, CUDATier


@pytest.fixture
def fake_backend(monkeypatch) -> list[RunnerInputs]:
    """Every tier's default backend replaced by one that records what it was given."""
    built: list[RunnerInputs] = []
    spec = InferenceBackend("fake", "records its inputs", lambda i: built.append(i) or "runner")
    monkeypatch.setitem(backends.BACKENDS, "fake", spec)
    for tier in ("cpu", "cuda"):
        monkeypatch.setitem(backends.DEFAULT_BACKEND, tier, "fake")
    return built


def test_each_tier_runs_its_default_backend():
    ctx = None  # the backend depends on the tier only
    assert CPUTier(tier_config(train_args()), ctx).inference_backend() is backends.backend("cpu")
    assert CUDATier(tier_config(train_args()), ctx).inference_backend() is backends.backend(
        "megatron_core"
    )


@pytest.mark.parametrize("tier_class", [CPUTier, CUDATier], ids=["cpu", "cuda"])
def test_the_step_group_runs_the_registered_backend(single_rank_world, fake_backend, tier_class):
    parallel_state.initialize_model_parallel()
    ctx = one_rank_context()
    tier = tier_class(tier_config(train_args()), ctx)
    model = torch.nn.Linear(1, 1)
    config = SchedulerConfig(max_requests=2, max_seq_len=32, eos_id=1)
    steps = tier.build_step_group(model, config, VOCAB)
    assert isinstance(steps, StepGroup) and steps.runner == "runner"
    (inputs,) = fake_backend
    assert inputs.model is model and inputs.config is config and inputs.vocab_size == VOCAB
    assert inputs.device == ctx.device and inputs.tp_group is ctx.tp_group and inputs.tp_size == 1
    if tier_class is CUDATier:
        assert inputs.padded_vocab_size == 24  # VOCAB 21 padded to a multiple of 8
    else:
        assert inputs.compute_dtype is None  # no --bf16
